"""The prompt side's shared parts: transformers' and vLLM's processors for one checkpoint (:class:`Pair`), the token ids
each builds, seeded items, the checkpoints (tiny, real geometry, MiniCPM-V 4.7), the stock tables per release family
and the fixtures of the prompt tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import time
from pathlib import Path
import numpy as np
import pytest
from support.hotfix import hotfix
from support import tiny_checkpoints
from support.paths import TINY
from support.placement import own_member_envs, vllm_release


#: The prompt fixes this module tests.
MINE = ("mm_placeholders", "video_image_id_cache", "hf_processor_version")
#: What "stock" keeps: the fixes a request needs before it can reach a placeholder at all.
PREREQUISITES = ("processor_downsample_mode", "hf_processor_version")

SEED = 20261130
PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"

#: The families of stock prompt behaviour (serving-defects.md): A 0.22-0.23, B 0.24, C 0.25-0.31, D 0.32-0.33. Which
#: one a release is in is recorded per environment in tests/data/stock.json (``prompt_family``), observed by
#: tests/prompt/test_prompt_conformance.py's ``test_stock_defects`` (:func:`family_of`).
FAMILIES = ("A", "B", "C", "D")

#: Sub-defects the mm_placeholders probe names as broken, per family (the rest it finds equal).
PROBE_BROKEN = {
    "A": {"image W/H order", "slice layout (square)", "request max_slice_nums", "request slice_mode",
          "request scale_resolution", "request use_image_id", "model slice_mode", "model use_image_id",
          "video request slice_mode", "video request max_slice_nums"},
    "B": {"slice layout (square)", "slice layout (tall)", "request max_slice_nums", "request slice_mode",
          "request scale_resolution", "request use_image_id", "model slice_mode", "model use_image_id",
          "video request slice_mode", "video request max_slice_nums"},
    "C": {"request max_slice_nums", "request slice_mode", "request scale_resolution", "request use_image_id",
          "model slice_mode", "model use_image_id", "video request slice_mode", "video request max_slice_nums"},
    "D": {"request slice_mode", "request scale_resolution", "request use_image_id", "model slice_mode",
          "model use_image_id", "video request slice_mode", "video request max_slice_nums"},
}
PROBE_BROKEN_EXTRA = {"0.22.1": {"video frame size (HWC)"}}

#: Stock cases (real geometry): name -> (modality, sizes (w, h) per item, frames per video, model kwargs, request
#: kwargs). "cached video" runs the two prompts of :func:`cached_prompts` through a processor cache and compares the
#: second (tests/prompt/test_prompt_conformance.py fills that cache with the same two prompts under the hotfix first).
STOCK_CASES = {
    "365x211": ("image", [(365, 211)], 0, {}, {}),
    "449x449 square": ("image", [(449, 449)], 0, {}, {}),
    "449x448 wide": ("image", [(449, 448)], 0, {}, {}),
    "300x900 tall": ("image", [(300, 900)], 0, {}, {}),
    "numpy 365x211": ("image-array", [(365, 211)], 0, {}, {}),
    "request max_slice_nums 1": ("image", [(449, 448)], 0, {}, {"max_slice_nums": 1}),
    "request slice_mode false": ("image", [(449, 448)], 0, {}, {"slice_mode": False}),
    "request scale_resolution 224": ("image", [(448, 448)], 0, {}, {"scale_resolution": 224}),
    "request use_image_id false": ("image", [(300, 200)], 0, {}, {"use_image_id": False}),
    "model slice_mode false": ("image", [(449, 448)], 0, {"slice_mode": False}, {}),
    "model use_image_id false": ("image", [(300, 200)], 0, {"use_image_id": False}, {}),
    "video 2x56x56": ("video", [(56, 56)], 2, {}, {}),
    "video request slice_mode false": ("video", [(700, 400)], 2, {}, {"slice_mode": False}),
    "video request max_slice_nums 1": ("video", [(700, 400)], 2, {}, {"max_slice_nums": 1}),
    "cached video": ("video-cached", [(56, 56), (84, 56)], 1, {}, {}),
}
_ALL_PADS = {k: "pads" for k in ("request slice_mode false", "request scale_resolution 224",
                                "model slice_mode false", "video request slice_mode false",
                                "video request max_slice_nums 1")}
_ALL_TEXT = {"request use_image_id false": "text", "model use_image_id false": "text"}
#: family -> case -> outcome of stock vLLM (see the module docstring). Measured 2026-11-30 on each release.
STOCK = {
    "A": {**_ALL_PADS, **_ALL_TEXT, "365x211": "pads", "449x449 square": "layout", "449x448 wide": "equal",
          "300x900 tall": "equal", "numpy 365x211": "pads", "request max_slice_nums 1": "pads",
          "video 2x56x56": "equal", "cached video": "text"},
    "B": {**_ALL_PADS, **_ALL_TEXT, "365x211": "equal", "449x449 square": "layout", "449x448 wide": "layout",
          "300x900 tall": "layout", "numpy 365x211": "equal", "request max_slice_nums 1": "pads",
          "video 2x56x56": "equal", "cached video": "text"},
    "C": {**_ALL_PADS, **_ALL_TEXT, "365x211": "equal", "449x449 square": "equal", "449x448 wide": "equal",
          "300x900 tall": "equal", "numpy 365x211": "equal", "request max_slice_nums 1": "pads",
          "video 2x56x56": "equal", "cached video": "equal"},
    "D": {**_ALL_PADS, **_ALL_TEXT, "365x211": "equal", "449x449 square": "equal", "449x448 wide": "equal",
          "300x900 tall": "equal", "numpy 365x211": "equal", "request max_slice_nums 1": "equal",
          "video 2x56x56": "equal", "cached video": "equal"},
}
#: MiniCPM-V 4.7's classes on vLLM 0.32.0 / 0.33.0 (byte-identical minicpmv4_6.py and minicpmv4_7.py) against
#: transformers' ``MiniCPMV4_7Processor``. Measured 2026-12-01.
STOCK_V47: dict[str, str] = dict(STOCK["D"])
#: Releases whose stock differs from their family's row.
STOCK_EXTRA = {"0.22.1": {"video 2x56x56": "pads"}}

#: MiniCPM-V 4.7 (vLLM 0.32+ with transformers >= 5.19): the environments that have it in both (0.32.0, 0.33.0, and
#: any other whose vLLM and transformers ship it: :func:`support.placement.own_member_envs`).
V47_ENVS = own_member_envs("minicpmv4_7", "minicpmv4_7", "0.32.0", "0.33.0")
#: The 4.7 checkpoint as a parameter of the tests it joins, placed where vLLM and transformers have 4.7.
REAL47 = pytest.param("real47", marks=pytest.mark.placed(*V47_ENVS))

#: Per-request kwargs of the sweep (each on top of the checkpoint's processor config).
REQUEST_KWARGS = [
    {"max_slice_nums": 1},
    {"max_slice_nums": 4},
    {"slice_mode": False},
    {"scale_resolution": 224},
    {"downsample_mode": "4x"},
    {"downsample_mode": "16x"},
    {"use_image_id": False},
    {"max_slice_nums": 2, "scale_resolution": 336, "downsample_mode": "4x", "use_image_id": False},
]
#: Model-level kwargs (``--mm-processor-kwargs``), each with a per-request override on top as well.
MODEL_KWARGS = [
    {"slice_mode": False},
    {"scale_resolution": 224, "max_slice_nums": 4},
    {"use_image_id": False},
    {"downsample_mode": "4x"},
]

#: section -> [wall seconds, CPU seconds of this process]; printed at the end of the module.
TIMES: dict[str, list[float]] = {}


# --------------------------------------------------------------------------------------------------------------------
# Items
# --------------------------------------------------------------------------------------------------------------------


def seeded_sizes(seed: int = SEED) -> list[tuple[str, int, int]]:
    """>= 40 ``(kind, width, height)`` from a seeded generator: square, wide, tall, tiny, larger than the real
    ``scale_resolution`` (448 x 448 pixels), ordinary. No side of 1 or 3 pixels (see the module docstring)."""
    rng = np.random.default_rng(seed)

    def side(lo: int, hi: int) -> int:
        while True:
            v = int(rng.integers(lo, hi + 1))
            if v not in (1, 3):
                return v

    out = []
    for _ in range(8):
        s = side(8, 1400)
        out.append(("square", s, s))
    for _ in range(8):
        h, ratio = side(16, 500), float(rng.uniform(1.3, 6.0))
        out.append(("wide", min(int(h * ratio), 2400), h))
    for _ in range(8):
        w, ratio = side(16, 500), float(rng.uniform(1.3, 6.0))
        out.append(("tall", w, min(int(w * ratio), 2400)))
    for _ in range(6):
        out.append(("tiny", side(4, 40), side(4, 40)))
    for _ in range(8):
        w, h = side(449, 1800), side(449, 1800)
        out.append(("large", w, h))
    for _ in range(6):
        out.append(("ordinary", side(100, 900), side(100, 900)))
    return out


def _colour(*key: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(key)
    return tuple(int(c) for c in rng.integers(0, 256, 3))


def image(width: int, height: int, seed: int = 0):
    """A one-colour RGB image (the placeholder depends on the size only; the colour keeps items' hashes apart)."""
    from PIL import Image

    return Image.new("RGB", (width, height), _colour(width, height, seed))


def video(width: int, height: int, frames: int, seed: int = 0) -> np.ndarray:
    """``(frames, H, W, 3)`` uint8, one colour per frame: how vLLM's video loader hands a decoded video over."""
    out = np.empty((frames, height, width, 3), dtype=np.uint8)
    for i in range(frames):
        out[i] = _colour(width, height, frames, seed, i)
    return out


#: scale_resolution of each checkpoint; the seeded sizes are drawn for the real one (448) and scaled for the tiny.
SCALE = {"tiny": 112, "real": 448, "real47": 448}


def sizes_for(ckpt: str, sizes: list[tuple[str, int, int]] | None = None) -> list[tuple[str, int, int]]:
    """The seeded sizes, scaled to the checkpoint's ``scale_resolution`` (a side of >= 4 pixels, never 1 or 3)."""
    f = SCALE[ckpt] / 448
    out = []
    for kind, w, h in seeded_sizes() if sizes is None else sizes:
        w, h = (max(4, round(w * f)), max(4, round(h * f))) if f != 1 else (w, h)
        out.append((kind, w, h))
    return out


# --------------------------------------------------------------------------------------------------------------------
# vLLM and transformers on the same prompt
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Pair:
    """vLLM's processor and transformers' for one checkpoint and model-level kwargs."""

    vllm: object
    hf: object
    model_kwargs: dict

    @property
    def tokenizer(self):
        return self.hf.tokenizer


def _processor_cache(model_config):
    try:
        from vllm.multimodal.cache import MultiModalProcessorOnlyCache
    except ImportError:  # 0.32+: a package
        from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache
    return MultiModalProcessorOnlyCache(model_config)


def make_pair(checkpoint: Path, model_kwargs: dict, *, cache: bool = False) -> Pair:
    import inspect

    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    mc = ModelConfig(model=str(checkpoint), dtype="float32", enforce_eager=True,
                     mm_processor_kwargs=dict(model_kwargs) or None)
    extra = {}
    if cache:
        extra_cache = _processor_cache(mc)
        if "cache" in inspect.signature(MULTIMODAL_REGISTRY.create_processor).parameters:
            extra["cache"] = extra_cache
    proc = MULTIMODAL_REGISTRY.create_processor(mc, **extra)
    if cache and not extra:
        proc._hotfix_test_cache = extra_cache  # handed over per call (0.32+: ProcessorInputs.cache)
    return Pair(proc, _hf_processor(str(checkpoint)), dict(model_kwargs))


_HF: dict[str, object] = {}


def _hf_processor(checkpoint: str):
    from transformers import AutoProcessor

    if checkpoint not in _HF:
        _HF[checkpoint] = AutoProcessor.from_pretrained(checkpoint)
    return _HF[checkpoint]


def processed(pair: Pair, modality: str, items: list, request_kwargs: dict):
    """vLLM's processor output for :data:`PROMPT` with ``items`` (``processor.apply``, as its renderer calls it):
    the ``MultiModalInputs`` mapping (``prompt_token_ids``, ``mm_kwargs``, ``mm_placeholders``...)."""
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    proc = pair.vllm
    tok = proc.info.get_tokenizer()
    pad = tok.image_token if modality == "image" else tok.video_token
    prompt = tok.encode(PROMPT.format(mm=pad * len(items)), add_special_tokens=False)
    fields = {f.name for f in dataclasses.fields(ProcessorInputs)}
    kwargs = dict(prompt=prompt, mm_data_items=proc.info.parse_mm_data({modality: items}),
                  hf_processor_mm_kwargs=dict(request_kwargs))
    if "tokenization_kwargs" in fields:
        kwargs["tokenization_kwargs"] = {}
    if "cache" in fields and getattr(proc, "_hotfix_test_cache", None) is not None:
        kwargs["cache"] = proc._hotfix_test_cache
    return proc.apply(ProcessorInputs(**kwargs), TimingContext(enabled=False))


#: Where vLLM hands a request's items to transformers: ``_call_hf_processor`` (where the release has it) and
#: MiniCPM-V's ``process_mm_inputs`` (every release).
PIXEL_WORK = ("_call_hf_processor", "process_mm_inputs")


@contextlib.contextmanager
def pixel_work_calls(proc):
    """Yields the list of :data:`PIXEL_WORK` calls made on vLLM's processor ``proc`` while it is open."""
    calls: list[str] = []
    present = [name for name in PIXEL_WORK if callable(getattr(proc, name, None))]
    assert present, f"vLLM's processor has none of {PIXEL_WORK}"
    for name in present:
        def call(*args, _original=getattr(proc, name), _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(proc, name, call)
    try:
        yield calls
    finally:
        for name in present:
            proc.__dict__.pop(name, None)


def vllm_ids(pair: Pair, modality: str, items: list, request_kwargs: dict) -> list[int]:
    """The prompt token ids vLLM's processor builds (:func:`processed`)."""
    return list(processed(pair, modality, items, request_kwargs)["prompt_token_ids"])


def hf_ids(pair: Pair, modality: str, items: list, request_kwargs: dict) -> list[int]:
    """The input ids transformers' ``MiniCPMV4_6Processor`` (of the checkpoint, as saved) builds for the same prompt
    and items, called with the effective kwargs: the model-level ones overridden by the request's."""
    hf = pair.hf
    pad = hf.image_token if modality == "image" else hf.video_token
    text = [PROMPT.format(mm=pad * len(items))]
    request_kwargs = {**pair.model_kwargs, **request_kwargs}
    if modality == "image":
        out = hf(text=text, images=items, **request_kwargs)
    else:
        out = hf(text=text, videos=items, do_sample_frames=False, **request_kwargs)
    return out["input_ids"][0].tolist()


def cached_prompts(pair: Pair) -> tuple[list[int], list[int]]:
    """Prompt 1 with video A, then prompt 2 with [B, A] through the same processor cache (``pair`` made with
    ``cache=True``): vLLM's ids for prompt 2, transformers' ids for prompt 2."""
    a, b = video(56, 56, 1), video(84, 56, 1)
    vllm_ids(pair, "video", [a], {})
    return vllm_ids(pair, "video", [b, a], {}), hf_ids(pair, "video", [b, a], {})


def classify(tokenizer, got: list[int], want: list[int]) -> str:
    """``equal`` | ``pads`` (another number of pad tokens) | ``layout`` (same pads, other rows) | ``text``."""
    if got == want:
        return "equal"
    pads = {tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    if sum(t in pads for t in got) != sum(t in pads for t in want):
        return "pads"
    nl = tokenizer.encode("\n", add_special_tokens=False)
    if sum(t in nl for t in got) != sum(t in nl for t in want):
        return "layout"
    return "text"


def summary(tokenizer, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    text = re.sub(r"(<\|image_pad\|>|<\|video_pad\|>)+", lambda m: f"[{m.group(0).count('pad|')}]", text)
    return text.replace("\n", "/")


def compare(pair: Pair, modality: str, items: list, request_kwargs: dict) -> tuple[str, str]:
    """``(outcome, detail)`` for one prompt: an outcome of :func:`classify` or the exception vLLM raised."""
    want = hf_ids(pair, "image" if modality == "image" else "video", items, request_kwargs)
    try:
        got = vllm_ids(pair, "image" if modality == "image" else "video", items, request_kwargs)
    except Exception as exc:  # what stock vLLM raises is part of what is compared
        return type(exc).__name__, f"{type(exc).__name__}: {str(exc)[:300]}"
    outcome = classify(pair.tokenizer, got, want)
    detail = "" if outcome == "equal" else (
        f"\n    vLLM:         {summary(pair.tokenizer, got)}\n    transformers: {summary(pair.tokenizer, want)}"
    )
    return outcome, detail


def assert_all_equal(pair: Pair, cases: list[tuple[str, str, list, dict]]) -> None:
    """Every ``(label, modality, items, request kwargs)`` gives transformers' ids; the message lists each miss."""
    misses = []
    for label, modality, items, request_kwargs in cases:
        outcome, detail = compare(pair, modality, items, request_kwargs)
        if outcome != "equal":
            misses.append(f"{label} {request_kwargs} (model {pair.model_kwargs}): {outcome}{detail}")
    assert not misses, f"{len(misses)} of {len(cases)} prompts differ from transformers':\n" + "\n".join(misses)


# --------------------------------------------------------------------------------------------------------------------
# Fixtures (module scope: one vLLM processor and one transformers processor per checkpoint x model kwargs)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family() -> str | None:
    """This environment's prompt family as tests/data/stock.json records it; None where it has no row (the test that
    pins it, ``test_stock_defects``, then fails naming the family it observed)."""
    from support import expected as table

    if table.recording():  # the family test_stock_defects has just observed and recorded
        return table.recorded_now(("prompt_family",))
    return (table.row(table.installed_environment()) or {}).get("prompt_family")


def family_of(seen: dict[str, str], release: str) -> str:
    """The family whose :data:`STOCK` row (with ``release``'s :data:`STOCK_EXTRA`) is exactly ``seen`` (stock vLLM's
    outcome per case of :data:`STOCK_CASES`); else a text naming the nearest row and how ``seen`` differs from it."""
    rows = {f: {**STOCK[f], **STOCK_EXTRA.get(release, {})} for f in FAMILIES}
    for name, want in rows.items():
        if want == seen:
            return name
    near = min(rows, key=lambda f: sum(rows[f][k] != seen.get(k) for k in rows[f]))
    return f"none of {'/'.join(FAMILIES)} (nearest {near}, differing in " + ", ".join(
        f"{k}: {seen.get(k)} not {v}" for k, v in rows[near].items() if seen.get(k) != v) + ")"


def real_geometry_copy(dest: Path) -> Path:
    """The bundled tiny checkpoint copied to ``dest`` with MiniCPM-V 4.6's real processor geometry (patch 14,
    ``scale_resolution`` 448, ``max_slice_nums`` 9) for images and videos."""
    shutil.copytree(TINY, dest)
    cfg_path = dest / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("image_processor", "video_processor"):
        cfg[key].update(patch_size=14, scale_resolution=448, max_slice_nums=9)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


#: ``--seed`` of the 4.7 test checkpoints, chosen with tests/programs/v47_sensitivity.py (docs/moe.md): another image
#: of the same size moves transformers' first-step logprobs by >= 0.17 (dense) / >= 0.41 (MoE), bf16 moves them by
#: <= 0.02 / <= 0.04. The default seed 0 of the MoE variant gives >= 0.12 against <= 0.02, and a weaker trace of
#: vLLM's sequential-position defect.
V47_SEED = {False: 0, True: 5}


def write_v47(dest: Path, *, moe: bool = False, seed: int | None = None) -> Path:
    """A tiny MiniCPM-V 4.7 checkpoint written by transformers' own 4.7 classes (``scripts/make_tiny_checkpoint.py
    --member 4.7``: ``MiniCPMV4_7ForConditionalGeneration``, ``MiniCPMV4_7Processor``) with the real geometry
    (patch 14, ``scale_resolution`` 448, ``max_slice_nums`` 9).  ``moe=True`` adds ``--moe``: a ``qwen3_5_moe_text``
    text tower (4 experts, top-2, a shared expert), the 35B-A3B member's layout.  ``seed`` defaults to
    :data:`V47_SEED` (0 for dense, as before; 5 for MoE)."""
    seed = V47_SEED[moe] if seed is None else seed
    args = ["--member", "4.7", "--scale-resolution", "448"] + (["--seed", str(seed)] if seed else [])
    return tiny_checkpoints.write(dest, *args, *(["--moe"] if moe else []))


class _Checkpoints(dict):
    """``tiny``: the bundled checkpoint (scale_resolution 112); ``real``: a copy with the real processor geometry;
    ``real47``: a MiniCPM-V 4.7 checkpoint (:func:`write_v47`), ``real47moe`` its MoE variant (``moe=True``), each
    written on first use (only environments with 4.7)."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__(tiny=TINY, real=real_geometry_copy(tmp_path_factory.mktemp("real-geometry") / "ckpt"))
        self._tmp = tmp_path_factory

    def __missing__(self, key: str) -> Path:
        if key not in ("real47", "real47moe"):
            raise KeyError(key)
        self[key] = write_v47(self._tmp.mktemp(key.replace("real", "v")) / "ckpt", moe=key == "real47moe")
        return self[key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return _Checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def pairs(checkpoints):
    made: dict[tuple, Pair] = {}

    def get(ckpt: str, model_kwargs: dict | None = None, *, cache: bool = False) -> Pair:
        key = (ckpt, json.dumps(model_kwargs or {}, sort_keys=True), cache)
        if key not in made:
            made[key] = make_pair(checkpoints[ckpt], model_kwargs or {}, cache=cache)
        return made[key]

    return get


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The sweep resizes and normalises hundreds of small images; torch's intra-op threads only contend on the 2-core
    CI machine (measured: 33 s with 2 threads, 3 s with 1 for the 44 real-geometry images)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def _report_times(_one_torch_thread):
    with timed("module"):
        yield
    print(f"\n\nvLLM {vllm_release()} prompt conformance, seconds (wall/cpu): "
          + ", ".join(f"{k} {w:.1f}/{c:.1f}" for k, (w, c) in TIMES.items()))


@contextlib.contextmanager
def timed(name: str):
    start, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        entry = TIMES.setdefault(name, [0.0, 0.0])
        entry[0] += time.perf_counter() - start
        entry[1] += time.process_time() - cpu


@contextlib.contextmanager
def with_hotfix(m46):
    with hotfix(m46, "auto", fixes=None) as statuses:
        for name in MINE:
            assert name in statuses, f"{name} is not in the fix registry"
        yield statuses


@contextlib.contextmanager
def stock(m46):
    with hotfix(m46, "auto", fixes=PREREQUISITES) as statuses:
        yield statuses
