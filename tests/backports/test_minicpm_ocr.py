"""The MiniCPM-OCR backport (``vllm_minicpm_hotfix/backports/minicpm_ocr.py``, its model classes in
``backports/models/minicpm_ocr.py``), without an engine: the probe, the registration through vLLM's registries, the
prompt and the load, each against transformers (5.24: ``MiniCPMOcrProcessor``, the checkpoint's tensors), never
against the backport's own output.

* **Probe** (every environment): ``missing`` where vLLM's ``ModelRegistry`` lacks
  ``MiniCPMOcrForConditionalGeneration`` and transformers has ``MiniCPMOcrConfig`` (0.22-0.30, transformers 5.24),
  ``unrecognised`` where transformers has no OCR (0.28.0 with 5.20.0, 0.32.0 with 5.19.0, and 0.33.0, whose own class
  cannot read a checkpoint's config with its transformers 5.20.2): pinned in tests/support/expected.py.
* **Stock** (0.22.1, 0.28.0): ``ModelConfig(model=<an OCR checkpoint>)`` -- what ``LLM(...)`` and ``vllm serve``
  build first -- raises vLLM's ``Model architectures ['MiniCPMOcrForConditionalGeneration'] are not supported``.
* **Registration**: ``auto`` / ``force`` register the lazy entry, vLLM resolves the checkpoint to the backport's class
  and builds its processor; ``unregister`` gives stock back; ``off`` registers nothing.
* **Prompt**: vLLM's token ids equal ``MiniCPMOcrProcessor``'s for sizes from tiny (upsized) to sliced, with
  per-request kwargs, for the checkpoint's ``small_image_upsize`` ``"always"`` and for ``"adaptive"`` and ``"never"``
  (model-level kwargs), on noise and on document-like images (glyphs: the adaptive tier decided from the pixels, per
  slice too). Shown to need the OCR layout: there, vLLM's 4.6 size-based count differs from transformers'.
* **Load**: the backport's model built on CPU and loaded (the q/k/v loader fix applied, as the hook applies it where
  vLLM's loader is broken): every parameter equals the checkpoint's tensors (``qkv_proj`` = cat(q, k, v) ...),
  every vision layer kept, the ``"4x"`` default read from the config.

Placement: the probe everywhere; the rest on 0.22.1 and 0.28.0 (the two families of 4.6 classes where the backport
applies: 0.22's and 0.28's). No engine (tests/e2e/test_backport_ocr.py); one tiny checkpoint written by transformers.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import vllm_minicpm_hotfix
from support import expected as table
from support.backport47 import (
    assert_every_parameter_equals, forget_resolved, model_config, registered_as_the_hook_does, unregister_all,
    write_checkpoint,
)
from support.hotfix import hotfix
from support.prompt import assert_all_equal, hf_ids, image, make_pair, video, vllm_ids, with_hotfix
from vllm_minicpm_hotfix import backports, record
from vllm_minicpm_hotfix.backports import minicpm_ocr as bp

#: Where vLLM lacks OCR and the backport registers it, and these tests run (tests/support/expected.py has it
#: ``missing`` on 0.22-0.30 with transformers 5.24).
HERE = ("0.22.1", "0.28.0")
here = pytest.mark.placed(*HERE)

NOT_SUPPORTED = "Model architectures ['MiniCPMOcrForConditionalGeneration'] are not supported"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("backport-ocr") / "ocr", member="ocr")


@pytest.fixture
def registered(registry_module, importable, monkeypatch):
    """The backport registered as the hook registers it (``auto``) for one test; unregistered after."""
    with registered_as_the_hook_does(bp, registry_module, importable, monkeypatch) as row:
        yield row


# --------------------------------------------------------------------------------------------------------------------
# The probe and the registration
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.stock_pin
def test_probe_verdict_is_pinned(registry_module, environment):
    verdict = bp.probe(registry_module)
    assert verdict.state.value == table.backport_verdict(bp.NAME, environment), verdict
    if verdict.state.value == "missing":
        assert bp.ARCH in verdict.reason and "MiniCPMOcrConfig" in verdict.reason
    elif verdict.state.value == "correct":  # vLLM's own class, and a transformers with its config (0.34.0)
        assert verdict.reason.startswith("vLLM's own") and "vllm.model_executor.models.minicpm_ocr" in verdict.reason
        assert verdict.applicable is False, verdict
    else:
        assert "has no MiniCPMOcrConfig" in verdict.reason and verdict.applicable is False, verdict
        # 0.33.0: vLLM's own class, which its transformers cannot give a config
        own = bp.ARCH in registry_module.ModelRegistry.get_supported_archs()
        assert ("vLLM's own" in verdict.reason) is own, verdict


@here
def test_stock_vllm_does_not_support_the_checkpoint(registry_module, ckpt):
    assert not bp.registered(registry_module)
    forget_resolved()
    with pytest.raises(Exception, match=re.escape(NOT_SUPPORTED)):
        model_config(ckpt)


@here
def test_registered_through_vllms_registries(registry_module, ckpt, importable, monkeypatch, hotfix_mode):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    monkeypatch.setenv("PYTHONPATH", importable)
    registry = registry_module.ModelRegistry
    for mode in ("auto", "force"):
        hotfix_mode(mode)
        backports.run(registry_module)
        forget_resolved()
        try:
            row = vllm_minicpm_hotfix.status()["backports"][bp.NAME]
            assert (row["verdict"], row["registered"], row["member"]) == ("missing", True, "MiniCPM-OCR"), row
            assert record.backport_says(row) == "registered by the hotfix"
            entry = registry.models[bp.ARCH]
            assert (entry.module_name, entry.class_name) == (bp.MODEL_MODULE, bp.ARCH)
            mc = model_config(ckpt)
            cls, arch = registry.resolve_model_cls(mc.architectures, mc)
            assert (cls.__module__, cls.__name__, arch) == (bp.MODEL_MODULE, bp.ARCH, bp.ARCH)
            proc = MULTIMODAL_REGISTRY.create_processor(mc)
            assert (type(proc).__module__, type(proc).__name__) == (bp.MODEL_MODULE, "MiniCPMOcrMultiModalProcessor")
        finally:
            unregister_all(registry_module)
        assert bp.ARCH not in registry.get_supported_archs()
    hotfix_mode("off")
    rows = backports.run(registry_module)
    assert rows[bp.NAME].registered is False and "off" in rows[bp.NAME].why
    assert bp.ARCH not in registry.get_supported_archs()
    forget_resolved()
    with pytest.raises(Exception, match=re.escape(NOT_SUPPORTED)):
        model_config(ckpt)


# --------------------------------------------------------------------------------------------------------------------
# The prompt: transformers' MiniCPMOcrProcessor
# --------------------------------------------------------------------------------------------------------------------

#: (width, height): tiny (upsized; adaptive: the tiny tier), small, square, the 4x grid (449: 28- vs 56-alignment),
#: wide, tall, sliced.
SIZES = [(20, 20), (50, 40), (120, 90), (448, 448), (449, 448), (640, 480), (1000, 300), (300, 1200), (1344, 896)]
REQUEST_KWARGS = [{"max_slice_nums": 2}, {"slice_mode": False}, {"downsample_mode": "16x"}]


def document(width: int, height: int, filled: float = 1.0):
    """A white page with dark 4x8-pixel "glyphs" every 8 px across and 14 px down, over the top ``filled`` part of
    the page: small dense text for ``adaptive_upsize_resolution`` (glyph height 8 <= 12 px, >= 2 per 1000 px)."""
    import numpy as np
    from PIL import Image

    page = np.full((height, width, 3), 255, dtype=np.uint8)
    for y in range(3, int(height * filled) - 8, 14):
        for x in range(3, width - 4, 8):
            page[y:y + 8, x:x + 4] = 20
    return Image.fromarray(page, "RGB")


def _cases():
    cases = [(f"{w}x{h}", image(w, h), {}) for w, h in SIZES]
    cases += [(f"{w}x{h} {kw}", image(w, h), kw) for kw in REQUEST_KWARGS for w, h in SIZES[1::2]]
    cases += [(f"document {w}x{h}", document(w, h), {}) for w, h in ((60, 60), (300, 200), (900, 600))]
    cases += [("document 900x600, text on the top quarter", document(900, 600, 0.25), {})]
    return cases


@here
@pytest.mark.parametrize("upsize", [None, "adaptive", "never"])
def test_prompt_ids_equal_transformers(m46, ckpt, registered, upsize):
    """Every fix applied as the hook applies them (the product): vLLM's prompt ids equal ``MiniCPMOcrProcessor``'s
    (called with the same kwargs) for every case, under the checkpoint's ``small_image_upsize`` (``"always"``) and
    the model-level ``"adaptive"`` and ``"never"``."""
    model_kwargs = {"small_image_upsize": upsize} if upsize else {}
    pair = make_pair(ckpt, model_kwargs)
    assert type(pair.vllm).__module__ == bp.MODEL_MODULE and type(pair.hf).__name__ == "MiniCPMOcrProcessor"
    cases = [(name, "image", [img], kwargs) for name, img, kwargs in _cases()]
    with with_hotfix(m46):
        assert_all_equal(pair, cases + [("two images", "image", [image(640, 480), image(50, 40)], {})])


#: Videos: (frames, width, height) and the request kwargs; transformers' ``MiniCPMOcrVideoProcessor`` slices and
#: sizes each frame as 4.6's does, with OCR's ``"4x"`` alignment (no small-image upsize for frames).
VIDEOS = [((2, 56, 56), {}), ((2, 640, 480), {}), ((1, 1000, 300), {}), ((2, 640, 480), {"max_slice_nums": 1}),
          ((2, 640, 480), {"slice_mode": False}), ((1, 1000, 300), {"downsample_mode": "16x"}),
          ((2, 640, 480), {"use_image_id": False})]


@here
def test_video_prompt_ids_equal_transformers(m46, ckpt, registered, monkeypatch):
    """A video's prompt ids equal ``MiniCPMOcrProcessor``'s: ``mm_placeholders``, which declares MiniCPM-OCR, gives
    each frame transformers' text (the backport's classes inherit 4.6's video text). Without the declaration vLLM's
    4.6 arithmetic differs from transformers on some of these videos."""
    from vllm_minicpm_hotfix.fixes import mm_placeholders

    pair = make_pair(ckpt, {})
    cases = [(f"video {f}x{w}x{h}", "video", [video(w, h, f)], kw) for (f, w, h), kw in VIDEOS]
    cases += [("two videos", "video", [video(640, 480, 1), video(56, 56, 2)], {})]
    with with_hotfix(m46):
        assert_all_equal(pair, cases)
    monkeypatch.setattr(mm_placeholders, "MODELS", tuple(m for m in mm_placeholders.MODELS if m != "MiniCPM-OCR"))
    with with_hotfix(m46), pytest.raises(AssertionError, match="prompts differ from transformers'"):
        assert_all_equal(pair, cases)


@here
@pytest.mark.parametrize(("upsize", "size"), [("adaptive", (50, 40)), ("never", (120, 90))])
def test_the_crops_decide_the_count_where_the_size_cannot(m46, ckpt, registered, upsize, size):
    """Why the backport lays an image out from its crops: under ``"adaptive"`` (the tiny tier, decided from the
    pixels) and ``"never"`` (native size) transformers gives a small image fewer pads than vLLM's 4.6 size-based
    count (``get_num_image_tokens``: what a subclass without OCR's layout puts in the prompt); the backport's prompt
    has transformers' number."""
    from vllm.multimodal.parse import ImageSize

    pair = make_pair(ckpt, {"small_image_upsize": upsize})
    pad = pair.hf.image_token_id
    img = image(*size)
    with with_hotfix(m46):
        by_size = pair.vllm.info.get_num_image_tokens(ImageSize(*img.size))
        want = hf_ids(pair, "image", [img], {}).count(pad)
        assert want < by_size, (img.size, want, by_size)
        assert vllm_ids(pair, "image", [img], {}).count(pad) == want


# --------------------------------------------------------------------------------------------------------------------
# The load
# --------------------------------------------------------------------------------------------------------------------


@here
def test_every_parameter_equals_the_checkpoint(m46, ckpt, registered, environment):
    from support.vllm_build import build_vllm_model, checkpoint_tensors, load_checkpoint

    ocr = importlib.import_module(bp.MODEL_MODULE)
    tensors = checkpoint_tensors(ckpt)
    with hotfix(m46, "auto", fixes=("qkv_loader", "qkv_completeness_guard")):
        model = build_vllm_model(ckpt, load=False, model_cls=ocr.MiniCPMOcrForConditionalGeneration)
        load_checkpoint(model, ckpt)
    config = model.config
    assert config.downsample_mode == "4x"
    assert len(model.vpm.encoder.layers) == config.vision_config.num_hidden_layers  # OCR keeps every vision layer
    params, used, aliases = assert_every_parameter_equals(model, tensors)
    qkv = dict(model.named_parameters())["vit_merger.self_attn.qkv_proj.weight"]
    parts = [tensors[f"model.vision_tower.vit_merger.self_attn.{p}_proj.weight"] for p in "qkv"]
    import torch

    assert torch.equal(qkv, torch.cat(parts))
    print(f"\nOCR ({environment[0]}): {len(params)} parameters equal to {len(used)} checkpoint tensors")


# --------------------------------------------------------------------------------------------------------------------
# The fixes OCR inherits a defect from (they declare MiniCPM-OCR)
# --------------------------------------------------------------------------------------------------------------------


@here
def test_frame_budget_is_what_the_loader_samples(m46, ckpt, registered):
    """OCR's processing info inherits 4.6's ``get_num_frames_with_most_features`` and its 16-frame cap, below the 32
    frames vLLM's video loader samples; ``video_budget``, which declares MiniCPM-OCR, makes it 32."""
    from support.prompt import PREREQUISITES
    from vllm_minicpm_hotfix.fixes import _base, video_budget

    def budget():
        info = make_pair(ckpt, {}).vllm.info
        assert _base.model_of(info) == "MiniCPM-OCR", type(info)
        # a long context: at "4x" a 448-pixel frame and its slices are ~2,500 tokens, and the budget is bounded by what fits
        return info.get_num_frames_with_most_features(2 ** 17, {"video": 1}), video_budget.loader_frames(info)

    with hotfix(m46, "auto", fixes=PREREQUISITES):
        stock_frames, loader = budget()
    with hotfix(m46, "auto", fixes=(*PREREQUISITES, "video_budget")):
        fixed, _ = budget()
    assert (stock_frames, loader, fixed) == (16, 32, 32)
    assert "MiniCPM-OCR" in video_budget.MODELS


# --------------------------------------------------------------------------------------------------------------------
# request_kwargs: a bad per-request kwarg is refused (HTTP 400) before any pixel work
# --------------------------------------------------------------------------------------------------------------------

#: (request kwargs, why it is bad by transformers' own MiniCPMOcrImageProcessor): "type" (not the type its
#: ``MiniCPMOcrImageProcessorKwargs`` declares), "tiny" (every part reduced to a few vision tokens), "silent" (taken
#: as another value without a word), "fixed" (other pixel values than the model was built with).
OCR_REFUSED = [
    ({"slice_mode": "false"}, "type"),
    ({"max_slice_nums": 0}, "silent"),
    ({"scale_resolution": 13}, "tiny"),
    ({"patch_size": 7}, "fixed"),
    ({"downsample_mode": "2x"}, "silent"),
    ({"small_image_upsize": "sometimes"}, "silent"),
    ({"small_image_upsize": 1}, "type"),
    ({"images_kwargs": {"max_slice_nums": "9"}}, "type"),
]
def _kw_id(kwargs: dict) -> str:
    return ",".join(f"{k}={v!r}" for k, v in kwargs.items())


def _hf(hf, img, kwargs):
    """transformers' ``MiniCPMOcrProcessor`` on one image: ``(pads, target_sizes, pixel_values)`` or its exception."""
    try:
        out = hf(text=[hf.image_token], images=[img], **kwargs)
    except Exception as exc:  # noqa: BLE001 - the reference outcome
        return exc
    return int((out["input_ids"] == hf.image_token_id).sum()), out["target_sizes"].tolist(), out["pixel_values"]


@here
@pytest.mark.parametrize(("kwargs", "kind"), OCR_REFUSED, ids=[_kw_id(k) for k, _ in OCR_REFUSED])
def test_bad_request_kwargs_are_bad_for_transformers(ckpt, kwargs, kind):
    """The independent reason each refused kwarg is bad, on transformers' own ``MiniCPMOcrProcessor``."""
    import typing

    import torch
    from transformers import AutoProcessor
    from transformers.models.minicpm_ocr import image_processing_minicpm_ocr as ipm

    hf = AutoProcessor.from_pretrained(str(ckpt))
    assert type(hf).__name__ == "MiniCPMOcrProcessor"
    img = image(640, 480)
    ((key, value),) = kwargs.items()
    if key == "images_kwargs":
        ((key, value),) = value.items()
    got, own = _hf(hf, img, kwargs), _hf(hf, img, {})
    if kind == "type":
        want = typing.get_type_hints(ipm.MiniCPMOcrImageProcessorKwargs)[key]
        assert not isinstance(value, want) or (want is int and isinstance(value, bool)), (key, want)
    elif kind == "tiny":  # the source and each slice: a handful of vision tokens
        assert not isinstance(got, Exception) and got[0] <= 4 * (1 + hf.image_processor.max_slice_nums), got[:2]
    elif kind == "silent":  # transformers takes it as another value: the request does not get what it asked for
        assert not isinstance(got, Exception), got
        other = {"max_slice_nums": {"slice_mode": False}, "downsample_mode": {"downsample_mode": "16x"},
                 "small_image_upsize": {"small_image_upsize": "never"}}[key]
        assert got[:2] == _hf(hf, img, other)[:2], (kwargs, other)
    else:  # fixed: the model was built with other pixel values
        if not isinstance(got, Exception):
            assert got[2].shape != own[2].shape or not torch.equal(got[2], own[2])


@here
@pytest.mark.parametrize(("kwargs", "kind"), OCR_REFUSED, ids=[_kw_id(k) for k, _ in OCR_REFUSED])
def test_bad_request_kwargs_are_refused_before_the_pixel_work(m46, ckpt, registered, monkeypatch, kwargs, kind):
    """``request_kwargs`` declares MiniCPM-OCR: each bad kwarg raises its ``RequestKwargsError`` (a ``ValueError``:
    HTTP 400) naming the kwarg, the value and the model before vLLM hands the image to transformers. Without the
    declaration (``MODELS`` without OCR) the same request reaches the pixel work."""
    from support.prompt import pixel_work_calls, processed
    from vllm_minicpm_hotfix.fixes import request_kwargs as rk

    ((key, value),) = kwargs.items()
    name = f"mm_processor_kwargs.{key}"
    if key == "images_kwargs":
        ((inner, value),) = value.items()
        name = f"{name}.{inner}"
    pair = make_pair(ckpt, {})
    with with_hotfix(m46) as statuses, pixel_work_calls(pair.vllm) as calls:
        assert statuses[rk.NAME].applied
        with pytest.raises(rk.RequestKwargsError) as info:
            processed(pair, "image", [image(640, 480)], kwargs)
    msg = str(info.value)
    assert not calls, calls
    assert isinstance(info.value, ValueError) and info.value.kwarg == name
    assert msg.startswith("MiniCPM-OCR: ") and f"{name} = {value!r}" in msg
    assert "must be" in msg or "fixed by the model" in msg
    if key == "small_image_upsize":
        assert "['always', 'never', 'adaptive']" in msg

    monkeypatch.setattr(rk, "MODELS", tuple(m for m in rk.MODELS if m != "MiniCPM-OCR"))
    with with_hotfix(m46), pixel_work_calls(pair.vllm) as calls:
        try:
            processed(pair, "image", [image(640, 480)], kwargs)
        except Exception as exc:  # noqa: BLE001 - what vLLM and transformers make of it
            assert not isinstance(exc, rk.RequestKwargsError), exc
    assert calls, "without the declaration the request was refused before the pixel work"


@here
@pytest.mark.parametrize("kwargs", [{"small_image_upsize": "never"}, {"small_image_upsize": "adaptive"}], ids=_kw_id)
def test_request_small_image_upsize_is_taken(m46, ckpt, registered, kwargs):
    """OCR's own per-request ``small_image_upsize`` (declared by ``MiniCPMOcrImageProcessorKwargs``) is not refused
    and gives transformers' prompt, small to sliced, noise and document."""
    pair = make_pair(ckpt, {})
    wrong = []
    with with_hotfix(m46):
        for name, img in [("50x40", image(50, 40)), ("120x90", image(120, 90)), ("1344x896", image(1344, 896)),
                          ("document 300x200", document(300, 200))]:
            if vllm_ids(pair, "image", [img], kwargs) != hf_ids(pair, "image", [img], kwargs):
                wrong.append(name)
    assert not wrong, wrong


# --------------------------------------------------------------------------------------------------------------------
# placeholder_guard: an item whose placeholder disagrees with its tensors is refused, not sent to the engine
# --------------------------------------------------------------------------------------------------------------------


@here
@pytest.mark.parametrize("size", [(50, 40), (1344, 896)])
def test_placeholder_guard_refuses_a_mismatched_item(m46, ckpt, registered, monkeypatch, size):
    """``placeholder_guard`` declares MiniCPM-OCR. The backport's text is transformers' (the prompt tests above run
    with the guard applied: it refuses none of them); here one pad is taken off its text, as a layout defect would:
    the guard refuses the request (a ``ValueError``: HTTP 400) with the embedding count transformers' own
    ``MiniCPMOcrProcessor`` gives the image; without the declaration vLLM takes the short prompt on to the engine
    (where the merge of the vision embeddings fails)."""
    from support.prompt import processed
    from vllm_minicpm_hotfix.fixes import placeholder_guard as pg

    pair = make_pair(ckpt, {})
    pad = pair.hf.image_token_id
    img = image(*size)
    want = hf_ids(pair, "image", [img], {}).count(pad)
    own = type(pair.vllm).image_text
    monkeypatch.setattr(type(pair.vllm), "image_text",
                        lambda self, *a, **k: own(self, *a, **k).replace(pair.hf.image_token, "", 1))
    with with_hotfix(m46) as statuses:
        assert statuses[pg.NAME].applied
        with pytest.raises(pg.PlaceholderMismatchError) as info:
            processed(pair, "image", [img], {})
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and msg.startswith("MiniCPM-OCR: image item 0 ")
    assert f"has {want - 1} <|image_pad|> placeholder tokens" in msg and f"give {want} vision embeddings" in msg

    monkeypatch.setattr(pg, "MODELS", tuple(m for m in pg.MODELS if m != "MiniCPM-OCR"))
    with with_hotfix(m46):
        assert vllm_ids(pair, "image", [img], {}).count(pad) == want - 1
