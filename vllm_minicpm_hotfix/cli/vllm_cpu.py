"""Build a real vLLM ``MiniCPMV4_6ForConditionalGeneration`` on CPU and load a checkpoint into it: ``verify``'s
model construction (:func:`construct_model`), and the builder the demo, benchmarks/ and tests/ (through
tests/support/vllm_build.py, which adds what only tests use) import from here.

The recipe is the measured one in shared/notes/vllm-on-cpu.md ("How the model was built and loaded"), the same
``model.load_weights(iter over (name, tensor))`` call vLLM's DefaultModelLoader makes.  The API used here is the same
in every vLLM release 0.26.0-0.33.0.

    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, checkpoint_tensors
    model = build_vllm_model(ckpt_dir)                                  # raises what load_weights raises
    ckpt = checkpoint_tensors(ckpt_dir)
    assert torch.equal(model.vit_merger.self_attn.qkv_proj.weight, torch.cat([ckpt[q], ckpt[k], ckpt[v]]))

Importing this module does not import vLLM (``import vllm`` takes ~30 s); the functions do.  Set
``VLLM_TARGET_DEVICE=cpu`` before calling them (done here with ``setdefault`` if unset).

The checkpoint's files are listed and read by :mod:`vllm_minicpm_hotfix.checkpoint`, the one module of the package
this one imports: tests/support/ray_driver.py runs the two files' sources in Ray actors of nodes that have no hotfix
installed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

import torch

from ..checkpoint import iter_tensors

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

_distributed_ready = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed(backend: str = "gloo") -> None:
    """Initialise vLLM's single-rank distributed environment once per process, on a free port of 127.0.0.1
    (``vllm.distributed.parallel_state.init_distributed_environment``, world size 1, rank 0). ``backend`` is
    ``torch.distributed``'s: ``"gloo"`` on CPU, ``"nccl"`` on a GPU. Nothing to do if ``torch.distributed`` is
    already initialised (by an earlier call, or by the caller)."""
    global _distributed_ready
    if _distributed_ready:
        return
    if backend == "gloo":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch.distributed as dist
    from vllm.distributed.parallel_state import init_distributed_environment

    if not dist.is_initialized():
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
            local_rank=0,
            backend=backend,
        )
    _distributed_ready = True


def checkpoint_tensors(checkpoint_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder by name, on the CPU in the file's dtype (handles
    ``model.safetensors.index.json`` shards).

    Raises:
        ValueError: a tensor name in two shards (and what :func:`vllm_minicpm_hotfix.checkpoint.iter_tensors` raises).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_tensors(checkpoint_dir):
        if name in out:
            raise ValueError(f"tensor {name} appears in more than one shard of {checkpoint_dir}")
        out[name] = t
    return out


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def construct_model(model_cls: type, vllm_config: Any, device: str = "cpu") -> Any:
    """``model_cls(vllm_config=vllm_config)`` as vLLM's ``initialize_model`` (``model_loader/utils.py``) constructs
    it: under the config, with vLLM's single-rank model-parallel groups (made here if there are none), the quant
    config's layer lists mapped to the class's names (``configure_quant_config``; without it every GPTQ layer is
    built unquantized), the model's dtype (:func:`model_dtype`) as torch's default dtype and ``device`` as the
    default device. Not loaded. Call :func:`ensure_distributed` first. Raises what the constructor raises."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import initialize_model_parallel, model_parallel_is_initialized

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
        if vllm_config.quant_config is not None:
            from vllm.model_executor.model_loader.utils import configure_quant_config

            configure_quant_config(vllm_config.quant_config, model_cls)
        with _default_dtype(model_dtype(vllm_config)), torch.device(device):
            return model_cls(vllm_config=vllm_config)


def model_dtype(vllm_config: Any) -> torch.dtype:
    """``vllm_config.model_config.dtype`` as a ``torch.dtype`` (a string is torch's name, ``float`` and ``half``
    included)."""
    dtype = vllm_config.model_config.dtype
    return (_DTYPES.get(dtype) or getattr(torch, dtype)) if isinstance(dtype, str) else dtype


def make_vllm_config(checkpoint_dir: str | os.PathLike, dtype: str = "float32", **model_kwargs):
    """vLLM's ``VllmConfig`` for ``checkpoint_dir`` on CPU: ``ModelConfig(model=..., dtype=dtype,
    skip_tokenizer_init=True, enforce_eager=True, **model_kwargs)`` (``model_kwargs`` override those defaults)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, **model_kwargs}
    model_config = ModelConfig(model=str(checkpoint_dir), dtype=dtype, **kwargs)
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))


def build_vllm_model(checkpoint_dir: str | os.PathLike, dtype: str = "float32", *, load: bool = True, model_cls=None,
                     **model_kwargs):
    """Construct vLLM's ``MiniCPMV4_6ForConditionalGeneration`` for ``checkpoint_dir`` on CPU and (by default) load
    the checkpoint with ``model.load_weights`` -- whatever that raises propagates.

    ``model_cls`` overrides the class (e.g. ``MiniCPMV4_7ForConditionalGeneration``); ``load=False`` returns the
    freshly constructed model (load it later with :func:`load_checkpoint`); ``model_kwargs`` go to vLLM's
    ``ModelConfig`` (:func:`make_vllm_config`).  The model is returned in eval mode, its ``VllmConfig`` as
    ``model.vllm_config``.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    ensure_distributed()
    from vllm.config import set_current_vllm_config

    if model_cls is None:
        from vllm.model_executor.models.minicpmv4_6 import MiniCPMV4_6ForConditionalGeneration as model_cls

    vllm_config = make_vllm_config(checkpoint_dir, dtype, **model_kwargs)
    model = construct_model(model_cls, vllm_config)
    if load:
        with set_current_vllm_config(vllm_config):
            model.load_weights(iter_tensors(checkpoint_dir))
    model.vllm_config = vllm_config  # handy for callers that run a forward pass under set_current_vllm_config
    return model.eval()


def load_checkpoint(model, checkpoint_dir: str | os.PathLike):
    """``model.load_weights`` over the checkpoint, under the model's vLLM config; returns what it returns."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config):
        return model.load_weights(iter_tensors(checkpoint_dir))

