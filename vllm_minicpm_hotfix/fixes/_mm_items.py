"""The items of one MiniCPM-V request as transformers reads them: an image's or a video frame's size in pixels, and
the crops transformers' image processor returned for an image (vLLM's ``tgt_sizes``). Part of :mod:`._mm_prompt`,
which the prompt fixes read them through. Imports vLLM and transformers only when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


# --------------------------------------------------------------------------------------------------------------------
# Items: the size transformers reads from an image or a video frame.
# --------------------------------------------------------------------------------------------------------------------


def item_hw(item: Any) -> tuple[int, int] | None:
    """``(height, width)`` in pixels of one image or video frame as transformers' image processor reads it (a PIL
    image, or an HWC / CHW array or tensor: ``transformers.image_utils.infer_channel_dimension_format``); None for
    anything else (an embedding, a missing item)."""
    if item is None:
        return None
    size = getattr(item, "size", None)
    if hasattr(item, "getbands") and isinstance(size, tuple) and len(size) == 2:  # PIL.Image.Image
        return int(size[1]), int(size[0])
    shape = getattr(item, "shape", None)
    if shape is None or len(shape) != 3:
        return None
    from transformers.image_utils import get_image_size, infer_channel_dimension_format

    try:
        return tuple(int(x) for x in get_image_size(item, channel_dim=infer_channel_dimension_format(item)))
    except Exception:  # not an image transformers can read; the caller falls back to vLLM's size
        return None


def plain(mapping: Any) -> Any:
    """The dict inside one of vLLM's ``UserDict`` mappings (``MultiModalDataItems``, ``MultiModalKwargsItems``,
    ``MultiModalKwargsItem``; none overrides a lookup), else ``mapping`` itself: read on the request path, where each
    ``get`` / ``items()`` of a ``UserDict`` costs Python frames and the dict's cost one C call."""
    data = getattr(mapping, "data", None)
    return data if type(data) is dict else mapping


def _items_of(items: Any, modality: str) -> Any:
    """The request's raw items of ``modality`` (vLLM's ``ImageProcessorItems`` / ``VideoProcessorItems``); None for
    embeddings passed instead of pixels (their sizes are vLLM's to read) or when there are none."""
    try:
        batch = plain(items).get(modality) if items is not None else None
        kinds = _RAW_KINDS or _raw_kinds()
    except Exception:
        return None
    return batch if isinstance(batch, kinds) else None


#: vLLM's ``(ImageProcessorItems, VideoProcessorItems)``, once imported (an import statement per item costs more
#: than the rest of :func:`_items_of`).
_RAW_KINDS: tuple[type, ...] = ()


def _raw_kinds() -> tuple[type, ...]:
    global _RAW_KINDS
    from vllm.multimodal.parse import ImageProcessorItems, VideoProcessorItems

    _RAW_KINDS = (ImageProcessorItems, VideoProcessorItems)
    return _RAW_KINDS


def image_item_hw(request: Any, idx: int) -> tuple[int, int] | None:
    """``(height, width)`` of image ``idx`` of the request's items, or None if it has no such raw image."""
    batch = _items_of(request.items if request else None, "image")
    if batch is None:
        return None
    try:
        return item_hw(batch.get(idx))
    except Exception:
        return None


def video_frames_hw(request: Any, idx: int) -> list[tuple[int, int]] | None:
    """Per frame ``(height, width)`` of video ``idx`` of the request's items (None if it has no such raw video)."""
    batch = _items_of(request.items if request else None, "video")
    if batch is None:
        return None
    try:
        video = batch.get(idx)
    except Exception:
        return None
    if isinstance(video, tuple) and len(video) == 2 and isinstance(video[1], Mapping):  # (frames, metadata)
        video = video[0]
    if video is None:
        return None
    try:
        sizes = [item_hw(frame) for frame in video]
    except TypeError:
        return None
    if not sizes or any(s is None for s in sizes):
        return None
    return sizes  # type: ignore[return-value]


def image_item_crops(request: Any, idx: int) -> list[tuple[int, int]] | None:
    """``(height, width)`` in patches of every crop of image ``idx`` as transformers' image processor returned them
    for this request (the item's ``tgt_sizes`` in vLLM's processed items: the source first, then the slices), or
    None where the request carries none (image embeddings, no processed items passed)."""
    try:
        item = request.out["image"][idx]  # type: ignore[union-attr]
        tensor = item.get("tgt_sizes").data
        return [(int(h), int(w)) for h, w in tensor.reshape(-1, 2).tolist()]
    except Exception:  # noqa: BLE001 - nothing processed to read: the caller sizes the item itself
        return None
