"""The request state and transformers' own placeholder text for a MiniCPM-V 4.6 image or video, which the prompt
fixes read (no wrappers: those are the fixes'). Nothing here imports vLLM, torch or transformers at import time.

The reference
-------------
transformers' ``MiniCPMV4_6Processor`` (``transformers/models/minicpmv4_6/processing_minicpmv4_6.py``) builds an
image's text in ``_process_images``: its image processor resizes the image and returns ``grids`` (``[rows, cols]``
per image, ``[0, 0]`` when unsliced), ``num_patches_per_image`` and ``target_sizes`` (``(height, width)`` in patches,
source first, then the slices row by row); ``replace_image_token`` turns them into
``<image>PAD*n</image><slice>PAD*m</slice>...\\n...`` (rows separated by ``\\n``); ``__call__`` prepends
``<image_id>i</image_id>`` when ``use_image_id``. Videos: ``_process_videos`` / ``replace_video_token`` the same per
frame, with ``<|video_pad|>``. The token divisor is 4 in ``"4x"`` mode, else 16. :func:`slice_target_sizes`
computes what the image processor would return for one image of ``(height, width)`` pixels without resizing
anything: it calls the installed image processor's own ``get_sliced_grid``, ``find_best_resize`` and
``get_refine_size`` (with ``downsample_mode`` where the installed signature takes it) in the order
``MiniCPMV4_6ImageProcessor._preprocess`` does (transformers 5.7-5.24). :func:`image_text` / :func:`video_text` then
hand those to the installed processor's own ``replace_image_token`` / ``replace_video_token`` (transformers >= 5.17);
for a processor without them the rows are laid out from ``grid[0]`` = rows, ``grid[1]`` = cols, as transformers does.

The request
-----------
vLLM hands a request's ``mm_processor_kwargs`` (``hf_processor_mm_kwargs``) and its items to
``_get_mm_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs)`` (every release 0.22-0.33), which gets
``MiniCPMV4_6MultiModalProcessor._get_prompt_updates`` and resolves their replacement callables per item at once;
``mm_placeholders`` runs it with the request in :data:`REQUEST` (a :class:`contextvars.ContextVar`, so concurrent
requests in threads or tasks never see each other's), and the text producers read it with :func:`current`.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from ._base import WeakMemo
from ._mm_items import image_item_crops, image_item_hw, item_hw, video_frames_hw  # noqa: F401 - read as this module's

#: The processor kwargs that decide an item's placeholder (transformers' ``MiniCPMV4_6ImageProcessorKwargs``) and
#: transformers' class defaults for them.
SIZING_DEFAULTS: dict[str, Any] = {
    "max_slice_nums": 9,
    "scale_resolution": 448,
    "patch_size": 14,
    "slice_mode": True,
    "downsample_mode": "16x",
    "use_image_id": True,
}

#: Special tokens and their names on transformers' processor / tokenizer (and vLLM's fallbacks).
TOKENS: dict[str, str] = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}


class Request(NamedTuple):
    """What vLLM passed to ``_get_mm_prompt_updates`` for one call (one request, or the cache misses of one)."""

    items: Any  #: vLLM's ``MultiModalDataItems`` (modality -> ``ProcessorBatchItems``)
    kwargs: Mapping[str, object]  #: the request's ``mm_processor_kwargs`` as vLLM passed them
    out: Any = None  #: vLLM's processed items (``out_mm_kwargs``: modality -> per-item fields), where passed


REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar("vllm_minicpm_hotfix_mm_request", default=None)

#: ``request((items, kwargs, out))`` is ``Request(items, kwargs, out)`` without the Python frame of a NamedTuple's
#: ``__new__`` (``tuple.__new__``, as that ``__new__`` itself calls it): made once per call on the request path.
request = functools.partial(tuple.__new__, Request)


#: The request's ``mm_processor_kwargs`` while vLLM turns its items into tensors (``process_mm_inputs``).
PROCESSING: contextvars.ContextVar[Mapping[str, object] | None] = contextvars.ContextVar(
    "vllm_minicpm_hotfix_mm_processing", default=None
)


def current() -> Request | None:
    """The request whose prompt updates are being resolved in this context, or None (profiling, direct calls)."""
    return REQUEST.get()


def request_max_slice_nums() -> int | None:
    """The current request's own ``max_slice_nums`` (while its tensors or its prompt updates are made), else None."""
    kwargs = PROCESSING.get()
    if kwargs is None:
        request = REQUEST.get()
        kwargs = request.kwargs if request is not None else None
    value = (kwargs or {}).get("max_slice_nums")
    return int(value) if value is not None else None


