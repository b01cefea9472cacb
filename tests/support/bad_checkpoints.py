"""Bad checkpoints (written from the bundled tiny one) and vLLM's two ways of loading them: at engine start-up and as
its model loader does."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from safetensors.torch import save_file
from support.vllm_build import build_vllm_model, checkpoint_tensors, ensure_distributed, make_vllm_config

P = "model.vision_tower.vit_merger.self_attn."
QKV = ("q", "k", "v")


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    """The tiny checkpoint's tensors (float32, q/k/v randomised and all different)."""
    return checkpoint_tensors(TINY)


def write_checkpoint(dest: Path, tensors: dict | None = None, files: dict[str, dict] | None = None) -> Path:
    """A checkpoint folder: the tiny model's config.json plus ``tensors`` as one ``model.safetensors``, or ``files``
    (file name -> tensors) as a sharded set with a ``model.safetensors.index.json`` mapping each name to the FIRST
    file that holds it (an index maps a name to one file only)."""
    dest.mkdir(parents=True)
    shutil.copy(TINY / "config.json", dest / "config.json")
    if files is None:
        files = {"model.safetensors": tensors}
    for fname, ts in files.items():
        save_file({k: v.contiguous() for k, v in ts.items()}, str(dest / fname))
    if len(files) > 1:
        weight_map: dict[str, str] = {}
        for fname, ts in files.items():
            for k in ts:
                weight_map.setdefault(k, fname)
        (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dest


def without(tensors: dict, *names: str) -> dict:
    return {k: v for k, v in tensors.items() if k not in names}


def fused_only(base: dict) -> dict:
    """case-04: the vit_merger self-attention re-saved with one fused ``qkv_proj.{weight,bias}``."""
    out = without(base, *(f"{P}{p}_proj.{s}" for p in QKV for s in ("weight", "bias")))
    for s in ("weight", "bias"):
        out[f"{P}qkv_proj.{s}"] = torch.cat([base[f"{P}{p}_proj.{s}"] for p in QKV])
    return out


def old_prefixes(base: dict) -> dict:
    """The older prefixes vLLM's mapper also accepts: ``model.vpm.`` and ``model.vit_merger.``."""
    out = {}
    for k, v in base.items():
        if k.startswith("model.vision_tower.vit_merger."):
            k = "model.vit_merger." + k[len("model.vision_tower.vit_merger."):]
        elif k.startswith("model.vision_tower."):
            k = "model.vpm." + k[len("model.vision_tower."):]
        out[k] = v
    return out


#: Bad / unusual checkpoints, by name: a function of the base tensors returning ``tensors`` or ``{"files": ...}``.
def _bad_q(base):
    out = dict(base)
    out[P + "q_proj.weight"] = torch.randn(65, 64, generator=torch.Generator().manual_seed(5))
    return out


def _duplicate_files(base):
    """Two files of one set: file 2 lists vit_merger q/k/v weights again (the index maps them to file 1)."""
    vision = {k: v for k, v in base.items() if k.startswith("model.vision_tower.")}
    rest = {k: v for k, v in base.items() if not k.startswith("model.vision_tower.")}
    rest.update({f"{P}{p}_proj.weight": base[f"{P}{p}_proj.weight"] for p in QKV})
    return {"files": {"model-00001-of-00002.safetensors": vision, "model-00002-of-00002.safetensors": rest}}


def _truncated_second_shard(base):
    vision = {k: v for k, v in base.items() if k.startswith("model.vision_tower.")}
    rest = {k: v for k, v in base.items() if not k.startswith("model.vision_tower.")}
    return {"files": {"model-00001-of-00002.safetensors": rest, "model-00002-of-00002.safetensors": vision},
            "truncate": "model-00002-of-00002.safetensors"}


CHECKPOINTS = {
    "missing_k_weight": lambda b: without(b, P + "k_proj.weight"),
    "missing_v_bias": lambda b: without(b, P + "v_proj.bias"),
    "duplicate_across_files": _duplicate_files,
    "wrong_q_shape": _bad_q,
    "bf16": lambda b: {k: v.to(torch.bfloat16) for k, v in b.items()},
    "unknown_weight": lambda b: {**b, P + "z_proj.weight": torch.ones(64, 64)},
    "unknown_bias": lambda b: {**b, P + "z_proj.bias": torch.ones(64)},
    "truncated": lambda b: {"files": {"model.safetensors": b}, "truncate": "model.safetensors"},
    "truncated_second_shard": _truncated_second_shard,
    "fused_only": fused_only,
    "fused_and_split": lambda b: {**b, **{k: v for k, v in fused_only(b).items() if "qkv_proj" in k}},
    "old_prefixes": old_prefixes,
    "no_qkv": lambda b: without(b, *(f"{P}{p}_proj.{s}" for p in QKV for s in ("weight", "bias"))),
}


@pytest.fixture(scope="module")
def bad(tmp_path_factory, base):
    """``bad(name)`` -> the folder of checkpoint ``name`` (written once per module)."""
    root = tmp_path_factory.mktemp("bad-checkpoints")

    @functools.cache
    def get(name: str) -> Path:
        spec = CHECKPOINTS[name](base)
        if "files" in spec:
            d = write_checkpoint(root / name, files=spec["files"])
        else:
            d = write_checkpoint(root / name, spec)
        if "truncate" in spec:
            f = d / spec["truncate"]
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
        return d

    return get


def start_up(ckpt: Path):
    """What a vLLM worker does at start-up: ``get_model_loader(load_config).load_model(vllm_config, model_config)``
    (build the model, stream the checkpoint through ``load_weights``, vLLM's strict check, post-processing). Returns
    the model only if all of it succeeds."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import initialize_model_parallel, model_parallel_is_initialized
    from vllm.model_executor.model_loader import get_model_loader

    ensure_distributed()
    vllm_config = make_vllm_config(ckpt)
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
        return get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=vllm_config.model_config
        )


def start_up_fails(ckpt: Path, error: type[BaseException] = ValueError) -> BaseException:
    """``start_up`` must raise ``error``; returns the exception (no model object ever exists for a caller)."""
    with pytest.raises(BaseException) as info:
        start_up(ckpt)
    exc = info.value
    assert isinstance(exc, error), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    print(f"\n{type(exc).__name__}: {exc}")
    return exc


def load_like_vllm(ckpt: Path):
    """The model built first, then vLLM's ``DefaultModelLoader.load_weights(model, model_config)`` (its iterator, the
    model's ``load_weights``, its strict check) -- without post-processing, so the parameters can be compared with
    the checkpoint (0.30's CPU post-processing has no float32 kernel for the text model's conv). Returns
    ``(model, qkv weight before loading)``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    model = build_vllm_model(ckpt, load=False)
    qkv = model.vit_merger.self_attn.qkv_proj
    with torch.no_grad():  # a known pre-load state, so "left as initialised" is checkable
        qkv.weight.fill_(-7.0)
        qkv.bias.fill_(-7.0)
    vc = model.vllm_config
    with set_current_vllm_config(vc):
        get_model_loader(vc.load_config).load_weights(model, vc.model_config)
    return model


@pytest.fixture(scope="module")
def reference(m46, tiny) -> dict[str, torch.Tensor]:
    """Every parameter of the model loaded from the pristine tiny checkpoint (hotfix forced; bit-exact per
    tests/loading/test_vllm_load.py)."""
    with hotfix(m46, "force"):
        model = load_like_vllm(tiny)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_model_equals(model, want: dict[str, torch.Tensor], cast: torch.dtype | None = None) -> None:
    """Every parameter equals the reference's, bit for bit (after a round trip through ``cast`` if given)."""
    got = dict(model.named_parameters())
    assert got.keys() == want.keys()
    for name, ref in want.items():
        ref = ref.to(cast).to(ref.dtype) if cast is not None else ref
        assert torch.equal(got[name].detach(), ref), name


def hotfix_active(mode: str, expected) -> bool:
    """Whether the hotfix's loader runs: ``force`` everywhere, ``auto`` where this release is broken."""
    return mode == "force" or expected[0] == "broken"


def stock_error(expected) -> str:
    """What stock vLLM raises on a broken release for any checkpoint with split q/k/v (the users' error)."""
    return expected[1]


