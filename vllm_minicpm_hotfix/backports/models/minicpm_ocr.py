"""vLLM model classes for MiniCPM-OCR (``MiniCPMOcrForConditionalGeneration``) on vLLM releases that lack them.

Imported only by vLLM's model registry, lazily (``ModelRegistry.register_model(ARCH, "<this module>:Class")``, done by
:mod:`vllm_minicpm_hotfix.backports.minicpm_ocr`), in the process that resolves or builds the model. It imports vLLM
and torch.

MiniCPM-OCR is 4.6's vision stack and Qwen3.5 text tower (transformers' ``transformers/models/minicpm_ocr/``, 5.24:
``MiniCPMOcrModel`` and ``MiniCPMOcrForConditionalGeneration`` are 4.6's, unchanged). What differs:

* **The config** (``MiniCPMOcrConfig``): ``downsample_mode`` defaults to ``"4x"`` (no ViT window merger; 4 patches per
  token), and ``drop_vision_last_layer`` / ``image_size`` are gone: every vision layer is kept.
* **The image processor** (``MiniCPMOcrImageProcessor``): ``"4x"`` by default, so ``find_best_resize`` aligns each
  side to ``patch_size * 2`` (``"16x"``: ``* 4``); and ``small_image_upsize``: ``"always"`` (the default) upsizes an
  unsliced image to ``scale_resolution`` as 4.6 does, ``"never"`` keeps its native size, ``"adaptive"`` decides per
  image and per slice from the pixels (glyph size and density; ``adaptive_upsize_resolution``). The size of a crop
  cannot then be computed from the image size: ``MiniCPMOcrProcessor.replace_image_token`` lays each image's
  placeholder out from the crops' ``target_sizes`` (``h * w // 4`` or ``// 16`` tokens per crop, each slice its own
  count).

The classes subclass the installed vLLM's three 4.6 classes (``vllm/model_executor/models/minicpmv4_6.py``) and call
``super()`` where they override:

* :class:`MiniCPMOcrMultiModalProcessor` gives an image the text transformers gives it, from the ``tgt_sizes`` vLLM's
  own ``process_images`` kept of the image processor's ``target_sizes`` (the same call: ``image_processor([image],
  **mm_kwargs)``); the grid is the image processor's ``get_sliced_grid`` on the image size, as its ``_preprocess``
  computes it. Videos keep 4.6's text (the OCR video processor has no small-image upsize).
* :class:`MiniCPMOcrProcessingInfo` sizes images from their size alone (vLLM's encoder budget and dummy inputs) with
  4.6's arithmetic on transformers' ``find_best_resize`` / ``get_refine_size``, handing them the mode (transformers
  >= 5.21 requires it; vLLM's 4.6 body omits it). For ``"always"`` that is the crops' exact size; for ``"adaptive"``
  an upper bound (transformers' adaptive crop is never larger).
* :class:`MiniCPMOcrForConditionalGeneration` keeps every vision layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.model_executor.models import minicpmv4_6 as _m46
from vllm.model_executor.models.minicpmv import MiniCPMVDummyInputsBuilder
from vllm.multimodal import MULTIMODAL_REGISTRY

from ...fixes._proxies import ModeInfoView
from ._shared import KeepsEveryVisionLayer, ProcessorMaxSliceNums, crop_grids


class MiniCPMOcrProcessingInfo(ProcessorMaxSliceNums, _m46.MiniCPMV4_6ProcessingInfo):
    """4.6's processing info for a checkpoint whose processor is transformers' ``MiniCPMOcrProcessor``."""

    def _compute_visual_tokens(self, image_size: Any, max_slice_nums: int | None = None,
                               downsample_mode: str | None = None) -> tuple[list[int], int, int]:
        """``(grid [rows, cols] or [0, 0], source tokens, tokens per slice)`` of an image of ``image_size`` (vLLM's
        ``ImageSize``, width and height in pixels): vLLM's 4.6 arithmetic run on a view of ``self`` whose image
        processor gets the resolved ``downsample_mode`` (``"4x"``: sides aligned to ``patch_size * 2``) in every
        ``find_best_resize`` / ``get_refine_size`` call that does not pass one. Raises what vLLM's body raises."""
        mode = self._get_downsample_mode(downsample_mode)
        return super()._compute_visual_tokens.__func__(ModeInfoView(self, mode), image_size, max_slice_nums,
                                                        downsample_mode)


