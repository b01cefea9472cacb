"""One clear start-up error for a MiniCPM-V 4.6 checkpoint quantized with a method this vLLM lacks.

What breaks
-----------
vLLM 0.27 removed bitsandbytes; a ``MiniCPM-V-4.6-BNB`` checkpoint (``quantization_config.quant_method ==
"bitsandbytes"``) then stops ``ModelConfig`` with ``Unknown quantization method: bitsandbytes. Must be one of [...
thirty names ...]``, which says neither what the checkpoint is nor what would load.

What the fix does
-----------------
It wraps ``vllm.config.model.ModelConfig._verify_quantization`` (where that error is raised, 0.22-0.33): when it
fails for a MiniCPM-V 4.6 / 4.7 checkpoint whose ``quant_method`` this vLLM does not know, it raises one
``ValueError`` naming the checkpoint, its ``quant_method`` and the layouts that do load here. Any other outcome, and
any other model's, is vLLM's, unchanged. vLLM imports the model module (and so runs the post-import hook) inside
``ModelConfig.__post_init__`` -- the multimodal registry resolves the model class -- before it calls
``_verify_quantization``, so the wrapper is in place for the very ``ModelConfig`` that reads the checkpoint.

The decision
------------
:func:`probe`: ``broken`` where the installed vLLM's quantization registry lacks ``bitsandbytes``, ``correct`` where
it has it or where this fix's wrapper is in place, ``unrecognised`` where ``_verify_quantization`` is not there.

Upstream
--------
none known.

Remove when
-----------
its probe finds ``bitsandbytes`` in the installed quantization registry on every release the hotfix supports.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .. import decision
from ._base import V46, V47, patched_by, resolve, wrap

NAME = "unsupported_quant_method"
LABEL = "quantization method check"
TARGET = "vllm.config.model:ModelConfig._verify_quantization"
MODELS = (V46, V47)
#: Matters only for these checkpoints: doctor reports it unapplied as WARN, not FAIL (``doctor --model`` judges a
#: given checkpoint).
SCOPE = "quantized checkpoints"

#: The method whose removal this fix explains (probe: is it among the installed vLLM's quantization methods?).
REMOVED_METHOD = "bitsandbytes"
MODEL_TYPES = ("minicpmv4_6", "minicpmv4_7")
WORKING_LAYOUTS = (
    "GPTQ of the language model with a bf16 vision tower, vit_merger and merger (quant_method 'gptq', e.g. "
    "openbmb/MiniCPM-V-4.6-GPTQ)",
    "AWQ likewise (quant_method 'awq', e.g. openbmb/MiniCPM-V-4.6-AWQ)",
    "the unquantized bf16 checkpoint (openbmb/MiniCPM-V-4.6)",
)


def known_methods() -> list[str]:
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return list(QUANTIZATION_METHODS)


def _is_minicpm(hf_config: Any) -> bool:
    if getattr(hf_config, "model_type", None) in MODEL_TYPES:
        return True
    return any(str(a).startswith(("MiniCPMV4_6", "MiniCPMV4_7")) for a in getattr(hf_config, "architectures", None) or ())


def _member(hf_config: Any) -> str:
    """The family member a checkpoint's config names (its architecture or ``model_type``): "MiniCPM-V 4.7" for
    ``MiniCPMV4_7*`` / ``minicpmv4_7``, else "MiniCPM-V 4.6"."""
    names = [str(a) for a in getattr(hf_config, "architectures", None) or ()]
    names.append(str(getattr(hf_config, "model_type", "") or ""))
    return V47 if any("4_7" in n for n in names) else V46


def _quant_cfg(model_config: Any) -> dict | None:
    for owner in (getattr(model_config, "model_arch_config", None), getattr(model_config, "hf_config", None)):
        cfg = getattr(owner, "quantization_config", None)
        if isinstance(cfg, dict) and cfg:
            return cfg
    return None


def explain(model: str, method: str, known: list[str], version: str, member: str = V46) -> str:
    """The message: the checkpoint, its ``quant_method``, that this vLLM lacks it, and what loads instead."""
    return (
        f"{member} checkpoint {model} is quantized with quant_method={method!r} (its config.json "
        f"quantization_config), which vLLM {version} does not support ({method} is not among its quantization "
        f"methods: {', '.join(sorted(known))}). Layouts that load on this vLLM with vllm-minicpm-hotfix: "
        + "; ".join(WORKING_LAYOUTS)
        + "."
    )


def checkpoint_member(model_config: Any, *_: Any) -> str | None:
    """The family member a ``ModelConfig``'s checkpoint is (the class policy's subject), or None for other models."""
    hf_config = getattr(model_config, "hf_config", None)
    return _member(hf_config) if _is_minicpm(hf_config) else None


def verify_quantization(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``ModelConfig._verify_quantization(self)``: vLLM's error for an unknown method re-raised with
    :func:`explain`; anything else as vLLM answers."""
    try:
        return wrapped(*args, **kwargs)
    except Exception as exc:
        try:
            cfg = _quant_cfg(instance)
            method = str((cfg or {}).get("quant_method", "") or "")
            known = known_methods()
            relevant = bool(method) and method not in known and method in str(exc)
        except Exception:  # noqa: BLE001 - explaining must never hide vLLM's own error
            relevant = False
        if not relevant:
            raise
        from ..record import installed_vllm_version

        raise ValueError(explain(str(getattr(instance, "model", "?")), method, known, installed_vllm_version(),
                                 checkpoint_member(instance))) from exc


PATCHES = {TARGET: wrap(verify_quantization, model=checkpoint_member)}


def probe(module: ModuleType) -> decision.Verdict:
    """``BROKEN`` where the installed vLLM's quantization registry lacks ``bitsandbytes`` (a 4.6 bnb checkpoint then
    fails with vLLM's generic unknown-method error), ``CORRECT`` where it has it or where this fix's wrapper is in
    place. Never raises."""
    try:
        owner = resolve(module, TARGET)
        if owner is None:
            return decision.Verdict(decision.State.UNRECOGNISED, f"{TARGET} not found")
        if patched_by(*owner) == NAME:
            return decision.Verdict(decision.State.CORRECT, "unknown quantization methods of 4.6 checkpoints are explained")
        known = known_methods()
    except Exception as exc:  # noqa: BLE001
        return decision.Verdict(decision.State.UNDETERMINED, f"probe failed: {type(exc).__name__}: {exc}")
    if REMOVED_METHOD in known:
        return decision.Verdict(decision.State.CORRECT, f"this vLLM still has {REMOVED_METHOD}")
    return decision.Verdict(
        decision.State.BROKEN,
        f"this vLLM has no {REMOVED_METHOD}: a MiniCPM-V 4.6 {REMOVED_METHOD} checkpoint fails with a bare "
        f"'Unknown quantization method' listing {len(known)} methods",
    )
