"""vLLM model classes for MiniCPM-V 4.7 (``MiniCPMV4_7ForConditionalGeneration``) on vLLM releases that lack them.

Imported only by vLLM's model registry, lazily (``ModelRegistry.register_model(ARCH, "<this module>:Class")``, done by
:mod:`vllm_minicpm_hotfix.backports.minicpmv4_7`), in the process that resolves or builds the model -- and in vLLM's
registry-inspection subprocess. It imports vLLM and torch.

MiniCPM-V 4.7 is 4.6's vision stack and Qwen3.5 text tower with three changes, read from transformers'
``transformers/models/minicpmv4_7/`` (5.19-5.24):

* **The processor** is ``MiniCPMV4_7Processor``: 4.6's, except that a video gets no local ``<image_id>N</image_id>``
  in front of it (``_prepend_local_ids`` returns the replacements as they are for the video token), and it returns
  ``mm_token_type_ids``. Image text is 4.6's.
* **Canvas M-RoPE**: ``MiniCPMV4_7Model.get_rope_index`` places every picture on a canvas of 3-D positions
  (:mod:`vllm_minicpm_hotfix.backports.canvas`); 4.6 gives every token sequential positions.
* **The config**: ``MiniCPMV4_7Config`` removes ``drop_vision_last_layer`` (4.7 keeps every vision layer) and adds the
  marker ids canvas M-RoPE anchors on (``image_start_id`` ... ``newline_id``). The text config is dense
  (``qwen3_5_text``, the 1B) or sparse (``qwen3_5_moe_text``, the 35B-A3B).

The classes subclass the installed vLLM's three 4.6 classes (``vllm/model_executor/models/minicpmv4_6.py``) and call
``super()`` wherever they override, so every fix of this package that acts on a 4.6 method also runs for them, and
they inherit whatever the installed release does (weight names and loading, the vision tower, video frames). Where the
releases' 4.6 classes differ, the difference is detected on the class, not on a version:

* the last-vision-layer switch: vLLM 0.32+'s constructor asks ``self._drop_vision_last_layer()`` (overridden here to
  False); 0.22-0.31 read ``config.drop_vision_last_layer``, which a 4.7 config does not have: the constructor sees it
  False on the config instance for that call only;
* the text tower: the 4.6 constructor builds ``Qwen3_5ForCausalLM`` whatever the text config; with a sparse text
  config its decoder layers are already ``Qwen3NextSparseMoeBlock`` (``Qwen3_5DecoderLayer`` reads the text config's
  ``model_type``, 0.22-0.33), and the instance becomes ``Qwen3_5MoeForCausalLM`` (see :func:`as_moe_text_tower`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.models import minicpmv4_6 as _m46
from vllm.model_executor.models.minicpmv import MiniCPMVDummyInputsBuilder
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.model_executor.models.utils import StageMissingLayer

from .. import canvas
from ...record import logger
from ._shared import KeepsEveryVisionLayer, ProcessorMaxSliceNums, crop_grids

#: The MoE text config's ``model_type`` (transformers' ``Qwen3_5MoeTextConfig``).
MOE_TEXT = "qwen3_5_moe_text"


class MiniCPMV4_7ProcessingInfo(ProcessorMaxSliceNums, _m46.MiniCPMV4_6ProcessingInfo):
    """4.6's processing info for a checkpoint whose processor is transformers' ``MiniCPMV4_7Processor``; the
    ``max_slice_nums`` of the encoder budget as :class:`._shared.ProcessorMaxSliceNums` reads it (a 4.7 config has no
    ``max_slice_nums`` / ``slice_config``, so 4.6's reads 9)."""


class MiniCPMV4_7MultiModalProcessor(_m46.MiniCPMV4_6MultiModalProcessor):
    """4.6's multimodal processor, with transformers' 4.7 video text: no local ``<image_id>`` before a video."""

    def get_video_prompt_texts(self, *args: Any, **kwargs: Any) -> str:
        """4.6's text of one video (the installed signature: frame size, number of frames, downsample mode, video
        index), without the ``<image_id>N</image_id>`` it starts with where the checkpoint's processor puts no local
        id before a video (transformers' ``MiniCPMV4_7Processor``: :func:`video_gets_local_id`). A text that does
        not start with one (a fix already gave transformers' own) is returned as it is."""
        text = super().get_video_prompt_texts(*args, **kwargs)
        hf_processor = self.info.get_hf_processor()
        if video_gets_local_id(hf_processor):
            return text
        start = getattr(hf_processor, "image_id_start_token", "<image_id>")
        end = getattr(hf_processor, "image_id_end_token", "</image_id>")
        return re.sub(rf"^{re.escape(start)}\d+{re.escape(end)}", "", text, count=1)


def video_gets_local_id(hf_processor: Any) -> bool:
    """Whether transformers' processor puts a local ``<image_id>`` before a video: what its own
    ``_prepend_local_ids(text, replacements, token)`` (transformers 5.7+) does to one video's replacement (4.6's:
    prepends; 4.7's: returns it as it is). A processor without that method lays videos out as 4.6 does."""
    prepend = getattr(type(hf_processor), "_prepend_local_ids", None)
    if not callable(prepend):
        return True
    pad = getattr(hf_processor, "video_token", "<|video_pad|>")
    return prepend(hf_processor, [pad], [""], pad) != [""]


def is_moe_text(text_config: Any) -> bool:
    """Whether the text config names the sparse tower: ``model_type`` ``qwen3_5_moe_text``, or experts declared."""
    return getattr(text_config, "model_type", None) == MOE_TEXT or bool(getattr(text_config, "num_experts", 0))


def as_moe_text_tower(language_model: Any) -> Any:
    """``language_model`` (the ``Qwen3_5ForCausalLM`` 4.6's constructor built from a sparse text config) as the
    ``Qwen3_5MoeForCausalLM`` vLLM builds for that config, without building the text tower a second time.

    ``Qwen3_5MoeForCausalLM`` is ``Qwen3_5ForCausalLMBase`` and ``QwenNextMixtureOfExperts``; its constructor is the
    base's followed by ``set_moe_parameters()`` (vLLM 0.22-0.33, ``qwen3_5.py``), and the base's already built the
    sparse blocks the config names. So the instance gets that class and that call; ``set_moe_parameters`` raises
    ``RuntimeError`` where no layer is sparse. Returns the instance (unchanged if it already is one).

    Raises:
        TypeError: ``language_model`` is not a ``Qwen3_5ForCausalLM`` (a release whose 4.6 constructor builds another
            text tower): the backport does not know how to make it sparse.
    """
    from vllm.model_executor.models import qwen3_5

    if isinstance(language_model, qwen3_5.Qwen3_5MoeForCausalLM):
        return language_model
    if type(language_model) is not qwen3_5.Qwen3_5ForCausalLM:
        raise TypeError(f"MiniCPM-V 4.7 backport: the 4.6 constructor built {type(language_model).__qualname__}, "
                        "not Qwen3_5ForCausalLM: cannot make it Qwen3_5MoeForCausalLM")
    language_model.__class__ = qwen3_5.Qwen3_5MoeForCausalLM
    language_model.set_moe_parameters()
    return language_model


def canvas_markers(config: Any, tokenizer_source: Any = None) -> canvas.Markers:
    """The canvas marker ids of the checkpoint: ``MiniCPMV4_7Config``'s ``image_start_id``, ``image_end_id``,
    ``slice_start_id``, ``slice_end_id``, ``newline_id`` (transformers' conversion script resolves them from the
    tokenizer and stores them in ``config.json``); where the config lacks one, the tokenizer's ``<image>``,
    ``</image>``, ``<slice>``, ``</slice>`` and ``"\\n"`` ids (``tokenizer_source``: the checkpoint's folder or hub
    id). The pads are the config's ``image_token_id`` / ``video_token_id``."""
    names = ("image_start_id", "image_end_id", "slice_start_id", "slice_end_id", "newline_id")
    ids = {n: getattr(config, n, None) for n in names}
    if any(v is None for v in ids.values()):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_source)
        found = {
            "image_start_id": tok.convert_tokens_to_ids(getattr(tok, "image_start_token", "<image>")),
            "image_end_id": tok.convert_tokens_to_ids(getattr(tok, "image_end_token", "</image>")),
            "slice_start_id": tok.convert_tokens_to_ids(getattr(tok, "slice_start_token", "<slice>")),
            "slice_end_id": tok.convert_tokens_to_ids(getattr(tok, "slice_end_token", "</slice>")),
            "newline_id": tok.encode("\n", add_special_tokens=False)[0],
        }
        ids = {n: (found[n] if v is None else v) for n, v in ids.items()}
    return canvas.Markers(int(ids["image_start_id"]), int(ids["image_end_id"]), int(ids["slice_start_id"]),
                          int(ids["slice_end_id"]), int(ids["newline_id"]), int(config.image_token_id),
                          int(config.video_token_id))


