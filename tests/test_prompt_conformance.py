"""The prompt side: the token ids vLLM's own multimodal processor builds for MiniCPM-V 4.6 images and videos
equal, token for token, those transformers' ``MiniCPMV4_6Processor`` builds for the same items and kwargs.

Everything runs the real code of the installed release: vLLM's ``MiniCPMV4_6MultiModalProcessor`` from
``MULTIMODAL_REGISTRY.create_processor(ModelConfig(..., mm_processor_kwargs=MODEL_KWARGS))`` (its ``apply``: pixel
values, prompt updates, processor cache; model-level kwargs as ``--mm-processor-kwargs`` sets them, per-request
ones as a request's ``mm_processor_kwargs``) on a tokenizer-equipped checkpoint written by transformers. The
reference is ``AutoProcessor.from_pretrained`` of the same folder called with the same prompt, items and the
*effective* kwargs (model-level overridden by the request's). (transformers 5.24 built with a model-level
``use_image_id=False`` ignores a call's ``use_image_id=True``; 5.19 honours it, as the effective kwargs do.)
Two processor geometries: the bundled tiny checkpoint (patch 14, ``scale_resolution`` 112) and a copy with the real
checkpoint's (patch 14, ``scale_resolution`` 448, ``max_slice_nums`` 9) written by this module. MiniCPM-V 4.7 joins
the same tests (parameter ``real47``) where vLLM and transformers have it (0.32.0, 0.33.0): a tiny 4.7 checkpoint
written by transformers' own 4.7 classes with the real geometry, vLLM's ``MiniCPMV4_7MultiModalProcessor`` against
transformers' ``MiniCPMV4_7Processor`` (stock: :data:`STOCK_V47`).

* With the hotfix (every fix, ``auto``): equal for >= 40 seeded image sizes x both geometries, every per-request kwarg
  (``max_slice_nums``, ``slice_mode``, ``scale_resolution``, ``downsample_mode``, ``use_image_id``), model-level
  kwargs, videos of 1 and 3 frames, two items per prompt, and items served from vLLM's processor cache.
* Stock (the placeholder fixes off; only what a request needs to get that far -- ``processor_downsample_mode`` and
  ``hf_processor_version`` where their probes ask for them): :data:`STOCK` pins, per release, how each case of
  :data:`STOCK_CASES` differs (``pads``: another number of ``<|image_pad|>``/``<|video_pad|>`` -- the engine crashes
  on such a prompt; ``layout``: same pads, rows of slices differ; ``text``: same pads and rows, other text differs
  (``<image_id>``); ``equal``; or the exception raised). A release that changes behaviour fails here.
* The probes' verdicts per release (tests/expected.py) and the sub-defects the mm_placeholders probe names
  (:data:`PROBE_BROKEN`), and ``status()``/``is_patched`` agreeing with them under auto, force and off.

Placement: every environment (cheap: no engine; ~9 s of CPU after ``import vllm``, one vLLM processor per checkpoint
x model-level kwargs, shared by the module).

Sizes avoid 1 and 3 pixel sides (transformers then guesses the channel axis of the array it makes from the image).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import vllm_minicpm_hotfix
import expected as table
from conftest import MAKE_CHECKPOINT, TINY, hotfix, vllm_release
from vllm_minicpm_hotfix.fixes import _base, by_name

#: The prompt fixes this module tests.
MINE = ("mm_placeholders", "video_image_id_cache", "hf_processor_version")
#: What "stock" keeps: the fixes a request needs before it can reach a placeholder at all.
PREREQUISITES = ("processor_downsample_mode", "hf_processor_version")

SEED = 20261130
PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"

#: release -> family (serving-defects.md): A 0.22-0.23, B 0.24, C 0.25-0.31, D 0.32-0.33.
FAMILY = {
    "0.22.1": "A", "0.23.0": "A", "0.24.0": "B", "0.26.0": "C", "0.28.0": "C", "0.30.0": "C", "0.32.0": "D",
    "0.33.0": "D",
}

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
#: kwargs). "cached video" runs two prompts through a processor cache and compares the second.
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

#: MiniCPM-V 4.7 (vLLM 0.32+ with transformers >= 5.19): the environments that have it in both.
V47_ENVS = ("0.32.0", "0.33.0")
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


def vllm_ids(pair: Pair, modality: str, items: list, request_kwargs: dict) -> list[int]:
    """The prompt token ids vLLM's processor builds (``processor.apply``, as its renderer calls it)."""
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
    return list(proc.apply(ProcessorInputs(**kwargs), TimingContext(enabled=False))["prompt_token_ids"])


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
def family() -> str:
    release = vllm_release()
    if release not in FAMILY:
        pytest.fail(f"vLLM {release} is not in tests/test_prompt_conformance.py FAMILY: measure it and add it")
    return FAMILY[release]


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


