"""A video served from vLLM's processor cache keeps the ``<image_id>`` index of the request it was first seen in.

What breaks
-----------
MiniCPM-V 4.6 numbers each video of a prompt: ``<image_id>i</image_id>`` before its frames, ``i`` its index among the
prompt's videos (transformers' ``MiniCPMV4_6Processor._prepend_local_ids``). vLLM caches each item's resolved prompt
update under its hash and, when it reuses one, calls ``BaseMultiModalProcessor._recompute_cached_prompt_update(update,
new_item_idx)``; ``MiniCPMVMultiModalProcessor``'s override rewrites the index for images only. Every update goes
through it once a processor cache exists (the default), so with vLLM 0.22-0.24 (and 0.25.0) a video first seen at
index 0 keeps ``<image_id>0</image_id>`` at index 1 of a later prompt, and a prompt whose first video was cached
numbers its second video 0 as well: the prompt differs from transformers' without any error. 0.26 added the
video branch to ``MiniCPMV4_6MultiModalProcessor``.

What the fix does
-----------------
Wraps ``MiniCPMV4_6MultiModalProcessor._recompute_cached_prompt_update``: after vLLM's own, a video update's first
``<image_id>{old}</image_id>`` becomes ``<image_id>{new}</image_id>`` (as 0.26+ does); the content keeps its form
(text, or token ids with ``<|video_pad|>`` selected). Updates without the prefix (``use_image_id: false``) and other
modalities are left as vLLM made them.

The decision
------------
Resolves the installed ``_get_mm_prompt_updates`` for one video (stand-ins over a real transformers processor and a
tiny tokenizer, as :mod:`.mm_placeholders` does), hands the update to the installed
``_recompute_cached_prompt_update`` with a new index 1 and reads the index back: ``broken`` if it is still 0,
``correct`` if it is 1. Costs a few ms.

Upstream
--------
none known (0.26 added the video branch to ``_recompute_cached_prompt_update``).

Remove when
-----------
its probe reads ``<image_id>1</image_id>`` back from stock vLLM's ``_recompute_cached_prompt_update`` for a cached
video moved to index 1 on every release the hotfix supports: once 0.22-0.25 are no longer supported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from . import _mm_prompt as mp
from . import _stand_ins
from ._base import INFO_CLASS, PROCESSOR_CLASS, PROCESSOR_PATH, V46, Call, wrap

NAME = "video_image_id_cache"
LABEL = "cached video <image_id> index"
#: 4.6 only: 4.7's videos carry no local id (``MiniCPMV4_7Processor._prepend_local_ids`` returns them unchanged,
#: vLLM's ``MiniCPMV4_7MultiModalProcessor._video_local_id_prefix`` is ""), so there is no index to renumber.
MODELS = (V46,)
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use


def _text_of(tokenizer: Any, full: Any) -> str:
    return full if isinstance(full, str) else tokenizer.decode(list(full))


def _details(tokenizer: Any, like: Any, text: str) -> Any:
    """A ``PromptUpdateDetails`` for ``text`` in the form of ``like.full`` (text or token ids), selecting
    ``<|video_pad|>`` as the embedding positions."""
    from vllm.multimodal.processing.processor import PromptUpdateDetails

    video_token = getattr(tokenizer, "video_token", mp.TOKENS["video_token"])
    if isinstance(like.full, str) or not hasattr(PromptUpdateDetails, "select_token_ids"):
        return PromptUpdateDetails.select_text(text, video_token)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return PromptUpdateDetails.select_token_ids(ids, tokenizer.encode(video_token, add_special_tokens=False))


def recompute_cached_prompt_update(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``MiniCPMV4_6MultiModalProcessor._recompute_cached_prompt_update(self, cached_update:
    ResolvedPromptUpdate, new_item_idx: int) -> ResolvedPromptUpdate``: vLLM's own, then a video's ``<image_id>``
    index rewritten from ``cached_update.item_idx`` to ``new_item_idx`` (see the module docstring)."""
    new_update = wrapped(*call.args, **call.kwargs)
    cached, new_idx = call["cached_update"], int(call["new_item_idx"])
    if getattr(cached, "modality", None) != "video" or cached.item_idx == new_idx:
        return new_update
    tokenizer = instance.info.get_tokenizer()
    hf = _ids(tokenizer)
    old_prefix, new_prefix = mp.id_prefix(hf, cached.item_idx), mp.id_prefix(hf, new_idx)
    text = _text_of(tokenizer, new_update.content.full)
    if old_prefix not in text:  # already rewritten by vLLM, or no ids (use_image_id: false)
        return new_update
    return new_update.with_content(_details(tokenizer, new_update.content, text.replace(old_prefix, new_prefix, 1)))


PATCHES = {f"{PROCESSOR_CLASS}._recompute_cached_prompt_update": wrap(recompute_cached_prompt_update, bind=True)}


def _ids(tokenizer: Any) -> Any:
    """An object with ``image_id_start_token`` / ``image_id_end_token`` as the tokenizer names them."""
    from types import SimpleNamespace

    return SimpleNamespace(
        image_id_start_token=getattr(tokenizer, "image_id_start_token", mp.TOKENS["image_id_start_token"]),
        image_id_end_token=getattr(tokenizer, "image_id_end_token", mp.TOKENS["image_id_end_token"]),
    )


def probe(module: ModuleType) -> Verdict:
    """Whether the installed processor renumbers a cached video's ``<image_id>`` (see the module docstring). Never
    raises; leaves ``module`` unchanged."""
    proc_cls = getattr(module, PROCESSOR_CLASS, None)
    info_cls = getattr(module, INFO_CLASS, None)
    if not isinstance(proc_cls, type) or not callable(getattr(proc_cls, "_recompute_cached_prompt_update", None)):
        return Verdict(
            State.UNRECOGNISED, f"{module.__name__} has no {PROCESSOR_CLASS}._recompute_cached_prompt_update",
            applicable=False,
        )
    try:
        import numpy as np

        from vllm.multimodal.inputs import MultiModalKwargsItems
        from vllm.multimodal.parse import MultiModalDataItems, VideoProcessorItems

        from ._proxies import ModeDefaultingImageProcessor

        native = _stand_ins.hf_processor()
        view = ModeDefaultingImageProcessor(native.image_processor)
        info = _stand_ins.info(info_cls, native, image_processor=view)
        proc = _stand_ins.processor(proc_cls, info)
        video = np.zeros((1, 28, 28, 3), dtype=np.uint8)
        items = MultiModalDataItems({"video": VideoProcessorItems([video])})
        resolved = proc._get_mm_prompt_updates(items, {}, MultiModalKwargsItems({}))["video"][0][0]
        tok = native.tokenizer
        before = _text_of(tok, resolved.content.full)
        if mp.id_prefix(native, 0) not in before:
            return Verdict(State.UNDETERMINED, f"vLLM's video placeholder has no <image_id>0</image_id>: {before!r}")
    except Exception as exc:
        return Verdict(State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    try:
        after = _text_of(tok, proc._recompute_cached_prompt_update(resolved, 1).content.full)
    except Exception as exc:
        return Verdict(State.BROKEN, f"{PROCESSOR_CLASS}._recompute_cached_prompt_update raises {type(exc).__name__}: {exc}")
    if mp.id_prefix(native, 1) in after and mp.id_prefix(native, 0) not in after:
        return Verdict(State.CORRECT, "a cached video moved to index 1 is renumbered <image_id>1</image_id>")
    return Verdict(
        State.BROKEN,
        f"a cached video moved from index 0 to 1 keeps its old index: {after[: after.find('<image>')]!r}",
    )
