"""MiniCPM-V 4.6 image and video placeholders equal to transformers' own: W/H order, slice layout, every processor
kwarg, per request.

What breaks
-----------
(``vllm/model_executor/models/minicpmv4_6.py``; measured per release in docs/serving.md.) vLLM computes the text that
replaces each ``<|image_pad|>`` / ``<|video_pad|>`` of a prompt itself
(``MiniCPMV4_6ProcessingInfo.get_slice_image_placeholder`` / ``_compute_visual_tokens``,
``MiniCPMV4_6MultiModalProcessor.get_video_prompt_texts``), separately from the pixel values transformers' image
processor makes for the same item. Where the two disagree on the number of pads the engine dies in
``_merge_multimodal_embeddings`` (every request in flight fails); where only the text differs the model is silently
prompted unlike it was trained.

* 0.22-0.23: ``ImageSize(width, height)`` handed to transformers helpers that take ``(height, width)`` (~6% of image
  sizes crash; vLLM #45244); an HWC array's (image or video frame) size read as CHW (every video crashes on 0.22).
* 0.22-0.24: rows and columns of the slice grid swapped in the text (vLLM #45918); hidden on 0.22-0.23 by the swap
  above for all but square-ish sizes.
* 0.22-0.31: a request's ``mm_processor_kwargs.max_slice_nums`` ignored by the text (one request crashes a shared
  server).
* every release 0.22-0.33: ``slice_mode: false`` (model-level or per request), a request's ``scale_resolution`` and
  ``use_image_id: false`` ignored by the text; a video's per-request ``max_slice_nums`` ignored by its tensors and its
  text (transformers' video processor honours it).

What the fix does
-----------------
It replaces vLLM's arithmetic by transformers' own processor instead of patching it line by line
(:mod:`._mm_prompt`): each placeholder is ``replace_image_token`` / ``replace_video_token`` of the processor vLLM
built, fed with what the installed image processor's own ``get_sliced_grid`` / ``find_best_resize`` /
``get_refine_size`` give for the item's size (read from the item itself, as transformers reads it) and its effective
kwargs (the processor's, then the request's, then what vLLM resolved and passed), plus ``<image_id>i</image_id>``
where ``use_image_id``. Set on vLLM's classes (``PATCHES``):

* ``MiniCPMV4_6MultiModalProcessor._get_mm_prompt_updates`` (vLLM's ``BaseMultiModalProcessor`` method that gets
  ``_get_prompt_updates`` and resolves each replacement callable per item): vLLM's own, run inside
  :data:`._mm_prompt.REQUEST` (this call's items and ``mm_processor_kwargs``; a ``ContextVar``, so concurrent
  requests never see each other's);
* ``MiniCPMV4_6ProcessingInfo.get_slice_image_placeholder`` / ``get_num_image_tokens`` and
  ``MiniCPMV4_6MultiModalProcessor.get_video_prompt_texts``: transformers' text / its pad count;
* ``MiniCPMV4_6MultiModalProcessor.process_mm_inputs`` and ``MiniCPMV4_6ProcessingInfo.get_video_max_slice_num``:
  a video's frames are sliced with the request's own ``max_slice_nums`` where it has one (vLLM pinned the video
  processor's), so tensors and text agree with transformers.

It acts for MiniCPM-V 4.6, 4.7 and MiniCPM-OCR (``MODELS``; 4.7's and OCR's classes inherit every method above, and
the text is transformers' ``MiniCPMV4_7Processor``'s / ``MiniCPMOcrProcessor``'s, which vLLM builds for them);
instances of any other subclass get vLLM's own behaviour (the framework's class policy). Where the image processor
sizes a crop from the pixels (OCR's ``small_image_upsize``: :data:`PIXEL_SIZED`) an image's text is laid out from the
crops it returned for that item (vLLM's ``tgt_sizes``), as ``MiniCPMOcrProcessor.replace_image_token`` does; vLLM
0.33's own ``MiniCPMOcrMultiModalProcessor._get_prompt_updates``, which puts a text of its own in place of each
image's (``<image_id>`` kept under ``use_image_id: false``, the sliced grid under ``slice_mode: false``), gives way to
the 4.6 class's (:func:`ocr_get_prompt_updates`). The W/H order and the layout are fixed together, as one replacement:
fixing the swap alone on 0.22-0.23 uncovers the full rows/columns bug.
``processor_downsample_mode`` (transformers >= 5.21's required ``downsample_mode``) stays a fix of its own: this one
passes ``downsample_mode`` to transformers itself wherever the installed signature takes it and never calls
``_compute_visual_tokens``, so it is correct with or without that fix; ``_compute_visual_tokens`` (which vLLM code
outside these producers may call) keeps needing it.

The decision
------------
Resolves the installed ``_get_mm_prompt_updates`` / ``_get_prompt_updates`` (the current class attributes: re-run on
the patched module it answers ``correct``) on stand-ins -- vLLM's real ``MiniCPMV4_6ProcessingInfo`` /
``MiniCPMV4_6MultiModalProcessor`` created without ``__init__``, over a real transformers ``MiniCPMV4_6Processor``
with a tiny in-memory tokenizer, patch 14 and ``scale_resolution`` 112 -- for the cases in :data:`CASES` (one per
defect above, sizes found by running each family's arithmetic) and compares each resolved text with transformers' for
the same size and kwargs. ``broken`` names every case that differs; ``correct`` if all are equal. No pixels are
processed: ~10-50 ms.

Upstream
--------
vllm-project/vllm#45244 (width and height swapped, fixed in 0.24), vllm-project/vllm#45918 (rows and columns swapped,
fixed in 0.25) and vllm-project/vllm#44509 (a video frame's size read as CHW, fixed in 0.23). For the request's own
kwargs (``slice_mode``, ``scale_resolution``, ``use_image_id``, ``max_slice_nums`` before 0.32) none known.

Remove when
-----------
its probe finds vLLM's own resolved text equal to transformers' in every case of :data:`CASES` on every release the
hotfix supports; no release measured so far (0.34.0 included) passes the request ``slice_mode`` case.
"""