#: The field of an item's multimodal data holding its crops' patch grids, per modality.
GRID_FIELDS = {"image": "tgt_sizes", "video": "video_tgt_sizes"}


def item_grids(feature: Any) -> list[tuple[int, int]] | None:
    """The ``(height, width)`` patch grid of each crop of one multimodal item (vLLM's ``MultiModalFeatureSpec``:
    ``feature.data[tgt_sizes | video_tgt_sizes].data``, an ``(n_crops, 2)`` tensor), or None where the item carries
    no such field."""
    data = getattr(feature, "data", None)
    key = GRID_FIELDS.get(getattr(feature, "modality", ""))
    return None if data is None or key is None else crop_grids(data, key)


@MULTIMODAL_REGISTRY.register_processor(
    MiniCPMV4_7MultiModalProcessor,
    info=MiniCPMV4_7ProcessingInfo,
    dummy_inputs=MiniCPMVDummyInputsBuilder,
)
class MiniCPMV4_7ForConditionalGeneration(KeepsEveryVisionLayer, _m46.MiniCPMV4_6ForConditionalGeneration):
    """MiniCPM-V 4.7: the installed vLLM's 4.6 model with every vision layer kept, the dense or sparse text tower
    its text config names, and canvas M-RoPE positions."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        config = vllm_config.model_config.hf_config
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # every vision layer kept (KeepsEveryVisionLayer)
        # An encoder-only instance (vLLM's ``mm_encoder_only``, as ``verify`` builds) has a ``StageMissingLayer`` in
        # place of the text tower: nothing to make sparse.
        if is_moe_text(config.text_config) and not isinstance(self.language_model, StageMissingLayer):
            self.language_model = as_moe_text_tower(self.language_model)
        self.canvas_markers = canvas_markers(config, vllm_config.model_config.tokenizer)

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        """``SupportsMRoPE.get_mrope_input_positions`` (vLLM 0.22-0.33: ``(input_tokens, mm_features) ->
        ((3, len(input_tokens)) long tensor, delta)``): transformers' canvas positions of the prompt
        (:func:`vllm_minicpm_hotfix.backports.canvas.positions`), from each image / video item's patch grids in
        prompt order. A prompt without items gets sequential positions, as in transformers.

        Never raises (it runs inside the engine, where an exception ends every request): where an item carries no
        patch grids or the prompt's crops and the grids disagree, one WARNING line names the request's layout and the
        request gets sequential positions (what vLLM's 4.6 gives every prompt)."""
        n = len(input_tokens)
        if not mm_features:
            return _sequential(n)
        grids: dict[str, list[tuple[int, int]]] = {"image": [], "video": []}
        try:
            for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
                found = item_grids(feature)
                if found is None:
                    raise ValueError(f"the {feature.modality} item at offset {feature.mm_position.offset} carries no "
                                     f"{GRID_FIELDS.get(feature.modality)}")
                grids[feature.modality].extend(found)
            return canvas.positions(list(input_tokens), self.canvas_markers, grids["image"], grids["video"],
                                    canvas.merge_from_tokens)
        except Exception as exc:  # noqa: BLE001 - never into the engine
            logger.warning("MiniCPM-V 4.7 canvas M-RoPE: %s; %d tokens, %d image and %d video crops: sequential "
                           "positions for this request", exc, n, len(grids["image"]), len(grids["video"]))
            return _sequential(n)


def _sequential(n: int) -> tuple[torch.Tensor, int]:
    return torch.arange(n).unsqueeze(0).expand(3, -1), 0
