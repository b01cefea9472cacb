"""The fixes, one module each, and the one registry that drives them.

Every module listed in :data:`REGISTRY` has the shape described in :mod:`vllm_minicpm_hotfix.fixes._base`:
``NAME``, ``LABEL``, ``MODELS``, optionally ``AFTER`` (the fixes it must come after), ``PATCHES`` (one line per
target: ``"Class.attr"`` -> its behaviour, ``_base.wrap`` / ``replace`` / ``attribute``) and ``probe(module)``;
:func:`~._base.complete` derives each one's ``SETS`` (the targets) and ``apply(module)`` as the registry is built.
The post-import hook runs them in this order, each guarded on its own; ``status()``, ``doctor``, ``verify``, the
tests and the README release table iterate over the same tuple. Adding a fix is adding a module, a line here and its
test file (docs/how-it-works.md, "The shape of a fix").

Importing this package imports the fix modules, but none of them imports vLLM, torch or transformers at import time.

One image or video request's path through the fixes in the API server (vLLM's multimodal processor, every release
0.22-0.33), in the order the wrappers are first entered (:data:`REQUEST_PATH`; tests/registry/test_request_path.py traces a
real request on the installed vLLM and checks it):

==========================================================  =====================  ====================================
vLLM method (``MiniCPMV4_6`` classes)                       fix                    reads / sets
==========================================================  =====================  ====================================
``MultiModalProcessor.apply``                               request_kwargs         reads the request's
                                                                                   ``mm_processor_kwargs`` and item
                                                                                   sizes; raises its 400 before any
                                                                                   pixel work
``MultiModalProcessor._apply_hf_processor``                 placeholder_guard      after vLLM's: each item's
                                                                                   embeddings against its
                                                                                   placeholders (400 on a mismatch)
``MultiModalProcessor.process_mm_inputs``                   encoder_modes (outer)  adds ``video_use_vit_merger``
``MultiModalProcessor.process_mm_inputs``                   mm_placeholders        sets ``_mm_prompt.PROCESSING`` to
                                                                                   the request's ``mm_kwargs``
``MultiModalProcessor._get_mm_fields_config``               encoder_modes          the per-item downsample field
``MultiModalProcessor._get_mm_prompt_updates``              mm_placeholders        resolves the replacements with
                                                                                   ``_mm_prompt.REQUEST`` set
``ProcessingInfo.get_slice_image_placeholder`` (image)      mm_placeholders        transformers' text, from
                                                                                   ``REQUEST``
``MultiModalProcessor.get_video_prompt_texts`` (video)      mm_placeholders        transformers' text, from
                                                                                   ``REQUEST``
==========================================================  =====================  ====================================

Two look-ups are called from several of these steps, wherever one first needs them: ``ProcessingInfo.get_hf_processor``
(hf_processor_version: transformers' 4.6 processor, no legacy wrapper) and ``ProcessingInfo.get_video_max_slice_num``
(mm_placeholders: a request's own ``max_slice_nums`` for video frames).
Where vLLM's processor cache holds an item, ``_merge_mm_kwargs`` (placeholder_guard: checks the items it does not
hold, before it records them) and ``_recompute_cached_prompt_update`` (video_image_id_cache) come in; in the engine,
``ForConditionalGeneration.embed_multimodal`` (encoder_modes: each item's downsample mode). Two fixes on one
attribute (:func:`shared_targets`) wrap in registry order, the later outside: ``encoder_modes`` over
``mm_placeholders`` on ``process_mm_inputs``, ``qkv_completeness_guard`` over ``qkv_loader`` on ``load_weights``;
``status()`` names them (``wraps``), and so does ``doctor``.
"""

from __future__ import annotations

from types import ModuleType

