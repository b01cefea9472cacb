"""Stand-ins the probes run vLLM's and transformers' own code on: transformers' real MiniCPM-V 4.6 processor classes
with a tiny in-memory tokenizer, and vLLM's real ``ProcessingInfo`` / ``MultiModalProcessor`` classes created without
``__init__`` (no model, config or files needed). Nothing here imports vLLM, torch or transformers at import time.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ._mm_prompt import TOKENS, divisor

#: The probes' geometry: patch 14 (the real checkpoint's) and a small ``scale_resolution`` so that every probe image
#: is tiny (the defects show at any scale; the tests sweep the real 448 as well).
PROBE_GEOMETRY = {"patch_size": 14, "scale_resolution": 112, "max_slice_nums": 9}


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """A character-level ``tokenizers`` tokenizer in a transformers fast-tokenizer class, with MiniCPM-V 4.6's
    special tokens (:data:`TOKENS`) as single ids and named as transformers' ``MiniCPMV4_6Processor`` reads them.
    ``decode(encode(text)) == text`` for printable ASCII, newlines and the special tokens."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [*TOKENS.values(), "<unk>", "<pad>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for c in [chr(i) for i in range(32, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", extra_special_tokens=dict(TOKENS)
    )


def hf_processor(**kwargs: Any) -> Any:
    """A transformers ``MiniCPMV4_6Processor`` over real image and video processors built with
    :data:`PROBE_GEOMETRY` and ``kwargs`` and the :func:`tokenizer`.

    Created without ``ProcessorMixin.__init__`` (whose argument check imports every tokenizer backend, mistral_common
    included: seconds in a fresh process); the attributes are set as ``MiniCPMV4_6Processor.__init__`` sets them
    (transformers 5.7-5.24). Raises ImportError where transformers has no MiniCPM-V 4.6."""
    from transformers.models.minicpmv4_6 import processing_minicpmv4_6 as processing

    try:
        from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor as IP
    except Exception:  # no torchvision backend: the PIL one
        from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
            MiniCPMV4_6ImageProcessorPil as IP,
        )
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor as VP

    settings = {**PROBE_GEOMETRY, **kwargs}
    ip, vp, tok = IP(**settings), VP(**settings), tokenizer()
    cls = processing.MiniCPMV4_6Processor
    proc = cls.__new__(cls)
    proc.image_processor, proc.video_processor, proc.tokenizer = ip, vp, tok
    proc.slice_mode = ip.slice_mode
    proc.video_slice_mode = vp.slice_mode
    proc.default_use_image_id = ip.use_image_id
    proc.image_token_divisor = divisor(ip.downsample_mode)
    proc.video_token_divisor = divisor(vp.downsample_mode)
    for name in TOKENS:
        setattr(proc, name, getattr(tok, name))
    proc.image_token_id = tok.convert_tokens_to_ids(tok.image_token)
    proc.video_token_id = tok.convert_tokens_to_ids(tok.video_token)
    return proc


class _StandInCtx:
    """vLLM's ``InputProcessingContext`` as far as the 4.6 processor uses it, over a fixed transformers processor."""

    def __init__(self, hf_processor: Any) -> None:
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer

    def get_hf_processor(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf_processor

    def get_merged_mm_kwargs(self, kwargs: Mapping[str, object], **_: Any) -> dict[str, object]:
        return dict(kwargs)


def info(info_cls: type, hf_processor: Any, *, image_processor: Any = None) -> Any:
    """An instance of vLLM's ``MiniCPMV4_6ProcessingInfo`` created without ``__init__`` whose context, tokenizer and
    hf config are stand-ins over ``hf_processor``. ``image_processor`` (default ``hf_processor.image_processor``) is
    what its ``get_image_processor()`` returns."""
    from types import SimpleNamespace

    info = info_cls.__new__(info_cls)
    ctx = _StandInCtx(hf_processor)
    ip = hf_processor.image_processor if image_processor is None else image_processor
    config = SimpleNamespace(
        text_config=SimpleNamespace(hidden_size=64), hidden_size=64, insert_layer_id=1, slice_config=None,
        max_slice_nums=PROBE_GEOMETRY["max_slice_nums"], image_size=PROBE_GEOMETRY["scale_resolution"],
    )
    info.__dict__.update(
        ctx=ctx,
        get_tokenizer=lambda: ctx.tokenizer,
        get_hf_config=lambda: config,
        get_image_processor=lambda **kwargs: ip,
        # vLLM 0.32+: merges the model-level and request kwargs and routes flat keys into each modality's scope.
        _merge_and_resolve_mm_processor_kwargs=lambda kwargs: {
            **kwargs, "images_kwargs": dict(kwargs), "videos_kwargs": dict(kwargs),
        },
    )
    return info


def processor(proc_cls: type, info: Any) -> Any:
    """An instance of vLLM's ``MiniCPMV4_6MultiModalProcessor`` created without ``__init__`` over ``info``."""
    proc = proc_cls.__new__(proc_cls)
    proc.__dict__.update(info=info, cache=None)
    return proc


#: The capacity of :func:`processor_cache` (1 MiB): far above the probes' items (a few kB), far below a real cache.
_CACHE_GB = 1 / 1024


def processor_cache() -> Any:
    """vLLM's own front-end (P0) processor cache, empty: an instance of the installed release's
    ``MultiModalProcessorOnlyCache`` (``vllm/multimodal/cache.py`` in 0.22-0.31, ``cache/base.py`` from 0.32 on; the
    cache vLLM uses when IPC caching is off), built by its own ``__init__`` over a stand-in model config that gives
    only ``get_multimodal_config().mm_processor_cache_gb``. So every cache method vLLM's ``_merge_mm_kwargs`` calls
    -- ``touch_sender_cache_item`` and ``get_and_update_item`` in 0.22-0.33, ``get_cached_item`` added in 0.34, and
    whatever a later release adds to the class -- is vLLM's own. Raises what that ``__init__`` raises (a release
    whose cache reads more of the model config)."""
    from types import SimpleNamespace

    from vllm.multimodal import cache as caches

    mm_config = SimpleNamespace(mm_processor_cache_gb=_CACHE_GB)
    return caches.MultiModalProcessorOnlyCache(SimpleNamespace(get_multimodal_config=lambda: mm_config))
