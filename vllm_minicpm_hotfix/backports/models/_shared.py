"""What the backports' model classes (MiniCPM-V 4.7, MiniCPM-OCR) add to the installed vLLM's 4.6 classes alike:
both configs drop 4.6's ``drop_vision_last_layer`` (every vision layer is kept), and neither states the
``max_slice_nums`` that vLLM's 4.6 processing info reads from the config.

Imported only by the backports' model modules (which vLLM's registry imports lazily); it imports vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from vllm.model_executor.models import minicpmv4_6 as _m46


class ProcessorMaxSliceNums:
    """Mixin for a subclass of vLLM's ``MiniCPMV4_6ProcessingInfo``: ``get_image_max_slice_num`` as transformers
    slices."""

    def get_image_max_slice_num(self) -> int:
        """The ``max_slice_nums`` images are sized with when vLLM budgets its encoder (``get_image_size_with_most_features``):
        the server's ``--mm-processor-kwargs`` value, else the checkpoint's image processor's (what transformers
        slices with), else 4.6's answer (``config.max_slice_nums`` / ``slice_config``, else 9)."""
        configured = configured_kwarg(self.ctx, "max_slice_nums")
        if configured is not None:
            return int(configured)
        try:
            value = getattr(self.get_image_processor(), "max_slice_nums", None)
        except Exception:  # noqa: BLE001 - no processor here: 4.6's answer
            value = None
        return int(value) if value is not None else super().get_image_max_slice_num()


def configured_kwarg(ctx: Any, key: str) -> Any:
    """The server-level (``--mm-processor-kwargs``) value of ``key`` in vLLM's ``InputProcessingContext``, or None."""
    try:
        merged = ctx.get_merged_mm_kwargs({})
    except Exception:  # noqa: BLE001 - a context without the merge: the model config's own kwargs
        merged = getattr(getattr(ctx, "model_config", None), "mm_processor_kwargs", None) or {}
    return merged.get(key) if isinstance(merged, Mapping) else None


class KeepsEveryVisionLayer:
    """Mixin (first base) for a subclass of vLLM's ``MiniCPMV4_6ForConditionalGeneration`` whose config has no
    ``drop_vision_last_layer``: the 4.6 constructor keeps every vision layer, asked through
    :meth:`_drop_vision_last_layer` (vLLM 0.32+) or the config (0.22-0.31: :func:`keeps_every_vision_layer`)."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        with keeps_every_vision_layer(vllm_config.model_config.hf_config):
            super().__init__(vllm_config=vllm_config, prefix=prefix)

    def _drop_vision_last_layer(self) -> bool:
        """False: every vision encoder layer is kept (transformers' 4.7 and OCR vision encoders build
        ``config.vision_config.num_hidden_layers`` layers)."""
        return False


@contextlib.contextmanager
def keeps_every_vision_layer(config: Any) -> Iterator[None]:
    """For the 4.6 constructor of a release that reads ``config.drop_vision_last_layer`` itself (0.22-0.31): a config
    without that field (4.7's, OCR's) answers False for the duration. Nothing where the 4.6 class asks
    ``_drop_vision_last_layer()`` (0.32+) or the config has the field."""
    if hasattr(_m46.MiniCPMV4_6ForConditionalGeneration, "_drop_vision_last_layer") or hasattr(
            config, "drop_vision_last_layer"):
        yield
        return
    config.drop_vision_last_layer = False
    try:
        yield
    finally:
        with contextlib.suppress(AttributeError):
            del config.drop_vision_last_layer


def crop_grids(fields: Any, key: str) -> list[tuple[int, int]] | None:
    """The ``(height, width)`` patch grid of every crop of one multimodal item: its field ``key`` (``tgt_sizes`` /
    ``video_tgt_sizes``: vLLM's ``MultiModalFieldElem`` whose ``data`` is an ``(n_crops, 2)`` tensor) of ``fields``
    (the item's mapping of fields), or None where the item carries no such tensor (image embeddings given)."""
    import torch

    elem = fields.get(key) if hasattr(fields, "get") else None
    tensor = getattr(elem, "data", None)
    if not isinstance(tensor, torch.Tensor):
        return None
    return [(int(h), int(w)) for h, w in tensor.reshape(-1, 2).tolist()]
