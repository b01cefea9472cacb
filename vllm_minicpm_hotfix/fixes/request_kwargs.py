"""Bad or oversized MiniCPM-V ``mm_processor_kwargs`` get a clear HTTP 400 before any pixel work.

What breaks
-----------
vLLM hands a request's ``mm_processor_kwargs`` (0.22-0.31 by default, 0.32+ with ``--trust-request-mm-kwargs``)
unchecked to transformers' ``MiniCPMV4_6ImageProcessor`` / ``MiniCPMV4_6Processor`` (MiniCPM-V 4.7 uses the same
image processor). Which keys a request may set, and in what range, is MiniCPM-V knowledge vLLM does not have:

* wrong types (``slice_mode: "false"``, ``0`` or ``null``, ``max_slice_nums: null``, ``use_image_id: "no"``, on
  transformers 5.24 also ``max_slice_nums: "9"``/``9.5``/``true``, ``downsample_mode: 4``) fail transformers' own
  type check *inside* the processor: HTTP 500;
* keys that change the model's geometry (``patch_size: 0``/``1``/``7``, ``do_resize: false``, ``image_mean: []``,
  ``return_tensors: "np"``) give a division by zero, a ``split_with_sizes`` error, an ``UnboundLocalError``: 500;
* degenerate values transformers accepts (``scale_resolution`` of -448, 1 or 13) answer 200 about an image reduced
  to a handful of vision features;
* oversized values (``scale_resolution: 12000`` or ``100000``, ``slice_mode: false`` with a large
  ``scale_resolution``) make the API server resize the image to what they ask -- 5 GiB more RSS for 19 s, or a 30 GB
  allocation -- before vLLM's encoder-cache check refuses the request.

What the fix does
-----------------
It wraps ``BaseMultiModalProcessor.apply(inputs, timing_ctx)`` on ``MiniCPMV4_6MultiModalProcessor`` (the first
method that sees a request's ``mm_processor_kwargs`` together with its parsed items, on every release 0.22-0.33,
before ``_cached_apply_hf_processor`` hashes, looks up the processor cache or resizes anything). For the family
members in :data:`MODELS` it checks, in this order, and raises :class:`RequestKwargsError` (a ``ValueError``:
``vllm serve`` answers it 400 on every release) naming the kwarg, the value, what is allowed and the model:

1. the model-level ``--mm-processor-kwargs``, every key at once, in one error (once per processor, when vLLM builds
   it: the processor's ``__init__`` is wrapped too, because vLLM's start-up asks the processing info for its token
   counts -- ``MultiModalBudget``, in the API server before the engine starts on 0.30 -- before any ``apply``, and
   a bad value such as ``max_slice_nums: -1`` fails there with transformers' ``math domain error``; so a bad value
   stops ``vllm serve`` at start-up with this one error);
2. each request key the installed processor declares (flat, or inside ``images_kwargs`` / ``videos_kwargs``) -- see
   :func:`rules`: the sizing keys are checked for type and range, the keys the model was built with (geometry,
   normalisation, output format) may not be set;
3. for a request that sets kwargs, the budget per item (:func:`check_items`): the vision tokens and pixels each
   image or video would produce, computed from its size (PIL size / frames x frame size, nothing resized) and its
   effective kwargs by transformers' own ``get_sliced_grid`` / ``find_best_resize`` / ``get_refine_size``
   (:func:`._mm_prompt.slice_target_sizes`), must not exceed :func:`item_limit` -- the smaller of vLLM's encoder
   cache size and ``max_model_len``, which vLLM itself enforces only after the pixel work -- and the items' tokens
   together must fit ``max_model_len``. The processing of one allowed item therefore touches at most
   ``16 * patch_size**2`` pixels per channel per token of that limit. A request without kwargs costs what stock
   vLLM makes of it.

Nothing is decoded, resized, hashed or cached for a refused request, so vLLM's processor cache is left as it was.

The refusal reaches the client through the release's own error response, the connection kept: :func:`route_refusals`
wraps vLLM's ``build_app`` (:data:`APP_TARGET`, in the API server). vLLM's app turns an exception into its
``ErrorResponse`` in its exception handlers; Starlette runs the one registered for ``Exception`` (vLLM's catch-all)
in its outermost ``ServerErrorMiddleware``, which sends that response and then *re-raises*: uvicorn logs ``Exception
in ASGI application`` with a traceback and closes the connection, and a client's next request over it fails
(``ReadError`` / ``RemoteProtocolError``). vLLM 0.22.1's app has no handler for any class a refusal is but
``Exception``, 0.23-0.24's one for ``VLLMValidationError`` only; 0.26+ register ``ValueError``. Where the app, as vLLM
built it, would leave a :class:`~._base.Refusal` to the catch-all alone, the same handler function (vLLM's own) is
registered for ``Refusal``: Starlette then runs it in ``ExceptionMiddleware``, which answers and carries on -- the same
400 body, no traceback, the connection kept. Where the app has its own handler for it, nothing is added. It covers
every fix's refusal (``placeholder_guard``'s too) wherever this fix is applied.

MiniCPM-OCR (its processors, the backport's and vLLM 0.33's, inherit 4.6's ``apply``): transformers'
``MiniCPMOcrImageProcessorKwargs`` declares the same sizing keys and ``downsample_mode`` values as 4.6's, plus
``small_image_upsize`` (:data:`OPTIONAL_SIZING`: judged only where the installed image processor declares it, one of
:data:`UPSIZE_MODES`; transformers silently takes any other string as ``"never"``). The budget sizes an item as
``"always"`` does: an upper bound for ``"never"`` and ``"adaptive"``, except that ``"adaptive"`` sizes a tiny image
to 84 pixels even where ``scale_resolution`` is smaller (a few tokens more than counted).

The decision
------------
:func:`probe` runs the class's ``apply`` on a stand-in processor (created without ``__init__``) for a request with
``{"slice_mode": "false"}`` whose ``_cached_apply_hf_processor`` (the pixel work) raises a sentinel: ``broken`` if
the request reaches it (stock vLLM 0.22-0.33), ``correct`` if a ``ValueError`` refuses it first, ``undetermined`` on
anything else, ``unrecognised`` if the class or method is not there.

Upstream
--------
none known.

Remove when
-----------
its probe sees stock vLLM's ``apply`` refuse ``{"slice_mode": "false"}`` with a ``ValueError`` before the pixel work
(``_cached_apply_hf_processor`` never reached) on every release the hotfix supports; every release measured so far
takes it on to the pixel work.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import (
    EVERY_CALL, PROCESSOR_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, Refusal, model_of, on_import, wrap,
)
from . import _mm_prompt as mp

NAME = "request_kwargs"
LABEL = "request mm_processor_kwargs validation and per-item budget (HTTP 400 before any pixel work)"
BUDGET_MODULE = "vllm.multimodal.encoder_budget"
BUDGET_TARGET = f"{BUDGET_MODULE}:compute_mm_encoder_budget"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR's processors (the backport's, vLLM 0.33's) inherit 4.6's apply
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use
#: Its budget reads transformers' sizing as the prompt fixes leave it.
AFTER = ("processor_downsample_mode", "mm_placeholders")

#: The sizing keys a request may set (transformers' ``MiniCPMV4_6ImageProcessorKwargs``; MiniCPM-OCR's
#: ``MiniCPMOcrImageProcessorKwargs`` adds ``small_image_upsize``), with their type.
SIZING: dict[str, type] = {
    "max_slice_nums": int,
    "scale_resolution": int,
    "slice_mode": bool,
    "use_image_id": bool,
    "downsample_mode": str,
    "small_image_upsize": str,
}
#: Sizing keys judged only where the installed image processor declares them (MiniCPM-OCR's); elsewhere they are
#: left to vLLM and transformers, as any key the processor does not declare.
OPTIONAL_SIZING = frozenset({"small_image_upsize"})
#: Values ``downsample_mode`` may take (transformers: ``"4x"`` keeps 4x more tokens, anything else is ``"16x"``).
DOWNSAMPLE_MODES = ("16x", "4x")
#: Values MiniCPM-OCR's ``small_image_upsize`` may take (transformers 5.24: anything else is silently ``"never"``);
#: ``"adaptive"`` only where transformers has OpenCV (else its image processor raises ``ImportError``).
UPSIZE_MODES = ("always", "never", "adaptive")
#: Keys of transformers' image / video processor kwargs the model was built with (``ImagesKwargs`` /
#: ``VideosKwargs`` of transformers 5.7-5.24, plus MiniCPM-V's ``patch_size``); the installed classes' own
#: declarations are added at run time (:func:`fixed_keys`).
FIXED: frozenset[str] = frozenset({
    "patch_size", "do_convert_rgb", "do_resize", "size", "default_to_square", "crop_size", "resample", "do_rescale",
    "rescale_factor", "do_normalize", "image_mean", "image_std", "do_pad", "pad_size", "do_center_crop",
    "data_format", "input_data_format", "device", "return_tensors", "disable_grouping", "image_seq_length",
})
#: Video sampling keys of transformers' ``VideosKwargs`` / ``MiniCPMV4_6VideoProcessorKwargs``: vLLM samples the
#: frames itself (``--media-io-kwargs``); these are left to vLLM and transformers, not judged here.
VIDEO_SAMPLING: frozenset[str] = frozenset({
    "do_sample_frames", "video_metadata", "fps", "num_frames", "return_metadata", "max_num_frames", "stack_frames",
})
#: The nested per-modality scopes transformers' processor (and vLLM 0.32+) read.
SCOPES = {"images_kwargs": "image", "videos_kwargs": "video"}
#: One vision token of MiniCPM-V covers a 4 x 4 patch window ("16x": vit_merger 2x2, then the merger 2x2): the
#: smallest ``scale_resolution`` is that window's side, ``4 * patch_size`` pixels.
TOKEN_WINDOW = 4

_MODEL_CHECKED_ATTR = "_vllm_minicpm_hotfix_model_kwargs_checked"


class RequestKwargsError(Refusal):
    """A request's (or the model's) MiniCPM-V processor kwargs or item are refused (a ``ValueError``: HTTP 400).

    Attributes: ``kwarg`` (the key, e.g. ``"mm_processor_kwargs.slice_mode"``, or ``"image[0]"`` for an item),
    ``value`` (what was given), ``cause`` (``not_an_object``, ``wrong_type``, ``fixed_key``, ``unsupported``,
    ``out_of_range``, ``too_large``, ``model_level``: the ``/metrics`` label)."""

    def __init__(self, message: str, *, kwarg: str, value: Any = None, cause: str = "out_of_range") -> None:
        super().__init__(message, cause=cause)
        self.kwarg, self.value = kwarg, value


# --------------------------------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------------------------------


def _declared(cls: Any) -> set[str]:
    out: set[str] = set()
    for base in getattr(cls, "__mro__", ()):
        out |= set(getattr(base, "__annotations__", {}) or {})
    return out


@functools.lru_cache(maxsize=8)
def _declared_by(ip_cls: type | None) -> frozenset[str]:
    """Keys the installed image processor class (and transformers' 4.6 video processor) declare as kwargs."""
    keys: set[str] = set()
    keys |= _declared(getattr(ip_cls, "valid_kwargs", None))
    try:
        from transformers.models.minicpmv4_6 import video_processing_minicpmv4_6 as vpm

        keys |= _declared(getattr(vpm.MiniCPMV4_6VideoProcessor, "valid_kwargs", None))
    except Exception:  # noqa: BLE001 - a transformers without it: the constant lists decide
        pass
    return frozenset(keys)


def fixed_keys(image_processor: Any = None) -> frozenset[str]:
    """The kwargs a request may not set: :data:`FIXED` plus every other key the installed processors declare, minus
    :data:`SIZING` and :data:`VIDEO_SAMPLING`."""
    declared = _declared_by(type(image_processor) if image_processor is not None else None)
    return frozenset((FIXED | declared) - set(SIZING) - VIDEO_SAMPLING)


def _is(value: Any, t: type) -> bool:
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def rules(geometry: Mapping[str, Any]) -> dict[str, str]:
    """Key -> what is allowed, in words, for the sizing keys given ``geometry`` (:func:`geometry_of`; a bound that
    is None is not stated)."""
    slices = (f"an integer from 1 to {geometry['max_slices']} (the most slices per image the engine was profiled "
              "for)" if geometry.get("max_slices") else "an integer of at least 1")
    low = geometry.get("min_scale") or TOKEN_WINDOW * int(geometry.get("patch") or 14)
    patch = int(geometry.get("patch") or 14)
    if geometry.get("max_scale"):
        scale = (f"an integer from {low} (one vision token: {TOKEN_WINDOW} x {TOKEN_WINDOW} patches of {patch} "
                 f"pixels) to {geometry['max_scale']} (one slice of that side alone gives the "
                 f"{geometry['image_tokens']} vision tokens one item may have: {geometry.get('why')})")
    else:
        scale = f"an integer of at least {low} (one vision token: {TOKEN_WINDOW} x {TOKEN_WINDOW} patches of {patch} pixels)"
    return {
        "max_slice_nums": slices,
        "scale_resolution": scale,
        "slice_mode": "a boolean (true or false)",
        "use_image_id": "a boolean (true or false)",
        "downsample_mode": f"one of {list(DOWNSAMPLE_MODES)}",
        "small_image_upsize": f"one of {list(geometry.get('upsize_modes') or UPSIZE_MODES)}",
    }


def settable(geometry: Mapping[str, Any]) -> list[str]:
    """The sizing keys a request may set on a processor of ``geometry`` (:data:`OPTIONAL_SIZING` where declared)."""
    return sorted(k for k in SIZING if k not in OPTIONAL_SIZING or k in (geometry.get("optional") or ()))


def check_kwargs(kwargs: Mapping[str, Any] | None, geometry: Mapping[str, Any], model: str, *,
                 where: str = "mm_processor_kwargs", model_level: bool = False) -> None:
    """Raise :class:`RequestKwargsError` for the first key of ``kwargs`` that is refused.

    Args:
        kwargs: the request's (or the model-level) ``mm_processor_kwargs``; keys not declared by the processor are
            left alone (vLLM's and transformers' to judge).
        geometry: :func:`geometry_of` the processor (bounds; ``None`` bounds are not checked; with ``types_only``
            only the types and the fixed keys are).
        model: the family member named in the message.
        where: the name shown for the mapping (``"mm_processor_kwargs"``, ``"--mm-processor-kwargs"``).
        model_level: ranges are the model's own (no upper bounds from the profile, which follows them).
    """
    if not kwargs:
        return
    if not isinstance(kwargs, Mapping):
        raise RequestKwargsError(f"{model}: {where} must be an object, got {type(kwargs).__name__} {kwargs!r}",
                                 kwarg=where, value=kwargs, cause="not_an_object")
    fixed = geometry.get("fixed") or fixed_keys()  # what is allowed, in words: rules(), on a refusal only
    for key, value in kwargs.items():
        name = f"{where}.{key}"
        if key in SCOPES:
            if not isinstance(value, Mapping):
                raise RequestKwargsError(
                    f"{model}: {name} = {value!r} is refused: it must be an object of "
                    f"{SCOPES[key]} processor kwargs", kwarg=name, value=value, cause="not_an_object")
            check_kwargs(value, geometry, model, where=name, model_level=model_level)
            continue
        if key in fixed:
            raise RequestKwargsError(
                f"{model}: {name} = {value!r} is refused: {key} is fixed by the model "
                f"({'the checkpoint' if model_level else 'the server'} was built with its own value; "
                f"{'--mm-processor-kwargs' if model_level else 'a request'} may set only {settable(geometry)})",
                kwarg=name, value=value, cause="fixed_key")
        if key not in SIZING or (key in OPTIONAL_SIZING and key not in (geometry.get("optional") or ())):
            continue
        if key == "downsample_mode" and not geometry.get("has_downsample_mode", True):
            raise RequestKwargsError(f"{model}: {name} = {value!r} is refused: the installed transformers' image "
                                     "processor has no downsample_mode", kwarg=name, value=value,
                                     cause="unsupported")
        want = SIZING[key]
        if not _is(value, want):
            raise RequestKwargsError(
                f"{model}: {name} = {value!r} ({type(value).__name__}) is refused: it must be {rules(geometry)[key]}",
                kwarg=name, value=value, cause="wrong_type")
        if geometry.get("types_only"):
            continue
        bad = False
        if model_level:
            geometry = {**geometry, "max_slices": None, "max_scale": None}
        if key == "max_slice_nums":
            top = geometry.get("max_slices")
            bad = value < 1 or (top is not None and value > top)
        elif key == "scale_resolution":
            top = geometry.get("max_scale")
            bad = value < (geometry.get("min_scale") or 0) or (top is not None and value > top)
        elif key == "downsample_mode":
            bad = value not in DOWNSAMPLE_MODES
        elif key == "small_image_upsize":
            bad = value not in (geometry.get("upsize_modes") or UPSIZE_MODES)
        if bad:
            raise RequestKwargsError(f"{model}: {name} = {value!r} is refused: it must be {rules(geometry)[key]}",
                                     kwarg=name, value=value)


# --------------------------------------------------------------------------------------------------------------------
# The budget
# --------------------------------------------------------------------------------------------------------------------


def tokens_and_pixels(image_processor: Any, height: int, width: int, eff: Mapping[str, Any]) -> tuple[int, int]:
    """``(vision tokens, pixels)`` transformers' image processor produces for one image (or video frame) of
    ``height x width`` pixels processed with ``eff`` (:func:`._mm_prompt.effective_kwargs`): per target size
    ``(h, w)`` patches (source, then slices) ``h * w // divisor`` tokens (16 in "16x", 4 in "4x") and
    ``h * w * patch_size**2`` pixels (per channel), as ``MiniCPMV4_6Processor.replace_image_token`` counts and
    ``_preprocess`` resizes. Nothing is resized. Raises what transformers' sizing methods raise."""
    _, sizes = mp.slice_target_sizes(image_processor, int(height), int(width), eff)
    d = mp.divisor(eff["downsample_mode"])
    patch = int(eff["patch_size"])
    return sum(h * w // d for h, w in sizes), sum(h * w for h, w in sizes) * patch * patch


def _merged(model_kwargs: Mapping[str, Any] | None, request: Mapping[str, Any] | None, modality: str) -> dict:
    """Model-level, then request kwargs, flat keys then the modality's scope (transformers / vLLM 0.32+ give the
    scoped value precedence)."""
    scope = next(k for k, m in SCOPES.items() if m == modality)
    out: dict[str, Any] = {}
    for source in (model_kwargs or {}, request or {}):
        out.update({k: v for k, v in source.items() if k not in SCOPES})
        nested = source.get(scope)
        if isinstance(nested, Mapping):
            out.update(nested)
    return out


def effective(processor: Any, request: Mapping[str, Any] | None, modality: str) -> dict[str, Any]:
    """The sizing kwargs an item of ``modality`` is processed with: the image processor's own (the model-level kwargs
    vLLM built it with included), then the request's; a video frame without a request ``max_slice_nums`` gets
    vLLM's ``get_video_max_slice_num()`` (what ``process_videos`` hands the image processor)."""
    info = processor.info
    ip = info.ctx.get_hf_processor().image_processor
    kwargs = _merged(None, request, modality)
    explicit: dict[str, Any] = {}
    if modality == "video" and kwargs.get("max_slice_nums") is None:
        explicit["max_slice_nums"] = info.get_video_max_slice_num()
    return mp.effective_kwargs(ip, kwargs, explicit)


#: ``[encoder cache size]`` in tokens, as vLLM's ``compute_mm_encoder_budget`` last computed it in this process
#: (``MultiModalBudget``, built at start-up by the API server's ``InputProcessor`` and by the engine's scheduler);
#: empty until then.
ENCODER_CACHE_SIZE: list[int] = []


def compute_budget(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``vllm.v1.core.encoder_cache_manager.compute_mm_encoder_budget(scheduler_config, mm_max_toks_per_item)
    -> (compute budget, cache size)`` as ``vllm.multimodal.encoder_budget`` calls it (0.22-0.33): records the cache
    size in :data:`ENCODER_CACHE_SIZE`; returns vLLM's result unchanged."""
    result = wrapped(*args, **kwargs)
    try:
        size = int(result[1])
        if size > 0:
            ENCODER_CACHE_SIZE[:] = [size]
    except Exception:  # noqa: BLE001 - a result of another shape: nothing recorded
        pass
    return result


def item_limit(processor: Any) -> dict[str, Any]:
    """The most one image or video may cost: ``tokens`` = the smaller of ``max_model_len`` and vLLM's encoder cache
    size (:data:`ENCODER_CACHE_SIZE`, where vLLM computed it in this process) -- the limits vLLM itself enforces only
    after processing (``InputProcessor._validate_model_input``: "exceeds the pre-allocated encoder cache size",
    "longer than the maximum model length"); ``pixels`` = ``tokens * 16 * patch_size**2`` per channel (what that many
    tokens take at the 16x merge, the most pixels per token); ``why`` names the bound."""
    ctx = processor.info.ctx
    max_model_len = int(ctx.model_config.max_model_len)
    ip = ctx.get_hf_processor().image_processor
    patch = int(getattr(ip, "patch_size", 14) or 14)
    tokens, why = max_model_len, f"max_model_len {max_model_len}"
    if ENCODER_CACHE_SIZE and ENCODER_CACHE_SIZE[0] < tokens:
        tokens, why = ENCODER_CACHE_SIZE[0], f"the encoder cache of {ENCODER_CACHE_SIZE[0]} tokens"
    return {"tokens": tokens, "pixels": tokens * 16 * patch * patch, "why": why}


def geometry_of(processor: Any) -> dict[str, Any]:
    """Bounds for :func:`check_kwargs`: ``patch``, ``min_scale`` (``4 * patch_size``), ``max_scale``
    (``4 * patch_size * isqrt(item tokens)``: one unsliced slice of that side alone fills :func:`item_limit`),
    ``max_slices`` (the most of the model's image and video ``max_slice_nums``: what vLLM's start-up profiling and
    its per-item token counts are computed for), ``image_tokens``, ``why``, ``fixed``, ``has_downsample_mode``, and
    ``limit`` (:func:`item_limit`). Computed once per processor and encoder cache size (every input is fixed for a
    processor's life: its model config and transformers' processor), then kept on the processor."""
    cached = processor.__dict__.get(_GEOMETRY_ATTR)
    if cached is not None and cached[0] == tuple(ENCODER_CACHE_SIZE):
        return cached[1]
    geo = _geometry(processor)
    processor.__dict__[_GEOMETRY_ATTR] = (tuple(ENCODER_CACHE_SIZE), geo)
    return geo


#: The processor attribute holding ``(encoder cache size, geometry_of(processor))``.
_GEOMETRY_ATTR = "_vllm_minicpm_hotfix_geometry"


def _geometry(processor: Any) -> dict[str, Any]:
    ip = processor.info.ctx.get_hf_processor().image_processor
    patch = int(getattr(ip, "patch_size", 14) or 14)
    limit = item_limit(processor)
    declared = _declared_by(type(ip))
    geo: dict[str, Any] = {
        "patch": patch, "min_scale": TOKEN_WINDOW * patch, "image_tokens": limit["tokens"], "why": limit["why"],
        "max_scale": TOKEN_WINDOW * patch * max(math.isqrt(limit["tokens"]), 1), "fixed": fixed_keys(ip),
        "has_downsample_mode": not declared or "downsample_mode" in declared, "limit": limit,
        "optional": frozenset(OPTIONAL_SIZING & declared), "upsize_modes": upsize_modes(),
    }
    # The checkpoint's and transformers' own value besides the model-level one (4.7's processing info reports the
    # latter): a request may ask up to what the model itself takes; the per-item budget bounds the cost.
    slices = [int(getattr(ip, "max_slice_nums", 0) or 0), int(getattr(type(ip), "max_slice_nums", 0) or 0)]
    for name in ("get_image_max_slice_num", "get_video_max_slice_num"):
        try:
            slices.append(int(getattr(processor.info, name)()))
        except Exception:  # noqa: BLE001
            pass
    geo["max_slices"] = max(slices) if max(slices) > 0 else None
    return geo


def upsize_modes() -> tuple[str, ...]:
    """:data:`UPSIZE_MODES` without ``"adaptive"`` where transformers has no OpenCV (its ``"adaptive"`` needs it)."""
    try:
        from transformers.utils import is_cv2_available

        return UPSIZE_MODES if is_cv2_available() else tuple(m for m in UPSIZE_MODES if m != "adaptive")
    except Exception:  # noqa: BLE001 - a transformers without the check: its own error decides
        return UPSIZE_MODES


def _cost(ip: Any, hw_list: list[tuple[int, int]], eff: Mapping[str, Any]) -> tuple[int, int]:
    tokens = pixels = 0
    for h, w in hw_list:
        dt, dp = tokens_and_pixels(ip, h, w, eff)
        tokens, pixels = tokens + dt, pixels + dp
    return tokens, pixels


def _fit_hint(ip: Any, hw_list: list[tuple[int, int]], eff: Mapping[str, Any], limit: Mapping[str, Any]) -> str:
    """What would fit: the largest ``max_slice_nums`` below the item's whose cost is within ``limit``, if any."""
    for n in range(int(eff["max_slice_nums"]) - 1, 0, -1):
        t, p = _cost(ip, hw_list, {**eff, "max_slice_nums": n})
        if t <= limit["tokens"] and p <= limit["pixels"]:
            return f"With max_slice_nums {n} it would fit ({t} tokens)."
    return "Send a smaller item, or fewer slices / a smaller scale_resolution."


def check_items(processor: Any, items: Any, request: Mapping[str, Any] | None, model: str) -> None:
    """Raise :class:`RequestKwargsError` for the first image or video of ``items`` (vLLM's ``MultiModalDataItems``)
    whose cost (:func:`tokens_and_pixels` from its size and the effective kwargs: nothing decoded or resized)
    exceeds :func:`item_limit`, or if the items together exceed ``max_model_len`` vision tokens. Items given as
    embeddings are not judged."""
    limit = geometry_of(processor)["limit"]
    ip = processor.info.ctx.get_hf_processor().image_processor
    max_model_len = int(processor.info.ctx.model_config.max_model_len)
    req = mp.request((items, {}, None))  # the items, as the prompt fixes read a request's
    total = 0
    for modality in ("image", "video"):
        eff = None
        for idx in range(_count(items, modality)):
            if modality == "image":
                hw = mp.image_item_hw(req, idx)
                hw_list = [hw] if hw is not None else None
            else:
                hw_list = mp.video_frames_hw(req, idx)
            if not hw_list:
                continue
            if eff is None:
                eff = effective(processor, request, modality)
            tokens, pixels = _cost(ip, hw_list, eff)
            total += tokens
            if tokens <= limit["tokens"] and pixels <= limit["pixels"]:
                continue
            size = (f"{hw_list[0][1]}x{hw_list[0][0]}" if modality == "image"
                    else f"{len(hw_list)} frames of {hw_list[0][1]}x{hw_list[0][0]}")
            shown = {k: eff[k] for k in ("scale_resolution", "max_slice_nums", "slice_mode", "downsample_mode")}
            raise RequestKwargsError(
                f"{model}: {modality} item {idx} of this request ({size} pixels, processed with {shown}) would "
                f"produce {tokens} vision tokens from {pixels} pixels per channel, more than one item may: at most "
                f"{limit['tokens']} tokens ({limit['why']}) and {limit['pixels']} pixels; it is refused before any "
                f"resizing. {_fit_hint(ip, hw_list, eff, limit)}", kwarg=f"{modality}[{idx}]", value=tokens,
                cause="too_large")
    if total > max_model_len:
        raise RequestKwargsError(
            f"{model}: the images and videos of this request would produce {total} vision tokens, more than "
            f"max_model_len {max_model_len}; send fewer or smaller items (or a smaller max_slice_nums)",
            kwarg="mm_processor_kwargs", value=total, cause="too_large")


def _count(items: Any, modality: str) -> int:
    try:
        batch = items.get(modality) if items is not None else None
        if batch is None:
            return 0
        return int(batch.get_count()) if hasattr(batch, "get_count") else len(batch)
    except Exception:  # noqa: BLE001
        return 0


# --------------------------------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------------------------------


def model_level_kwargs(model_config: Any) -> Mapping[str, Any] | None:
    """The model-level ``--mm-processor-kwargs``: ``model_config.multimodal_config.mm_processor_kwargs`` (vLLM keeps
    them there; ``ModelConfig.mm_processor_kwargs`` is only an init argument on some releases)."""
    mm_config = getattr(model_config, "multimodal_config", None)
    kwargs = getattr(mm_config, "mm_processor_kwargs", None)
    if kwargs is None:
        kwargs = getattr(model_config, "mm_processor_kwargs", None)
    return kwargs


def check_model_level(processor: Any, model: str) -> None:
    """Check the model-level ``--mm-processor-kwargs`` once per processor: every key, and one
    :class:`RequestKwargsError` naming each refused key (kwarg, value, what is allowed) and ``model``; its ``kwarg``
    and ``value`` are the first refused key's."""
    if processor.__dict__.get(_MODEL_CHECKED_ATTR):
        return
    kwargs = model_level_kwargs(getattr(getattr(processor.info, "ctx", None), "model_config", None))
    if kwargs:
        geometry = {"min_scale": TOKEN_WINDOW * 14, "fixed": fixed_keys(), "patch": 14}
        where = "--mm-processor-kwargs"
        if not isinstance(kwargs, Mapping):
            check_kwargs(kwargs, geometry, model, where=where, model_level=True)
        refused: list[RequestKwargsError] = []
        for key, value in kwargs.items():
            try:
                check_kwargs({key: value}, geometry, model, where=where, model_level=True)
            except RequestKwargsError as exc:
                exc.cause = "model_level"  # the server's own configuration, refused at start-up
                refused.append(exc)
        if len(refused) == 1:
            raise refused[0]
        if refused:
            each = "; ".join(str(exc).removeprefix(f"{model}: ") for exc in refused)
            raise RequestKwargsError(f"{model}: {len(refused)} of {where} are refused: {each}",
                                     kwarg=refused[0].kwarg, value=refused[0].value, cause="model_level")
    processor.__dict__[_MODEL_CHECKED_ATTR] = True


def checked_apply(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``BaseMultiModalProcessor.apply(self, inputs: ProcessorInputs, timing_ctx) -> MultiModalInput``: all
    the checks of the module docstring for the call's ``inputs``, then vLLM's own method unchanged. Raises
    :class:`RequestKwargsError` (``ValueError``)."""
    inputs = call.get("inputs")
    if inputs is None:
        return wrapped(*call.args, **call.kwargs)
    if not instance.__dict__.get(_MODEL_CHECKED_ATTR):  # once per processor
        check_model_level(instance, model_of(instance) or "MiniCPM-V")
    given = getattr(inputs, "hf_processor_mm_kwargs", None)
    if given:
        request = dict(given)
        model = model_of(instance) or "MiniCPM-V"  # the name its refusals give; only where there is a request to judge
        # The type and fixed-key checks need no bounds: run them before reading the profile.
        check_kwargs(request, {"types_only": True, "fixed": fixed_keys()}, model)
        check_kwargs(request, geometry_of(instance), model)
        # Without request kwargs every item costs what stock vLLM makes of it (its own limits judge it).
        check_items(instance, getattr(inputs, "mm_data_items", None), request, model)
    return wrapped(*call.args, **call.kwargs)


def init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """Around ``BaseMultiModalProcessor.__init__(self, info, dummy_inputs, *, cache=None)`` (vLLM's
    ``vllm/multimodal/processing``, inherited by ``MiniCPMV4_6MultiModalProcessor``; built by
    ``MULTIMODAL_REGISTRY.create_processor`` in every process that processes or profiles requests): vLLM's own
    ``__init__`` first, then :func:`check_model_level`. Raises :class:`RequestKwargsError` (``ValueError``) for bad
    model-level ``--mm-processor-kwargs``."""
    wrapped(*args, **kwargs)
    check_model_level(instance, model_of(instance) or "MiniCPM-V")


#: vLLM's function that builds the API server's FastAPI app (0.22-0.31; 0.32+ import it there from
#: ``vllm.entrypoints.launchers.app`` and route ``ValueError`` themselves).
APP_TARGET = "vllm.entrypoints.openai.api_server:build_app"


def routed(app: Any) -> bool:
    """Route :class:`~._base.Refusal` in vLLM's ``app`` (a FastAPI app) to the handler it has for ``Exception``, if
    nothing but that catch-all would answer a refusal there (see the module docstring); True if a handler was added.
    Decided from the app's own handlers, as Starlette dispatches them: a handler keyed ``Exception`` (or 500) runs
    in ``ServerErrorMiddleware``, any other in ``ExceptionMiddleware``, looked up along the exception's MRO. Never
    raises; leaves an app it does not recognise as it is."""
    try:
        handlers = getattr(app, "exception_handlers", None)
        if not isinstance(handlers, dict) or not callable(getattr(app, "add_exception_handler", None)):
            return False
        catch_all = handlers.get(Exception, handlers.get(500))
        if catch_all is None or any(cls in handlers for cls in Refusal.__mro__ if cls is not Exception):
            return False  # the release answers it itself (0.26+: ValueError), or has no error response for it
        app.add_exception_handler(Refusal, catch_all)
        if getattr(app, "middleware_stack", None) is not None:
            # Built already (0.22-0.24's build_app ends with the SageMaker bootstrap, which rebuilds it): Starlette
            # copies the handlers into its middleware when it builds it, so build it again, as that bootstrap does.
            app.middleware_stack = app.build_middleware_stack()
        return True
    except Exception:  # noqa: BLE001 - routing must never stop the server from starting
        return False


def route_refusals(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around vLLM's ``build_app(args, ...)`` -> FastAPI app: vLLM's app, with :func:`routed` applied."""
    app = wrapped(*args, **kwargs)
    routed(app)
    return app


#: The processor's ``apply`` and ``__init__``, and the recorder on vLLM's ``compute_mm_encoder_budget`` (every
#: model's; it only records): set with the others if vLLM has imported :data:`BUDGET_MODULE` (the model module does
#: not need it), else when vLLM imports it, not by importing it now -- vLLM reads the function as a module global at
#: call time, and builds its first ``MultiModalBudget`` only after that import. And :func:`route_refusals` on vLLM's
#: ``build_app`` (every app's), set the same way: the API server applies this fix (its processor-path probe runs when
#: vLLM builds its processing info, while it creates the engine client) before it builds its app.
PATCHES = {
    f"{PROCESSOR_CLASS}.apply": wrap(checked_apply, bind=True),
    f"{PROCESSOR_CLASS}.__init__": wrap(init),
    BUDGET_TARGET: on_import(lambda old, _: wrap(compute_budget, model=EVERY_CALL) if callable(old) else None,
                             without="the item limit is max_model_len alone"),
    APP_TARGET: on_import(lambda old, _: wrap(route_refusals, model=EVERY_CALL) if callable(old) else None,
                          without="a refusal is answered as vLLM's app answers a ValueError"),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------------------------


class _Reached(Exception):
    """The stand-in's pixel work was reached."""


def probe(module: ModuleType) -> Verdict:
    """Does the 4.6 processor, as its classes now stand, refuse ``{"slice_mode": "false"}`` before any pixel work?
    Never raises; leaves ``module`` unchanged."""
    cls = getattr(module, PROCESSOR_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "apply", None)):
        return Verdict(State.UNRECOGNISED, f"{module.__name__} has no {PROCESSOR_CLASS}.apply", applicable=False)
    try:
        proc = object.__new__(cls)
        info = types.SimpleNamespace(ctx=types.SimpleNamespace(model_config=types.SimpleNamespace(
            mm_processor_kwargs=None, max_model_len=4096)))
        proc.__dict__.update(info=info, cache=None)

        def pixel_work(*args: Any, **kwargs: Any) -> Any:
            raise _Reached

        proc.__dict__["_cached_apply_hf_processor"] = pixel_work
        inputs = types.SimpleNamespace(prompt=[1], mm_data_items={}, mm_uuid_items=None,
                                       hf_processor_mm_kwargs={"slice_mode": "false"}, tokenization_kwargs={})
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    try:
        cls.apply(proc, inputs, types.SimpleNamespace(record=lambda *a, **k: _NullCtx()))
    except _Reached:
        return Verdict(State.BROKEN, "vLLM's processor takes mm_processor_kwargs {'slice_mode': 'false'} on to the "
                                     "pixel work (transformers then fails: HTTP 500)")
    except ValueError as exc:
        return Verdict(State.CORRECT, f"{{'slice_mode': 'false'}} is refused before any pixel work: {exc}")
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"probe failed in {PROCESSOR_CLASS}.apply: {type(exc).__name__}: {exc}")
    return Verdict(State.UNDETERMINED, "the stand-in's apply returned without processing")


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
