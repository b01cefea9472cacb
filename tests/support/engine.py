"""The engine side's shared parts without an engine: vLLM's real processor and the tiny model built on CPU, one request
processed, its pads, the vision tower's embeddings and the merge, and the fixtures of the engine-fix tests."""

from __future__ import annotations

import contextlib
import dataclasses
from support import expected as table
import numpy as np
import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from vllm_minicpm_hotfix.fixes import encoder_modes, placeholder_guard, video_budget, video_tower


#: The fixes without which this environment cannot process an image at all (they are not under test here).
#: What vLLM needs before any request reaches the code these fixes change, applied under ``auto`` (only where the
#: installed code is broken): the q/k/v loader, the image-processor call, and on 0.23.0 the processor itself.
BASELINE = ("qkv_loader", "processor_downsample_mode", "hf_processor_version")
OURS = (encoder_modes, video_tower, video_budget, placeholder_guard)

#: Requests that stock vLLM builds with a placeholder the tensors disagree with, for a 224x224 image on the tiny
#: checkpoint (scale_resolution 112: 1 source + 4 slices of 8x8 patches = 20 pads by default), per release family.
#: (mm_processor_kwargs, pads vLLM puts in the prompt, embeddings the vision tower gives). Measured 2026-11-30.
KILL_REQUESTS: dict[str, list[tuple[dict, int, int]]] = {
    "A-C": [({"max_slice_nums": 1}, 20, 4), ({"slice_mode": False}, 20, 4)],  # 0.22-0.31
    "D": [({"slice_mode": False}, 20, 4)],  # 0.32-0.33: max_slice_nums honoured upstream
}


def family(release: str) -> str:
    return "D" if tuple(int(x) for x in release.split(".")[:2]) >= (0, 32) else "A-C"


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def image(width: int, height: int):
    from PIL import Image

    rng = np.random.default_rng(width * 10007 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def video(frames: int, width: int, height: int) -> np.ndarray:
    rng = np.random.default_rng(frames * 7 + width * 10007 + height)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


@contextlib.contextmanager
def fixes(m46, *names: str, mode: str = "auto"):
    """The baseline plus ``names`` applied as the post-import hook would; reverted on exit."""
    with hotfix(m46, mode, fixes=BASELINE + names) as out:
        yield out


def process(proc, items: dict, mm_kwargs: dict, cache=None):
    """vLLM's own multimodal processing of one prompt with ``items`` ({"image": [...]} or {"video": [...]}), as its
    renderer does it (``processor.apply``); with ``cache`` through the processor cache's sender path."""
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tok = proc.info.get_tokenizer()
    pads = "".join((tok.image_token if m == "image" else tok.video_token) * len(v) for m, v in items.items())
    prompt = tok.encode(f"<|im_start|>user\n{pads}What is this?<|im_end|>\n", add_special_tokens=False)
    fields = {f.name for f in dataclasses.fields(ProcessorInputs)}
    kwargs = dict(prompt=prompt, mm_data_items=proc.info.parse_mm_data(items),
                  hf_processor_mm_kwargs=dict(mm_kwargs))
    if "tokenization_kwargs" in fields:
        kwargs["tokenization_kwargs"] = {}
    if "cache" in fields:  # 0.32+: the cache travels with the request
        kwargs["cache"] = cache
    old = getattr(proc, "cache", None)
    if "cache" not in fields:
        proc.cache = cache
    try:
        return proc.apply(ProcessorInputs(**kwargs), TimingContext(enabled=False))
    finally:
        if "cache" not in fields:
            proc.cache = old


def pads_in_prompt(proc, out, modality: str = "image") -> int:
    tok = proc.info.get_tokenizer()
    pad = tok.convert_tokens_to_ids(tok.image_token if modality == "image" else tok.video_token)
    return sum(1 for t in out["prompt_token_ids"] if t == pad)


def embed(model, items: list) -> list[torch.Tensor]:
    """vLLM's model's embeddings for processed items (``(modality, MultiModalKwargsItem)``), batched exactly as the
    model runner batches them (``group_and_batch_mm_kwargs``), one tensor per item in order."""
    from vllm.config import set_current_vllm_config
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    out: list[torch.Tensor] = []
    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        for _modality, n, batch in group_and_batch_mm_kwargs(items, device="cpu"):
            got = list(model.embed_multimodal(**batch))
            assert len(got) == n
            out.extend(got)
    return out


def items_of(out, modality: str = "image") -> list:
    return [(modality, item) for item in out["mm_kwargs"][modality]]


def merge(m46, model, out, embeddings: list[torch.Tensor]) -> torch.Tensor:
    """vLLM's ``_merge_multimodal_embeddings`` -- what EngineCore runs -- for this prompt's placeholders."""
    ids = out["prompt_token_ids"]
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for ranges in out["mm_placeholders"].values():
        for r in ranges:
            span = torch.ones(r.length, dtype=torch.bool) if r.is_embed is None else r.is_embed.bool()
            mask[r.offset:r.offset + r.length] = span
    hidden = model.config.text_config.hidden_size
    return m46._merge_multimodal_embeddings(
        inputs_embeds=torch.zeros(len(ids), hidden), multimodal_embeddings=embeddings, is_multimodal=mask
    )


def sender_cache(model_config):
    """vLLM's front-end (P0) processor cache of the IPC kind, empty."""
    try:
        from vllm.multimodal.cache import MultiModalProcessorSenderCache as cls  # 0.22-0.31
    except ImportError:
        from vllm.multimodal.cache.lru import LruKeyReplicatedSenderCache as cls  # 0.32+
    return cls(model_config)


# --------------------------------------------------------------------------------------------------------------------
# Fixtures (module-scoped: vLLM's processor and model are built once)
# --------------------------------------------------------------------------------------------------------------------


def model_config(**kwargs):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(TINY), dtype="float32", enforce_eager=True, **kwargs)