def write_v47(dest: Path) -> Path:
    """A tiny MiniCPM-V 4.7 checkpoint written by transformers' own 4.7 classes (``scripts/make_tiny_checkpoint.py
    --member 4.7``: ``MiniCPMV4_7ForConditionalGeneration``, ``MiniCPMV4_7Processor``) with the real geometry
    (patch 14, ``scale_resolution`` 448, ``max_slice_nums`` 9)."""
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), str(dest), "--member", "4.7", "--scale-resolution", "448"],
                   check=True, capture_output=True)
    return dest


class _Checkpoints(dict):
    """``tiny``: the bundled checkpoint (scale_resolution 112); ``real``: a copy with the real processor geometry;
    ``real47``: a MiniCPM-V 4.7 checkpoint (:func:`write_v47`), written on first use (only environments with 4.7)."""

    def __init__(self, tmp_path_factory) -> None:
        super().__init__(tiny=TINY, real=real_geometry_copy(tmp_path_factory.mktemp("real-geometry") / "ckpt"))
        self._tmp = tmp_path_factory

    def __missing__(self, key: str) -> Path:
        if key != "real47":
            raise KeyError(key)
        self[key] = write_v47(self._tmp.mktemp("v47") / "ckpt")
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


# --------------------------------------------------------------------------------------------------------------------
# With the hotfix: equal everywhere
# --------------------------------------------------------------------------------------------------------------------


def test_seeded_sizes():
    sizes = seeded_sizes()
    assert len(sizes) >= 40
    assert {k for k, _, _ in sizes} == {"square", "wide", "tall", "tiny", "large", "ordinary"}
    assert any(w * h > 448 * 448 for _, w, h in sizes) and any(max(w, h) < 41 for _, w, h in sizes)
    assert all(w > h for k, w, h in sizes if k == "wide") and all(h > w for k, w, h in sizes if k == "tall")
    assert seeded_sizes() == sizes  # the same on every run and release


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_images_default_kwargs(m46, pairs, ckpt):
    """>= 40 seeded sizes, the checkpoint's own processor config."""
    pair = pairs(ckpt)
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes_for(ckpt)]
    with timed(f"images-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_images_request_kwargs(m46, pairs, ckpt):
    """Every per-request kwarg, on every fifth seeded size."""
    pair = pairs(ckpt)
    sizes = sizes_for(ckpt, seeded_sizes()[::5])
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], kw) for kw in REQUEST_KWARGS for k, w, h in sizes]
    with timed(f"request-kwargs-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=lambda kw: json.dumps(kw, sort_keys=True))
def test_images_model_kwargs(m46, pairs, model_kwargs, ckpt):
    """Model-level kwargs (``--mm-processor-kwargs``), alone and under a per-request override."""
    pair = pairs(ckpt, model_kwargs)
    sizes = seeded_sizes()[1::5]
    override = {"slice_mode": True, "max_slice_nums": 9, "scale_resolution": 448, "use_image_id": True,
                "downsample_mode": "16x"}
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes]
    cases += [(f"{k} {w}x{h}", "image", [image(w, h)], {key: override[key]})
              for key in model_kwargs for k, w, h in sizes[:3]]
    with timed("model-kwargs"), with_hotfix(m46):
        assert_all_equal(pair, cases)