from __future__ import annotations

import functools
import weakref
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from . import _mm_prompt as mp
from . import _stand_ins
from ._base import (
    INFO_CLASS, PROCESSOR_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, WeakMemo, base_named, on_import, wrap,
)

NAME = "mm_placeholders"
LABEL = "image/video placeholder text (transformers' layout and kwargs)"
MODELS = (V46, V47, VOCR)
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use


#: ``id(ctx)`` -> a weak reference to what ``ctx.get_hf_processor()`` returned, while ``ctx`` lives: vLLM's own cache of
#: it (``cached_processor_from_config``) looks the model config up on every call, several times per request.
_NATIVE = WeakMemo(limit=64)


def _native(info: Any) -> Any:
    """transformers' own processor vLLM built for this model (model-level ``mm_processor_kwargs`` merged in):
    ``InputProcessingContext.get_hf_processor()``, cached by vLLM; looked up once per context while vLLM keeps that
    processor (a weak reference: nothing is kept alive here)."""
    ctx = info.ctx
    ref = _NATIVE.get(id(ctx), (ctx,))
    hf = ref() if ref is not None else None
    if hf is None:
        hf = ctx.get_hf_processor()
        try:
            _NATIVE.put(id(ctx), (ctx,), weakref.ref(hf))
        except TypeError:  # not weakly referenceable: looked up on every call
            pass
    return hf


#: The image processor option under which a crop's size depends on the image's pixels, not only its size
#: (transformers' ``MiniCPMOcrImageProcessor.small_image_upsize``: "never", "adaptive"): such an image's text is laid
#: out from the crops its image processor returned, as ``MiniCPMOcrProcessor.replace_image_token`` lays it out.
PIXEL_SIZED = "small_image_upsize"


#: :func:`image_placeholder`'s texts, per (vLLM's processing context, whether the size is the item's own, the image's
#: size, the request's kwargs, the explicit arguments, the index), for images sized by their size alone: the text is a
#: pure function of these and of the configuration of the processors the context builds (``_native``), which vLLM
#: builds once per model and never sets again (a request's kwargs reach transformers as call arguments, not as
#: attributes). Keyed by the context, so that a hit needs no look-up of the processors.
_PLACEHOLDERS = WeakMemo()


#: The arguments vLLM may pass a placeholder method explicitly, in the order :func:`image_placeholder` takes their
#: values (``use_image_id`` last: a pad count passes False for it).
EXPLICIT = ("max_slice_nums", "downsample_mode", "use_image_id")


