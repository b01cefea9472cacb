"""The fixes, one module each, and the one registry that drives them.

Every module listed in :data:`REGISTRY` has the interface described in :mod:`vllm_minicpm_hotfix.fixes._base`
(``NAME``, ``LABEL``, ``SETS``, ``probe(module)``, ``apply(module)``). The post-import hook runs them in this order,
each guarded on its own; ``status()``, ``doctor``, ``verify``, the tests and the README release table iterate over
the same tuple. Adding a fix is adding a module and a line here.

Importing this package imports the fix modules, but none of them imports vLLM, torch or transformers at import time.
"""

from __future__ import annotations

from types import ModuleType

from . import (
    encoder_modes,
    hf_processor_version,
    lora_support,
    lora_tower,
    mm_placeholders,
    placeholder_guard,
    processor_mode,
    qkv_guard,
    qkv_loader,
    quant_method,
    quantized_vision,
    request_kwargs,
    video_budget,
    video_image_id_cache,
    video_loader,
    video_tower,
)

#: The fixes, in the order the post-import hook applies them.
REGISTRY: tuple[ModuleType, ...] = (
    qkv_loader,
    qkv_guard,  # after qkv_loader: its probe reads whether the loader (which checks completeness too) is applied
    processor_mode,
    hf_processor_version,
    mm_placeholders,
    video_image_id_cache,
    encoder_modes,
    video_tower,
    video_budget,
    video_loader,
    placeholder_guard,
    request_kwargs,  # after the prompt fixes: its budget reads transformers' sizing as they leave it
    quantized_vision,
    quant_method,
    lora_support,
    lora_tower,  # after lora_support: the adapters it refuses are loaded by the LoRA it declares
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


__all__ = ["REGISTRY", "by_name", "names"]