VIDEO_SIZES = [(56, 56), (700, 400), (300, 900), (20, 36)]


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_videos(m46, pairs, ckpt):
    """Videos of 1 and 3 frames, default and per-request kwargs."""
    pair = pairs(ckpt)
    cases = [(f"{w}x{h}x{n}", "video", [video(w, h, n)], {}) for w, h in VIDEO_SIZES for n in (1, 3)]
    cases += [(f"{w}x{h}x2", "video", [video(w, h, 2)], kw) for kw in REQUEST_KWARGS for w, h in VIDEO_SIZES[1:3]]
    with timed(f"videos-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=lambda kw: json.dumps(kw, sort_keys=True))
def test_videos_model_kwargs(m46, pairs, model_kwargs, ckpt):
    pair = pairs(ckpt, model_kwargs)
    cases = [(f"{w}x{h}x2", "video", [video(w, h, 2)], {}) for w, h in VIDEO_SIZES[:2]]
    with timed("model-kwargs"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
def test_several_items_and_numpy(m46, pairs, ckpt):
    """Two images (``<image_id>`` 0 and 1), two videos, and images handed over as HWC arrays."""
    pair = pairs(ckpt)
    sizes = seeded_sizes()
    cases = [
        ("two images", "image", [image(*sizes[0][1:]), image(*sizes[9][1:])], {}),
        ("three images", "image", [image(*s[1:]) for s in sizes[17:20]], {"max_slice_nums": 2}),
        ("two videos", "video", [video(700, 400, 2), video(700, 400, 2, seed=1)], {}),
        ("arrays", "image", [np.asarray(image(365, 211)), np.asarray(image(300, 900))], {}),
    ]
    with timed("several-items"), with_hotfix(m46):
        assert_all_equal(pair, cases)


def _cached_prompts(pair: Pair) -> tuple[list[int], list[int]]:
    """Prompt 1 with video A, then prompt 2 with [B, A] through the same processor cache: vLLM's ids for prompt 2,
    transformers' ids for prompt 2."""
    a, b = video(56, 56, 1), video(84, 56, 1)
    vllm_ids(pair, "video", [a], {})
    return vllm_ids(pair, "video", [b, a], {}), hf_ids(pair, "video", [b, a], {})


def test_cached_items(m46, pairs):
    """Items served from vLLM's processor cache get their index in the new prompt (images and videos)."""
    pair = pairs("real", cache=True)
    with timed("cache"), with_hotfix(m46):
        got, want = _cached_prompts(pair)
        assert got == want, (summary(pair.tokenizer, got), summary(pair.tokenizer, want))
        c, d = image(365, 211), image(449, 449)
        vllm_ids(pair, "image", [c], {})
        assert vllm_ids(pair, "image", [d, c], {}) == hf_ids(pair, "image", [d, c], {})


# --------------------------------------------------------------------------------------------------------------------
# Stock: the defects, as pinned per release
# --------------------------------------------------------------------------------------------------------------------


def _stock_outcome(pairs, name: str, ckpt: str = "real") -> tuple[str, str]:
    modality, sizes, frames, model_kwargs, request_kwargs = STOCK_CASES[name]
    if modality == "video-cached":
        pair = pairs(ckpt, cache=True)
        got, want = _cached_prompts(pair)
        return classify(pair.tokenizer, got, want), f"\n    vLLM: {summary(pair.tokenizer, got)}"
    pair = pairs(ckpt, model_kwargs)
    if modality == "video":
        return compare(pair, "video", [video(w, h, frames) for w, h in sizes], request_kwargs)
    items = [image(w, h) for w, h in sizes]
    if modality == "image-array":
        items = [np.asarray(i) for i in items]
    return compare(pair, "image", items, request_kwargs)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
def test_stock_defects(m46, pairs, family, ckpt):
    """Stock vLLM (placeholder fixes off) differs from transformers exactly as :data:`STOCK` (4.6) /
    :data:`STOCK_V47` (4.7's classes against ``MiniCPMV4_7Processor``) says for this family; the same cases with the
    hotfix are equal."""
    release = vllm_release()
    expected = STOCK_V47 if ckpt == "real47" else {**STOCK[family], **STOCK_EXTRA.get(release, {})}
    assert set(expected) == set(STOCK_CASES)
    seen, details = {}, {}
    with timed("stock"), stock(m46):
        for name in STOCK_CASES:
            seen[name], details[name] = _stock_outcome(pairs, name, ckpt)
    print(f"\nstock vLLM {release}: " + json.dumps(seen, indent=1))
    wrong = {k: (seen[k], expected[k]) for k in STOCK_CASES if seen[k] != expected[k]}
    assert not wrong, "stock outcome (seen, pinned) differs: " + "; ".join(
        f"{k}: {v}{details[k]}" for k, v in wrong.items()
    )
    assert any(v != "equal" for v in seen.values())  # every release has stock defects this module shows
    with timed("stock"), with_hotfix(m46):
        fixed = {name: _stock_outcome(pairs, name, ckpt) for name in STOCK_CASES}
    assert all(o == "equal" for o, _ in fixed.values()), {k: v for k, v in fixed.items() if v[0] != "equal"}


def test_stock_version_crash(m46, pairs, family):
    """0.23.0: stock vLLM's processor raises the ``version`` AttributeError on any image (start-up profiling dies
    the same way); hf_processor_version makes it transformers' own processor. Elsewhere stock processes images."""
    pair = pairs("tiny")
    with hotfix(m46, "auto", fixes=("processor_downsample_mode",)):
        outcome, detail = compare(pair, "image", [image(64, 64)], {})
    if vllm_release() == "0.23.0":
        assert outcome == "AttributeError" and "has no attribute 'version'" in detail, detail
    else:
        assert outcome == "equal", detail
    with with_hotfix(m46):
        assert compare(pair, "image", [image(64, 64)], {})[0] == "equal"


# --------------------------------------------------------------------------------------------------------------------
# The probes, the status record, the modes
# --------------------------------------------------------------------------------------------------------------------


def test_verdicts(m46, family, environment):
    """Each fix's probe on stock vLLM, as tests/expected.py pins it; the mm_placeholders cases find this family's
    sub-defects and the others equal, and its probe names the first of them it runs."""
    release = vllm_release()
    want = {name: table.verdict(name, environment) for name in MINE}
    got = {name: by_name(name).probe(m46) for name in MINE}
    assert {k: v.state.value for k, v in got.items()} == want, {k: v.reason for k, v in got.items()}
    broken = PROBE_BROKEN[family] | PROBE_BROKEN_EXTRA.get(release, set())
    named = {case[0] for case in by_name("mm_placeholders").CASES}
    found = by_name("mm_placeholders").check_cases(m46)  # every case (the probe stops at the first broken one)
    assert {n for n, state, _ in found if state.value == "broken"} == broken, found
    assert {n for n, state, _ in found if state.value == "correct"} == named - broken, found
    first = next(n for n in by_name("mm_placeholders").PROBE_ORDER if n in broken)
    assert f": {first} (" in got["mm_placeholders"].reason, got["mm_placeholders"].reason


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_status_and_modes(m46, family, mode):
    """auto applies exactly the broken ones (status() says so, nothing of a correct one is set), force all, off
    none; each fix's probe on the patched module answers correct."""
    with hotfix(m46, mode, fixes=MINE) as statuses:
        fixes = vllm_minicpm_hotfix.status()["fixes"]
        for name in MINE:
            fix = by_name(name)
            verdict = fix.probe(m46)  # re-probing the patched module
            entry = fixes[name]
            want = {"auto": statuses[name].verdict == "broken", "force": True, "off": False}[mode]
            assert entry["applied"] is want and _base.is_patched(fix, m46) is want, (name, entry)
            if mode == "auto" and not want:
                assert entry["verdict"] == "correct" and entry["why"].startswith("not needed"), entry
            if want:
                assert verdict.state.value == "correct", (name, verdict.reason)
    for name in MINE:
        assert not _base.is_patched(by_name(name), m46)


def test_concurrent_requests(m46, pairs):
    """Threads processing requests with different kwargs at once on one vLLM processor (as a shared server does)
    each get their own request's prompt: the request reaches the text producers through a ContextVar.

    Deterministically concurrent: the first time each thread's placeholder producer asks vLLM's
    ``InputProcessingContext.get_hf_processor`` for transformers' processor -- after the fix has set that thread's
    request, before the producer reads it -- it waits at a barrier until all four threads are there. So every request
    is set before any is read; a request held in a process-wide variable would give three threads another request's
    prompt (checked: such a variant of ``_mm_prompt.REQUEST`` fails here, this one passes)."""
    import threading

    from vllm_minicpm_hotfix.fixes import _mm_prompt as mp

    pair = pairs("real")
    jobs = [
        ("image", [image(449, 448)], {"slice_mode": False}),
        ("image", [image(449, 448)], {"max_slice_nums": 1, "use_image_id": False}),
        ("image", [image(900, 300)], {"scale_resolution": 224}),
        ("video", [video(700, 400, 2)], {"max_slice_nums": 2}),
    ]
    ctx = pair.vllm.info.ctx
    own = ctx.get_hf_processor
    barrier = threading.Barrier(len(jobs), timeout=60)
    met: set[int] = set()

    def get_hf_processor(*args, **kwargs):
        me = threading.get_ident()
        if mp.current() is not None and me not in met:  # inside a replacement: this thread's request is set
            met.add(me)
            barrier.wait()
        return own(*args, **kwargs)

    with timed("concurrent"), with_hotfix(m46):
        want = [hf_ids(pair, m, items, kw) for m, items, kw in jobs]
        errors: list = []

        def worker(i: int) -> None:
            try:
                for _ in range(2):
                    m, items, kw = jobs[i]
                    assert vllm_ids(pair, m, items, kw) == want[i], (i, kw)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
        object.__setattr__(ctx, "get_hf_processor", get_hf_processor)  # vLLM's context is a frozen dataclass
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
        finally:
            object.__delattr__(ctx, "get_hf_processor")
    assert not any(t.is_alive() for t in threads), "a request thread did not finish in 300 s"
    assert not errors, errors
    assert len(met) == len(jobs) and not barrier.broken, "the four requests were not in their producers together"


def test_subclasses_keep_vllm_behaviour(m46):
    """A subclass of vLLM's 4.6 classes that no family member owns (defined here, not in vLLM's 4.6 / 4.7 modules)
    gets vLLM's own placeholder, fix applied or not (tests/test_family.py covers every fix)."""
    from vllm.multimodal.parse import ImageSize

    from vllm_minicpm_hotfix.fixes import _mm_prompt as mp

    info_cls = getattr(m46, "MiniCPMV4_6ProcessingInfo")
    sub = type("SubInfo", (info_cls,), {})
    native = mp.stand_in_hf_processor()
    stand_in = mp.stand_in_info(sub, native, image_processor=mp.ModeDefaultingImageProcessor(native.image_processor))
    own = info_cls.get_slice_image_placeholder(stand_in, ImageSize(130, 82))
    with hotfix(m46, "force", fixes=("mm_placeholders",)):
        assert sub.get_slice_image_placeholder(stand_in, ImageSize(130, 82)) == own
        fixed = info_cls.get_slice_image_placeholder(mp.stand_in_info(info_cls, native), ImageSize(130, 82))
    assert fixed.count("<|image_pad|>") == 4  # transformers' count for 130x82 at scale 112 (vLLM 0.22-0.23: 6)