# --------------------------------------------------------------------------------------------------------------------
# Sizing: what transformers' image processor returns for one image, computed by its own methods.
# --------------------------------------------------------------------------------------------------------------------


def effective_kwargs(
    image_processor: Any, request_kwargs: Mapping[str, object] | None, explicit: Mapping[str, object]
) -> dict[str, Any]:
    """The kwargs an item is processed with: the image processor's own values (its config plus the model-level
    ``mm_processor_kwargs`` vLLM built it with), then the request's flat ``mm_processor_kwargs``, then the values vLLM
    resolved and passed explicitly (``downsample_mode``, 0.32+ ``max_slice_nums``); None means "not given"."""
    eff = {k: getattr(image_processor, k, d) for k, d in SIZING_DEFAULTS.items()}
    for source in (request_kwargs, explicit):
        if not source:
            continue
        for key, value in source.items():  # the few keys given, not every sizing key asked of each source
            if value is not None and key in SIZING_DEFAULTS:
                eff[key] = value
    eff["max_slice_nums"] = int(eff["max_slice_nums"])
    eff["scale_resolution"] = int(eff["scale_resolution"])
    eff["patch_size"] = int(eff["patch_size"])
    return eff


@functools.lru_cache(maxsize=64)
def _params(cls: type, name: str) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(getattr(cls, name)).parameters)
    except (AttributeError, TypeError, ValueError):
        return frozenset()


def _mode_kw(image_processor: Any, name: str, mode: str) -> dict[str, str]:
    return {"downsample_mode": mode} if "downsample_mode" in _params(type(image_processor), name) else {}


