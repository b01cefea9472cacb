"""Write the independent reference of tests/loading/test_independent_reference.py: the whole model as stock vLLM loads it.

    VLLM_MINICPM_HOTFIX=off  <vLLM 0.32.0 python>  tests/programs/reference_state_dict.py
        OUT_DIR DTYPE LABEL=CHECKPOINT_DIR...

Run by the test in a fresh interpreter of the vLLM 0.32.0 environment, a release whose own q/k/v loading is correct
(tests/support/expected.py ``VERDICTS``). It imports nothing of vllm-minicpm-hotfix -- not even its CPU model builder -- and
refuses to run if the package is importable or imported, so the reference cannot be the hotfix's own output. For each
checkpoint it does what a vLLM worker does at start-up, with vLLM's own API only: initialise vLLM's (single-rank,
gloo) distributed state, build ``MiniCPMV4_6ForConditionalGeneration`` from ``ModelConfig(model=DIR, dtype=DTYPE)``
under ``set_current_vllm_config``, and load it with ``DefaultModelLoader.load_weights`` (vLLM's safetensors iterator,
the model's own ``load_weights``, vLLM's "weights not initialized" check). Post-processing
(``process_weights_after_loading``) is left out on both sides: on CPU it repacks the linear layers for its kernels.

Every parameter and buffer (``named_parameters`` / ``named_buffers`` with ``remove_duplicate=False``, so tied
aliases appear under each name) is written to ``OUT_DIR/LABEL.safetensors`` (each tensor cloned:
safetensors refuses shared storage); ``OUT_DIR/LABEL.json`` records the vLLM version, the parameter names, the
buffer names and what ``load_weights`` returned.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out_dir: str, dtype: str, checkpoints: list[str]) -> None:
    # sys.path[0] is this folder (tests/programs/); the repository root is not on the path. The hotfix must be
    # nowhere.
    assert os.environ.get("VLLM_MINICPM_HOTFIX") == "off", "run with VLLM_MINICPM_HOTFIX=off"
    assert importlib.util.find_spec("vllm_minicpm_hotfix") is None, "vllm-minicpm-hotfix is importable here"
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    assert dtype in DTYPES, dtype

    import torch
    import vllm
    from safetensors.torch import save_file
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.minicpmv4_6 import MiniCPMV4_6ForConditionalGeneration

    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                 local_rank=0, backend="gloo")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in checkpoints:
        name, _, ckpt = spec.partition("=")
        model_config = ModelConfig(model=ckpt, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True)
        vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        old = torch.get_default_dtype()
        with set_current_vllm_config(vllm_config):
            if not model_parallel_is_initialized():
                initialize_model_parallel(1, 1)
            torch.set_default_dtype(model_config.dtype)
            try:
                with torch.device("cpu"):
                    model = MiniCPMV4_6ForConditionalGeneration(vllm_config=vllm_config)
            finally:
                torch.set_default_dtype(old)
            loaded = get_model_loader(vllm_config.load_config).load_weights(model, model_config)
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        tensors = {n: t.detach().clone().contiguous() for n, t in {**params, **buffers}.items()}
        save_file(tensors, str(out / f"{name}.safetensors"))
        (out / f"{name}.json").write_text(json.dumps({
            "vllm": vllm.__version__,
            "hotfix_imported": any(m.startswith("vllm_minicpm_hotfix") for m in sys.modules),
            "parameters": sorted(params),
            "buffers": sorted(buffers),
            "loaded": sorted(loaded) if loaded is not None else None,
        }))
        print(f"{name}: {len(params)} parameters, {len(buffers)} buffers", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