def image_placeholder(info: Any, image_size: Any, idx: int, explicit: tuple, *, from_item: bool = True) -> str:
    """transformers' text for image ``idx`` of the current request (see :mod:`._mm_prompt`).

    ``image_size`` is vLLM's ``ImageSize(width, height)``; with ``from_item`` the size read from the request's own
    item ``idx`` wins where there is one (vLLM 0.22-0.23 read an HWC array's size as CHW). ``explicit``: the values of
    :data:`EXPLICIT` vLLM passed (None where it did not), which win over the request's kwargs."""
    request = mp.REQUEST.get()  # mp.current() without its frame: once per image of every request
    hw = (mp.image_item_hw(request, idx) if from_item else None) or (int(image_size.height), int(image_size.width))
    ctx = info.ctx
    given = request.kwargs if request else None
    try:  # kept only for images sized by their size alone (not PIXEL_SIZED), so a hit is one
        key = (id(ctx), from_item, hw, tuple(given.items()) if given else (), explicit, idx)
        text = _PLACEHOLDERS.get(key, (ctx,))
    except TypeError:  # an unhashable kwarg: built every time
        key = text = None
    if text is not None:
        return text
    hf = _native(info)
    ip = hf.image_processor
    eff = mp.effective_kwargs(ip, given, dict(zip(EXPLICIT, explicit)))
    if from_item and hasattr(ip, PIXEL_SIZED):
        crops = mp.image_item_crops(request, idx)
        if crops:  # sized from its pixels: the crops transformers' image processor returned for this item
            try:
                return mp.image_text_of_crops(hf, ip, (*hw, *crops), eff, idx)
            except ValueError:  # vLLM and transformers disagree on the item: placeholder_guard's to refuse
                pass
        key = None  # a text for such an image is never kept
    text = mp.image_text(hf, ip, hw, eff, idx)
    if key is not None:
        _PLACEHOLDERS.put(key, (ctx,), text)
    return text


def video_placeholder(processor: Any, frame_size: Any, num_frames: int, idx: int, explicit: dict) -> str:
    """transformers' text for video ``idx`` of the current request: each frame sized as the request's own frames
    (vLLM 0.22 read an HWC frame as CHW), processed with the request's kwargs."""
    info = processor.info
    hf = _native(info)
    ip = hf.image_processor
    request = mp.current()
    if explicit.get("max_slice_nums") is None:
        # What vLLM's process_videos hands the image processor for every frame (with this fix: the request's own).
        explicit = {**explicit, "max_slice_nums": info.get_video_max_slice_num()}
    eff = mp.effective_kwargs(ip, request.kwargs if request else None, explicit)
    frames = mp.video_frames_hw(request, idx)
    if frames is None:
        frames = [(int(frame_size.height), int(frame_size.width))] * int(num_frames)
    return mp.video_text(hf, ip, frames, eff, idx)