from . import _base
from . import (
    canvas_mrope,
    encoder_modes,
    hf_processor_version,
    lora_support,
    lora_tower,
    mm_placeholders,
    ocr_video_kwargs,
    placeholder_guard,
    processor_downsample_mode,
    qkv_completeness_guard,
    qkv_loader,
    quantized_vision,
    request_kwargs,
    unsupported_quant_method,
    video_budget,
    video_image_id_cache,
    video_loader,
    video_tower,
)

#: The fixes, in the order the post-import hook applies them.
REGISTRY: tuple[ModuleType, ...] = (
    qkv_loader,
    qkv_completeness_guard,
    processor_downsample_mode,
    hf_processor_version,
    mm_placeholders,
    video_image_id_cache,
    encoder_modes,
    video_tower,
    video_budget,
    ocr_video_kwargs,
    canvas_mrope,
    video_loader,
    placeholder_guard,
    request_kwargs,
    quantized_vision,
    unsupported_quant_method,
    lora_support,
    lora_tower,
)
for _fix in REGISTRY:
    _base.complete(_fix)
del _fix


#: One request's path through the fixes in the API server, in the order the wrappers are first entered (the table of
#: the module docstring): ``(target, fix NAME, when)``; ``when`` is ``"always"``, ``"image"`` or ``"video"`` (requests
#: of that modality). A wrapper of a fix that is not applied is not entered.
REQUEST_PATH: tuple[tuple[str, str, str], ...] = (
    ("MiniCPMV4_6MultiModalProcessor.apply", "request_kwargs", "always"),
    ("MiniCPMV4_6MultiModalProcessor._apply_hf_processor", "placeholder_guard", "always"),
    ("MiniCPMV4_6MultiModalProcessor.process_mm_inputs", "encoder_modes", "always"),
    ("MiniCPMV4_6MultiModalProcessor.process_mm_inputs", "mm_placeholders", "always"),
    ("MiniCPMV4_6MultiModalProcessor._get_mm_fields_config", "encoder_modes", "always"),
    ("MiniCPMV4_6MultiModalProcessor._get_mm_prompt_updates", "mm_placeholders", "always"),
    ("MiniCPMV4_6ProcessingInfo.get_slice_image_placeholder", "mm_placeholders", "image"),
    ("MiniCPMV4_6MultiModalProcessor.get_video_prompt_texts", "mm_placeholders", "video"),
)
#: The look-ups several steps of :data:`REQUEST_PATH` call, wherever one first needs them: ``(target, fix NAME)``.
REQUEST_LOOKUPS: tuple[tuple[str, str], ...] = (
    ("MiniCPMV4_6ProcessingInfo.get_hf_processor", "hf_processor_version"),
    ("MiniCPMV4_6ProcessingInfo.get_video_max_slice_num", "mm_placeholders"),
)


def by_name(name: str) -> ModuleType:
    """The fix module whose ``NAME`` is ``name``. Raises ``KeyError`` naming the known fixes."""
    for fix in REGISTRY:
        if fix.NAME == name:
            return fix
    raise KeyError(f"no fix named {name!r}; known: {[f.NAME for f in REGISTRY]}")


def names() -> list[str]:
    """Every fix's ``NAME``, in registry order."""
    return [fix.NAME for fix in REGISTRY]


def out_of_order(registry: tuple[ModuleType, ...] = REGISTRY) -> list[str]:
    """Each way ``registry`` breaks a fix's ``AFTER`` (a fix it must come after listed later, or not at all); empty
    when the order is right."""
    position = {fix.NAME: i for i, fix in enumerate(registry)}
    return [f"{fix.NAME} must come after {before}" for i, fix in enumerate(registry)
            for before in getattr(fix, "AFTER", ()) if position.get(before, len(registry)) > i]


def shared_targets() -> dict[str, tuple[str, ...]]:
    """The targets two or more fixes set, with their NAMEs in the order they wrap (``_base.shared_targets``)."""
    return _base.shared_targets(REGISTRY)


__all__ = ["REGISTRY", "REQUEST_LOOKUPS", "REQUEST_PATH", "by_name", "names", "out_of_order", "shared_targets"]