class MiniCPMOcrMultiModalProcessor(_m46.MiniCPMV4_6MultiModalProcessor):
    """4.6's multimodal processor with each image's text laid out from its crops, as ``MiniCPMOcrProcessor`` does."""

    def _get_prompt_updates(self, mm_items: Any, hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: Any) -> list[Any]:
        """4.6's prompt updates (vLLM's ``PromptReplacement`` per placeholder pattern), the image ones replaced by
        :meth:`image_text` of the item's processed crops; an item without ``tgt_sizes`` (embeddings given) keeps
        4.6's text."""
        updates = list(super()._get_prompt_updates(mm_items, hf_processor_mm_kwargs, out_mm_kwargs))
        pad = getattr(self.info.get_tokenizer(), "image_token", "<|image_pad|>")

        def replacement(original: Any) -> Any:
            def image_replacement(item_idx: int) -> Any:
                crops = item_crops(out_mm_kwargs, item_idx)
                if crops is None:
                    return original(item_idx)
                images = mm_items.get_items("image", (_m46.MiniCPMVImageEmbeddingItems, _m46.ImageProcessorItems))
                text = self.image_text(images.get_image_size(item_idx), crops, hf_processor_mm_kwargs, item_idx)
                return _m46.PromptUpdateDetails.select_text(text, pad)

            return image_replacement

        return [_m46.PromptReplacement(modality=u.modality, target=u.target, replacement=replacement(u.replacement))
                if u.modality == "image" and callable(u.replacement) else u for u in updates]

    def image_text(self, image_size: Any, crops: list[tuple[int, int]], kwargs: Mapping[str, object],
                   image_idx: int) -> str:
        """transformers' ``MiniCPMOcrProcessor`` text of one image (5.24: ``replace_image_token`` and
        ``_prepend_local_ids``): ``<image_id>N</image_id>`` (unless ``use_image_id`` is false), ``<image>`` + pads of
        the first crop + ``</image>``, then one ``<slice>``...``</slice>`` per slice, rows joined by ``"\\n"``.

        ``image_size``: vLLM's ``ImageSize`` (pixels). ``crops``: ``(height, width)`` in patches of every crop, the
        overview first (vLLM's ``tgt_sizes``). ``kwargs``: the request's processor kwargs over the checkpoint's. A
        crop has ``h * w // 4`` pads in ``"4x"``, ``// 16`` in ``"16x"``.

        Raises:
            ValueError: the crops do not fill the grid the image processor slices this size into (never, unless
                vLLM and transformers disagree on the item).
        """
        processor = self.info.get_image_processor()
        setting = {k: kwargs.get(k, getattr(processor, k, None)) for k in
                   ("slice_mode", "max_slice_nums", "scale_resolution", "use_image_id")}
        divisor = 4 if self._resolve_downsample_mode(kwargs) == "4x" else 16
        tokens = [h * w // divisor for h, w in crops]
        rows = cols = 0
        if setting["slice_mode"] and len(tokens) > 1:
            grid = processor.get_sliced_grid((image_size.height, image_size.width), setting["max_slice_nums"],
                                             setting["scale_resolution"])
            rows, cols = grid if grid is not None else (0, 0)
        if rows * cols != len(tokens) - 1:
            raise ValueError(f"MiniCPM-OCR: {len(tokens) - 1} slices for a {rows}x{cols} grid "
                             f"({image_size.width}x{image_size.height} image)")
        tok = self.info.get_tokenizer()
        mark = {k: getattr(tok, f"{k}_token", f"<{k}>") for k in ("image_start", "image_end", "slice_start",
                                                                   "slice_end", "image_id_start", "image_id_end")}
        pad = getattr(tok, "image_token", "<|image_pad|>")
        text = mark["image_start"] + pad * tokens[0] + mark["image_end"]
        slices = [mark["slice_start"] + pad * n + mark["slice_end"] for n in tokens[1:]]
        text += "\n".join("".join(slices[r * cols:(r + 1) * cols]) for r in range(rows))
        if setting["use_image_id"] is not False:
            text = f"{mark['image_id_start']}{image_idx}{mark['image_id_end']}" + text
        return text


def item_crops(out_mm_kwargs: Any, item_idx: int) -> list[tuple[int, int]] | None:
    """The ``(height, width)`` patch grid of every crop of image ``item_idx`` of vLLM's processed items (its
    ``tgt_sizes``), or None where the item has none (image embeddings)."""
    try:
        item = out_mm_kwargs["image"][item_idx]
    except (KeyError, IndexError, TypeError):
        return None
    return crop_grids(item, "tgt_sizes")


@MULTIMODAL_REGISTRY.register_processor(
    MiniCPMOcrMultiModalProcessor,
    info=MiniCPMOcrProcessingInfo,
    dummy_inputs=MiniCPMVDummyInputsBuilder,
)
class MiniCPMOcrForConditionalGeneration(KeepsEveryVisionLayer, _m46.MiniCPMV4_6ForConditionalGeneration):
    """MiniCPM-OCR: the installed vLLM's 4.6 model with every vision layer kept (its ``"4x"`` default is the
    config's ``downsample_mode``, which the 4.6 model reads)."""