def get_mm_prompt_updates(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``BaseMultiModalProcessor._get_mm_prompt_updates(self, mm_items, hf_processor_mm_kwargs,
    out_mm_kwargs) -> MultiModalPromptUpdates`` (set on the 4.6 processor class): vLLM's own, run with
    :data:`._mm_prompt.REQUEST` set to this call's items and kwargs. It is where vLLM runs the replacement callables
    of ``_get_prompt_updates``: ``_bind_and_group_updates`` resolves every update per item at once
    (``PromptUpdate.resolve`` calls its replacement, 0.22-0.33), and a resolved update holds text, not a callable.
    So every placeholder of the call is laid out for this request, and nothing is copied per request."""
    token = mp.REQUEST.set(mp.request((call.get("mm_items"), call.get("hf_processor_mm_kwargs") or {},
                                       call.get("out_mm_kwargs"))))
    try:
        return wrapped(*call.args, **call.kwargs)
    finally:
        mp.REQUEST.reset(token)


def process_mm_inputs(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``MiniCPMVMultiModalProcessor.process_mm_inputs(self, mm_data, mm_kwargs[, tok_kwargs])`` (where vLLM
    turns a request's items into tensors, 0.22-0.33): run with :data:`._mm_prompt.PROCESSING` set to its
    ``mm_kwargs`` where ``mm_data`` holds videos (only ``process_videos`` asks ``get_video_max_slice_num``; it returns
    at once where ``mm_data.get("videos")`` is None, as this does)."""
    mm_data = call.get("mm_data")
    if mm_data is not None and mm_data.get("videos") is None:
        return wrapped(*call.args, **call.kwargs)
    token = mp.PROCESSING.set(dict(call.get("mm_kwargs") or {}))
    try:
        return wrapped(*call.args, **call.kwargs)
    finally:
        mp.PROCESSING.reset(token)


def get_video_max_slice_num(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> int:
    """Around ``MiniCPMV4_6ProcessingInfo.get_video_max_slice_num(self) -> int`` (the slice limit vLLM hands the
    image processor for every video frame, and counts with): the request's own ``max_slice_nums`` while one is being
    processed -- as transformers' video processor honours it -- else vLLM's (the video processor's)."""
    requested = mp.request_max_slice_nums()
    return requested if requested is not None else wrapped(*args, **kwargs)


def get_slice_image_placeholder(wrapped: Any, instance: Any, call: Call) -> str:
    """Instead of ``MiniCPMV4_6ProcessingInfo.get_slice_image_placeholder(self, image_size, image_idx=0,
    max_slice_nums=None, use_image_id=True, downsample_mode=None) -> str``: transformers' text
    (:func:`image_placeholder`); arguments vLLM passes explicitly win over the request's kwargs."""
    explicit = tuple(map(call.get, EXPLICIT))
    return image_placeholder(instance, call["image_size"], int(call.get("image_idx", 0) or 0), explicit)


def get_num_image_tokens(wrapped: Any, instance: Any, call: Call) -> int:
    """Instead of ``MiniCPMV4_6ProcessingInfo.get_num_image_tokens(self, image_size, max_slice_nums=None,
    downsample_mode=None) -> int``: the number of ``<|image_pad|>`` in :func:`image_placeholder`'s text."""
    explicit = (*map(call.get, EXPLICIT[:-1]), False)  # no <image_id>: only pads are counted
    text = image_placeholder(instance, call["image_size"], 0, explicit, from_item=False)
    return text.count(mp.token(_native(instance), "image_token"))


def get_video_prompt_texts(wrapped: Any, instance: Any, call: Call) -> str:
    """Instead of ``MiniCPMV4_6MultiModalProcessor.get_video_prompt_texts(self, image_size, num_frames,
    downsample_mode=None, video_idx=0) -> str``: transformers' text (:func:`video_placeholder`)."""
    explicit = {k: call.get(k) for k in ("max_slice_nums", "downsample_mode")}
    return video_placeholder(instance, call["image_size"], call["num_frames"], int(call.get("video_idx", 0) or 0),
                             explicit)


def ocr_get_prompt_updates(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Instead of vLLM 0.33's ``MiniCPMOcrMultiModalProcessor._get_prompt_updates(self, mm_items,
    hf_processor_mm_kwargs, out_mm_kwargs) -> Sequence[PromptUpdate]``: the 4.6 class's (vLLM's own, whose replacements
    this fix resolves with the request set), whose image text is transformers' laid out from the item's crops. vLLM's
    override puts a text of its own in place of each image's (also from the crops) that keeps ``<image_id>`` under
    ``use_image_id: false`` and the sliced layout under ``slice_mode: false``."""
    base = base_named(instance, PROCESSOR_CLASS)
    if base is None:
        return wrapped(*args, **kwargs)
    return base._get_prompt_updates(instance, *args, **kwargs)


#: vLLM 0.33's own MiniCPM-OCR multimodal processor (``vllm/model_executor/models/minicpm_ocr.py``).
OCR_PROCESSOR = "vllm.model_executor.models.minicpm_ocr:MiniCPMOcrMultiModalProcessor"

PATCHES = {
    f"{PROCESSOR_CLASS}._get_mm_prompt_updates": wrap(get_mm_prompt_updates, bind=True),
    f"{OCR_PROCESSOR}._get_prompt_updates": on_import(lambda old, owner: wrap(ocr_get_prompt_updates)
                                                      if "_get_prompt_updates" in vars(owner) else None),
    f"{INFO_CLASS}.get_slice_image_placeholder": wrap(get_slice_image_placeholder, bind=True),
    f"{INFO_CLASS}.get_num_image_tokens": wrap(get_num_image_tokens, bind=True),
    f"{PROCESSOR_CLASS}.get_video_prompt_texts": wrap(get_video_prompt_texts, bind=True),
    f"{PROCESSOR_CLASS}.process_mm_inputs": wrap(process_mm_inputs, bind=True),
    f"{INFO_CLASS}.get_video_max_slice_num": wrap(get_video_max_slice_num),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------------------------

#: (defect, modality, (width, height) of the image / of each frame, frames, model-level kwargs, request kwargs), at
#: the probe geometry (patch 14, scale_resolution 112, max_slice_nums 9). Sizes found by comparing each family's
#: own arithmetic with transformers: 130x82 (W/H order, 0.22-0.23), 137x137 / 67x214 (rows and columns, 0.22-0.24).
CASES: tuple[tuple[str, str, tuple[int, int], int, dict, dict], ...] = (
    ("image W/H order", "image", (130, 82), 1, {}, {}),
    ("slice layout (square)", "image", (137, 137), 1, {}, {}),
    ("slice layout (tall)", "image", (67, 214), 1, {}, {}),
    ("request max_slice_nums", "image", (224, 112), 1, {}, {"max_slice_nums": 1}),
    ("request slice_mode", "image", (224, 112), 1, {}, {"slice_mode": False}),
    ("request scale_resolution", "image", (112, 112), 1, {}, {"scale_resolution": 56}),
    ("request use_image_id", "image", (100, 100), 1, {}, {"use_image_id": False}),
    ("model slice_mode", "image", (224, 112), 1, {"slice_mode": False}, {}),
    ("model use_image_id", "image", (100, 100), 1, {"use_image_id": False}, {}),
    ("video frame size (HWC)", "video", (56, 56), 2, {}, {}),
    ("video request slice_mode", "video", (224, 112), 1, {}, {"slice_mode": False}),
    ("video request max_slice_nums", "video", (224, 112), 1, {}, {"max_slice_nums": 1}),
)


def _probe_item(modality: str, size: tuple[int, int], frames: int) -> Any:
    """A black image (PIL) or video (``(frames, H, W, 3)`` uint8 array, as vLLM's video loader hands frames over)."""
    import numpy as np
    from PIL import Image

    w, h = size
    if modality == "image":
        return Image.new("RGB", (w, h))
    return np.zeros((frames, h, w, 3), dtype=np.uint8)


@functools.lru_cache(maxsize=8)
def _probe_native(model_kwargs: tuple) -> Any:
    return _stand_ins.hf_processor(**dict(model_kwargs))


def _vllm_text(module: ModuleType, modality: str, item: Any, model_kwargs: dict, request_kwargs: dict) -> str:
    """The text the installed ``MiniCPMV4_6MultiModalProcessor._get_mm_prompt_updates`` resolves for one item, on
    stand-ins over a real transformers processor. For a video, the processed data hold per-frame ``[W, H]``
    (``video_image_sizes``) as vLLM 0.23+'s ``process_videos`` records them."""
    import torch

    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
    from vllm.multimodal.parse import ImageProcessorItems, MultiModalDataItems, VideoProcessorItems
    from transformers import BatchFeature

    from ._proxies import ModeDefaultingImageProcessor

    info_cls, proc_cls = getattr(module, INFO_CLASS), getattr(module, PROCESSOR_CLASS)
    native = _probe_native(tuple(sorted(model_kwargs.items())))
    info = _stand_ins.info(info_cls, native, image_processor=ModeDefaultingImageProcessor(native.image_processor))
    proc = _stand_ins.processor(proc_cls, info)
    batch = ImageProcessorItems([item]) if modality == "image" else VideoProcessorItems([item])
    items = MultiModalDataItems({modality: batch})
    out = MultiModalKwargsItems({})
    if modality == "video":
        sizes = torch.tensor([[frame.shape[1], frame.shape[0]] for frame in item], dtype=torch.long)
        out = MultiModalKwargsItems.from_hf_inputs(
            BatchFeature({"video_image_sizes": [sizes]}),
            {"video_image_sizes": MultiModalFieldConfig.batched("video")},
        )
    details = proc._get_mm_prompt_updates(items, dict(request_kwargs), out)[modality][0][0].content
    full = getattr(details, "full", details)
    return full if isinstance(full, str) else native.tokenizer.decode(list(full))


def _transformers_text(modality: str, item: Any, model_kwargs: dict, request_kwargs: dict) -> str:
    """transformers' text for the item: its processor's own sizing methods and ``replace_image_token`` /
    ``replace_video_token`` (:func:`._mm_prompt.image_text`), no pixels processed."""
    native = _probe_native(tuple(sorted(model_kwargs.items())))
    ip = native.image_processor
    eff = mp.effective_kwargs(ip, request_kwargs, {})
    if modality == "image":
        return mp.image_text(native, ip, (item.height, item.width), eff, 0)
    return mp.video_text(native, ip, [tuple(frame.shape[:2]) for frame in item], eff, 0)


def _compare(got: str, want: str, modality: str) -> str:
    pad = mp.TOKENS["image_token" if modality == "image" else "video_token"]
    if got.count(pad) != want.count(pad):
        return f"vLLM {got.count(pad)} pads, transformers {want.count(pad)}"
    rows_got, rows_want = got.count("\n"), want.count("\n")
    if rows_got != rows_want:
        return f"same pads, slice rows differ (vLLM {rows_got} line breaks, transformers {rows_want})"
    return f"same pads, text differs ({len(got)} vs {len(want)} characters)"


#: The order :func:`probe` runs :data:`CASES` in: first the case every release gets wrong (a request's
#: ``slice_mode: false``, tests/prompt/test_prompt_conformance.py's families A-D), so that on a broken release the probe
#: stops after one case.
PROBE_ORDER: tuple[str, ...] = ("request slice_mode",) + tuple(c[0] for c in CASES if c[0] != "request slice_mode")


def check_cases(module: ModuleType, cases: Any = CASES, *, first_broken: bool = False) -> list[tuple[str, State, str]]:
    """Run each of ``cases`` through the installed processor and transformers: ``(defect, state, detail)``. With
    ``first_broken``, stop after the first case that is broken."""
    found = []
    for name, modality, size, frames, model_kwargs, request_kwargs in cases:
        if first_broken and found and found[-1][1] is State.BROKEN:
            break
        label = f"{size[0]}x{size[1]}" + (f"x{frames} frames" if modality == "video" else "")
        try:
            item = _probe_item(modality, size, frames)
            want = _transformers_text(modality, item, model_kwargs, request_kwargs)
        except Exception as exc:
            found.append((name, State.UNDETERMINED, f"transformers failed: {type(exc).__name__}: {exc}"))
            continue
        try:
            got = _vllm_text(module, modality, item, model_kwargs, request_kwargs)
        except Exception as exc:
            found.append((name, State.BROKEN, f"{label}: vLLM raises {type(exc).__name__}: {exc}"))
            continue
        if got == want:
            found.append((name, State.CORRECT, label))
        else:
            found.append((name, State.BROKEN, f"{label}: {_compare(got, want, modality)}"))
    return found


def probe(module: ModuleType) -> Verdict:
    """Whether vLLM's placeholder text for the probe cases (:data:`CASES`) equals transformers' own.

    Runs the installed ``MiniCPMV4_6MultiModalProcessor._get_mm_prompt_updates`` on stand-ins over a real transformers
    ``MiniCPMV4_6Processor`` and compares the resolved text with what that processor produces for the same item and
    kwargs. ``broken`` if any case differs or raises (it stops at the first that does, :data:`PROBE_ORDER`: the
    reason names it), ``correct`` if all are equal, ``undetermined`` if a case could not run. Never raises; leaves
    ``module`` unchanged. Costs about 1 ms on a release where the first case differs, 6-8 ms where every case runs.
    """
    info_cls, proc_cls = getattr(module, INFO_CLASS, None), getattr(module, PROCESSOR_CLASS, None)
    missing = [
        f"{cls_name}.{attr}"
        for cls_name, cls in ((INFO_CLASS, info_cls), (PROCESSOR_CLASS, proc_cls))
        for attr in {t.split(".")[1] for t in PATCHES if t.startswith(cls_name + ".")}
        if not callable(getattr(cls, attr, None))
    ]
    if missing:
        return Verdict(State.UNRECOGNISED, f"{module.__name__} lacks {', '.join(sorted(missing))}", applicable=False)
    try:
        _stand_ins.tokenizer()
    except Exception as exc:
        return Verdict(State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    by_name = {case[0]: case for case in CASES}
    found = check_cases(module, [by_name[name] for name in PROBE_ORDER], first_broken=True)
    broken = [f"{name} ({detail})" for name, state, detail in found if state is State.BROKEN]
    unsure = [f"{name} ({detail})" for name, state, detail in found if state is State.UNDETERMINED]
    if broken:
        ok = [name for name, state, _ in found if state is State.CORRECT]
        rest = len(CASES) - len(found)
        return Verdict(
            State.BROKEN,
            f"vLLM's placeholder differs from transformers': {'; '.join(broken)}"
            + (f"; equal: {', '.join(ok)}" if ok else "")
            + (f"; {rest} more probe cases not run (check_cases runs them all)" if rest else ""),
        )
    if unsure:
        return Verdict(State.UNDETERMINED, f"could not compare: {'; '.join(unsure)}")
    return Verdict(State.CORRECT, f"vLLM's placeholder equals transformers' in all {len(found)} probe cases")