def slice_target_sizes(
    image_processor: Any, height: int, width: int, eff: Mapping[str, Any]
) -> tuple[list[int], list[list[int]]]:
    """``(grid, target_sizes)`` transformers' ``MiniCPMV4_6ImageProcessor._preprocess`` returns for one image of
    ``height`` x ``width`` pixels: ``grid`` = ``[rows, cols]`` (``[0, 0]`` unsliced), ``target_sizes`` = ``[[h, w]]``
    in patches for the source, then one per slice (row-major). Calls the processor's own ``get_sliced_grid`` /
    ``find_best_resize`` / ``get_refine_size``; raises what they raise."""
    ip = image_processor
    size = (height, width)
    patch, scale, mode = eff["patch_size"], eff["scale_resolution"], eff["downsample_mode"]
    grid = None
    if eff["slice_mode"]:
        if "scale_resolution" in _params(type(ip), "get_sliced_grid"):
            grid = ip.get_sliced_grid(size, eff["max_slice_nums"], scale)
        else:
            grid = ip.get_sliced_grid(size, eff["max_slice_nums"])
    src_h, src_w = ip.find_best_resize(
        size, scale, patch, allow_upscale=grid is None, **_mode_kw(ip, "find_best_resize", mode)
    )
    sizes = [[int(src_h) // patch, int(src_w) // patch]]
    if grid is None:
        return [0, 0], sizes
    rows, cols = int(grid[0]), int(grid[1])
    ref_h, ref_w = ip.get_refine_size(
        size, [rows, cols], scale, patch, allow_upscale=True, **_mode_kw(ip, "get_refine_size", mode)
    )
    slice_hw = [int(ref_h) // rows // patch, int(ref_w) // cols // patch]
    return [rows, cols], sizes + [list(slice_hw) for _ in range(rows * cols)]


def divisor(mode: Any) -> int:
    """Tokens per ``h * w`` patches: transformers' ``image_token_divisor`` (4 in ``"4x"`` mode, else 16)."""
    return 4 if mode == "4x" else 16


def token(hf_processor: Any, name: str) -> str:
    """A special token's text: transformers' processor attribute, else its tokenizer's, else the default."""
    value = getattr(hf_processor, name, None)
    if not isinstance(value, str):
        value = getattr(getattr(hf_processor, "tokenizer", None), name, None)
    return value if isinstance(value, str) else TOKENS[name]


def id_prefix(hf_processor: Any, idx: int) -> str:
    return f"{token(hf_processor, 'image_id_start_token')}{idx}{token(hf_processor, 'image_id_end_token')}"


def local_id(hf_processor: Any, idx: int, name: str) -> str:
    """The local id transformers' processor puts in front of item ``idx`` of a prompt where ``use_image_id`` holds,
    ``name`` = ``"image_token"`` / ``"video_token"``: what its own ``_prepend_local_ids`` prepends
    (``<image_id>idx</image_id>`` for 4.6's images and videos and 4.7's images, nothing for 4.7's videos); for a
    processor without it, :func:`id_prefix`."""
    prepend = getattr(type(hf_processor), "_prepend_local_ids", None)
    if not callable(prepend):
        return id_prefix(hf_processor, idx)
    pad = token(hf_processor, name)
    return prepend(hf_processor, [pad * (idx + 1)], [""] * (idx + 1), pad)[idx]


def _rows_text(hf: Any, pad: str, source: int, grid: Sequence[int], per_slice: Sequence[int], sliced: bool) -> str:
    """transformers' layout for a processor without ``replace_image_token``: source, then ``rows`` lines of ``cols``
    slices separated by ``\\n``."""
    text = token(hf, "image_start_token") + pad * source + token(hf, "image_end_token")
    rows, cols = grid
    if sliced and rows > 0 and cols > 0:
        s0, s1 = token(hf, "slice_start_token"), token(hf, "slice_end_token")
        lines = ["".join(s0 + pad * n + s1 for n in per_slice[r * cols : (r + 1) * cols]) for r in range(rows)]
        text += "\n".join(lines)
    return text


#: Texts :func:`image_text` / :func:`video_text` built, per (function, transformers' processor, its image processor,
#: the sizes, the effective kwargs, the index): a pure function of these (the processors' own sizing methods and
#: tokens, which vLLM builds once per model and never changes), and a server sees the same few sizes over and over.
_TEXTS = WeakMemo()


def _memo_text(build: Callable[..., str]) -> Callable[..., str]:
    @functools.wraps(build)
    def text(hf_processor: Any, image_processor: Any, sizes: Any, eff: Mapping[str, Any], idx: int) -> str:
        objects = (hf_processor, image_processor)
        try:
            key = (build, id(hf_processor), id(image_processor), tuple(sizes), tuple(eff.items()), idx)
            hit = _TEXTS.get(key, objects)
        except TypeError:  # an unhashable value: built every time
            return build(hf_processor, image_processor, sizes, eff, idx)
        if hit is None:
            hit = build(hf_processor, image_processor, sizes, eff, idx)
            _TEXTS.put(key, objects, hit)
        return hit

    return text


def _image_text(hf_processor: Any, grid: Sequence[int], sizes: Sequence[Sequence[int]], eff: Mapping[str, Any],
                idx: int) -> str:
    """transformers' text for one image of crops ``sizes`` (patches, source first) in ``grid``: its processor's own
    ``replace_image_token`` (else its layout, :func:`_rows_text`), the local id in front when ``eff["use_image_id"]``."""
    import numpy as np

    d = divisor(eff["downsample_mode"])
    replace = getattr(type(hf_processor), "replace_image_token", None)
    if callable(replace):
        inputs = {"grids": [list(grid)], "num_patches_per_image": [len(sizes)], "target_sizes": np.asarray(sizes)}
        from ._proxies import SlicedAsProcessor

        view = SlicedAsProcessor(hf_processor, eff["slice_mode"])
        text = replace(view, inputs, image_idx=0, image_token_divisor=d)
    else:
        counts = [h * w // d for h, w in sizes]
        text = _rows_text(hf_processor, token(hf_processor, "image_token"), counts[0], grid, counts[1:], True)
    return (local_id(hf_processor, idx, "image_token") if eff["use_image_id"] else "") + text


@_memo_text
def image_text(hf_processor: Any, image_processor: Any, hw: tuple[int, int], eff: Mapping[str, Any], idx: int) -> str:
    """The text transformers' ``MiniCPMV4_6Processor`` puts in place of image ``idx`` of ``hw`` = ``(height, width)``
    pixels processed with ``eff`` (see :func:`effective_kwargs`), ``<image_id>`` prefix included when
    ``eff["use_image_id"]``."""
    grid, sizes = slice_target_sizes(image_processor, hw[0], hw[1], eff)
    return _image_text(hf_processor, grid, sizes, eff, idx)


@_memo_text
def image_text_of_crops(hf_processor: Any, image_processor: Any, shape: tuple, eff: Mapping[str, Any],
                        idx: int) -> str:
    """The text transformers' processor puts in place of image ``idx`` whose crops its image processor returned:
    ``shape`` = ``(height, width, crop, crop, ...)``, the image's pixels then each crop's ``(height, width)`` in
    patches, source first (what ``MiniCPMOcrProcessor.replace_image_token`` reads: a crop's size there depends on the
    pixels under ``small_image_upsize`` "never" / "adaptive"). The grid is the image processor's ``get_sliced_grid``
    of the image's size, as its ``_preprocess`` computes it. Raises ``ValueError`` if the crops do not fill it."""
    (height, width), crops = shape[:2], [list(c) for c in shape[2:]]
    grid = [0, 0]
    if eff["slice_mode"] and len(crops) > 1:
        found = image_processor.get_sliced_grid((height, width), eff["max_slice_nums"], eff["scale_resolution"])
        grid = [int(found[0]), int(found[1])] if found is not None else [0, 0]
    if eff["slice_mode"] and grid[0] * grid[1] != len(crops) - 1:
        raise ValueError(f"{len(crops) - 1} slices for a {grid[0]}x{grid[1]} grid ({width}x{height} image)")
    return _image_text(hf_processor, grid, crops, eff, idx)


@_memo_text
def video_text(
    hf_processor: Any, image_processor: Any, frames_hw: Sequence[tuple[int, int]], eff: Mapping[str, Any], idx: int
) -> str:
    """The text transformers' ``MiniCPMV4_6Processor`` / ``MiniCPMV4_7Processor`` puts in place of video ``idx`` whose
    frames have the given ``(height, width)``, each processed with ``eff``; its local id (:func:`local_id`) included
    when ``eff["use_image_id"]``."""
    import numpy as np

    grids, sizes = [], []
    for h, w in frames_hw:
        grid, frame_sizes = slice_target_sizes(image_processor, h, w, eff)
        grids.append(grid)
        sizes.extend(frame_sizes)
    d = divisor(eff["downsample_mode"])
    replace = getattr(type(hf_processor), "replace_video_token", None)
    if callable(replace):
        inputs = {
            "target_sizes_videos": np.asarray(sizes),
            "num_frames_per_video": [len(grids)],
            "grids_videos": np.asarray(grids),
        }
        from ._proxies import SlicedAsProcessor

        view = SlicedAsProcessor(hf_processor, eff["slice_mode"])
        text = replace(view, inputs, video_idx=0, video_token_divisor=d)
    else:
        sliced = True
        pad = token(hf_processor, "video_token")
        text, pos = "", 0
        for grid in grids:
            n = 1 + grid[0] * grid[1]
            counts = [h * w // d for h, w in sizes[pos : pos + n]]
            pos += n
            text += _rows_text(hf_processor, pad, counts[0], grid, [counts[1]] * (n - 1) if n > 1 else [], sliced)
    return (local_id(hf_processor, idx, "video_token") if eff["use_image_id"] else "") + text