@pytest.fixture(scope="module")
def mconfig():
    return model_config(max_model_len=4096)


@pytest.fixture(scope="module")
def vproc(mconfig):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.create_processor(mconfig)


def build_model(m46, **limits):
    """vLLM's model for the tiny checkpoint on CPU (``limit_mm_per_prompt`` from ``limits``), loaded through the
    q/k/v fix where this vLLM needs it, its vision side post-processed as vLLM's loader does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from support.vllm_build import build_vllm_model, load_checkpoint

    model = build_vllm_model(TINY, load=False, model_cls=m46.MiniCPMV4_6ForConditionalGeneration,
                             skip_tokenizer_init=False, **({"limit_mm_per_prompt": limits} if limits else {}))
    mc = model.vllm_config.model_config
    with hotfix(m46, "auto", fixes=("qkv_loader",)):
        load_checkpoint(model, TINY)
    with set_current_vllm_config(model.vllm_config):
        for name, child in model.named_children():
            if name not in ("language_model", "llm") and not any(p.is_meta for p in child.parameters()):
                process_weights_after_loading(child, mc, torch.device("cpu"))
    return model.eval()


@pytest.fixture(scope="module")
def vmodel(m46):
    return build_model(m46)


@pytest.fixture(scope="module")
def fam(environment) -> str:
    return family(environment[0])


def stock_verdict(name: str, environment) -> str:
    try:
        return table.verdict(name, environment)
    except table.UnknownEnvironment as exc:
        pytest.fail(str(exc))


def vision_reference(model, data: dict, mode: str, prefix: str = "video_") -> torch.Tensor:
    """The model's own vision tower on one processed item's slices in ``mode`` (``get_vision_hidden_states``, the
    tower, vit_merger and merger vLLM's ``embed_multimodal`` runs), concatenated: ``(tokens, hidden)``."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        return torch.cat(model.get_vision_hidden_states(
            {"pixel_values": list(data[f"{prefix}pixel_values"]), "tgt_sizes": data[f"{prefix}tgt_sizes"]},
            downsample_mode=mode))
