"""Backport: MiniCPM-V 4.7 (``MiniCPMV4_7ForConditionalGeneration``, dense 1B and MoE 35B-A3B) on vLLM releases that
lack it.

What is missing
---------------
Only vLLM 0.32+ registers ``MiniCPMV4_7ForConditionalGeneration`` (``vllm/model_executor/models/minicpmv4_7.py``).
On 0.22-0.31 ``LLM(model=<a 4.7 checkpoint>)`` and ``vllm serve`` stop at start-up with ``Model architectures
['MiniCPMV4_7ForConditionalGeneration'] are not supported for now``, although those releases have the 4.6 classes
4.7 builds on and transformers (>= 5.19) reads a 4.7 checkpoint (``MiniCPMV4_7Config``, ``MiniCPMV4_7Processor``).

What the backport does
----------------------
:func:`register` registers the architecture through vLLM's public model registry, in the lazy form plugins use:
``ModelRegistry.register_model(ARCH, "vllm_minicpm_hotfix.backports.models.minicpmv4_7:MiniCPMV4_7ForConditionalGeneration")``.
vLLM imports that module only when it resolves a 4.7 checkpoint; its model class registers its multimodal processor
with ``MULTIMODAL_REGISTRY.register_processor`` as vLLM's own models do (:mod:`.models.minicpmv4_7`). Every fix of
this package then acts for 4.7 as it does on 0.32 (``fixes._base.FAMILY`` names the module as MiniCPM-V 4.7).

The decision
------------
:func:`probe` reads what is installed, never a version string: ``missing`` (register) where the installed vLLM's
``ModelRegistry`` has no ``MiniCPMV4_7ForConditionalGeneration`` of its own, has the 4.6 model it builds on, and the
installed transformers has ``MiniCPMV4_7Config``; ``correct`` and not applicable where the registry already has the
architecture ("vLLM's own" on 0.32+, or another plugin's: left alone, under ``force`` too); ``unrecognised`` where the
4.6 model or transformers' 4.7 config is not there. An entry this backport registered is not vLLM's own: the verdict
stays ``missing`` once registered.

The backport interface (:mod:`vllm_minicpm_hotfix.backports`): ``NAME``, ``LABEL``, ``ARCH``, ``MEMBER``,
:func:`probe`, :func:`register`, :func:`unregister`. Nothing here imports vLLM, torch or transformers at import time.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

from ..decision import State, Verdict

NAME = "minicpmv4_7"
LABEL = "MiniCPM-V 4.7 model (MiniCPMV4_7ForConditionalGeneration) on vLLM releases without it"
ARCH = "MiniCPMV4_7ForConditionalGeneration"
MEMBER = "MiniCPM-V 4.7"
#: The backport's model module (the one vLLM's registry imports lazily; ``fixes._base.FAMILY`` lists it).
MODEL_MODULE = "vllm_minicpm_hotfix.backports.models.minicpmv4_7"
#: What :func:`register` hands ``ModelRegistry.register_model``.
MODEL = f"{MODEL_MODULE}:{ARCH}"
#: vLLM's registry module (``ModelRegistry``), where the hook runs the backports (``hook.REGISTRY_MODULE``).
REGISTRY_MODULE = "vllm.model_executor.models.registry"
#: What 4.7 builds on: its architecture in vLLM's registry and its model module.
BASE_ARCH = "MiniCPMV4_6ForConditionalGeneration"
BASE_MODULE = "vllm.model_executor.models.minicpmv4_6"
#: transformers' config class a 4.7 checkpoint's ``config.json`` needs.
CONFIG_CLASS = "MiniCPMV4_7Config"

#: What the registry held under ARCH before :func:`register` (restored by :func:`unregister`).
_BEFORE: list[Any] = []


def _registry(module: ModuleType | None) -> Any:
    if module is None:
        module = sys.modules.get(REGISTRY_MODULE) or importlib.import_module(REGISTRY_MODULE)
    return getattr(module, "ModelRegistry", module)  # the registry module, or the registry itself


def _entry(registry: Any) -> Any:
    """What the registry holds under ARCH (a ``_LazyRegisteredModel`` / ``_RegisteredModel``), or None."""
    models = getattr(registry, "models", None)
    return models.get(ARCH) if isinstance(models, dict) else None


def _where(entry: Any) -> str:
    """``module:Class`` of a registry entry (lazy: its names; eager: its class)."""
    module = getattr(entry, "module_name", None)
    if module is None:
        cls = getattr(entry, "model_cls", None) or getattr(entry, "interfaces", None)
        cls = cls if isinstance(cls, type) else type(entry)
        return f"{cls.__module__}:{cls.__qualname__}"
    return f"{module}:{getattr(entry, 'class_name', '?')}"


def is_ours(entry: Any) -> bool:
    """Whether a registry entry is this package's backport (by any copy of the package: same module name)."""
    return entry is not None and _where(entry).partition(":")[0] == MODEL_MODULE


def registered(module: ModuleType | None = None) -> bool:
    """Whether vLLM's registry resolves ARCH to the backport now."""
    return is_ours(_entry(_registry(module)))


#: transformers' ``model_type`` of a 4.7 config (``config.json``), the key of its config in transformers' auto mapping.
MODEL_TYPE = "minicpmv4_7"


def _transformers_has_config() -> tuple[bool, str]:
    """Whether the installed transformers has ``MiniCPMV4_7Config``, and its version. transformers' own auto mapping
    (``CONFIG_MAPPING_NAMES``, which ``AutoConfig`` reads a ``config.json`` with) answers where vLLM has imported it
    already (it has, by the time its model registry is imported: no import here, a dict look-up); else the class
    itself is looked up (imports its configuration module, ~5 ms)."""
    try:
        import transformers

        version = str(getattr(transformers, "__version__", "?"))
        auto = sys.modules.get("transformers.models.auto.configuration_auto")
        names = getattr(auto, "CONFIG_MAPPING_NAMES", None)
        if isinstance(names, dict):
            return names.get(MODEL_TYPE) == CONFIG_CLASS, version
        return hasattr(transformers, CONFIG_CLASS), version
    except Exception as exc:  # noqa: BLE001 - no transformers: nothing can read a 4.7 config
        return False, f"(not importable: {type(exc).__name__})"


def probe(module: ModuleType | None = None) -> Verdict:
    """Whether the installed vLLM lacks ``MiniCPMV4_7ForConditionalGeneration`` and can be given it (see the module
    docstring). ``module``: vLLM's registry module (imported if None). Never raises."""
    try:
        registry = _registry(module)
        entry = _entry(registry)
        if entry is not None and not is_ours(entry):
            where = _where(entry)
            if where.startswith("vllm."):
                return Verdict(State.CORRECT, f"vLLM's own: its registry has {ARCH} ({where})", applicable=False)
            return Verdict(State.CORRECT, f"{ARCH} is registered by {where} (not vLLM's own, not this hotfix's): left "
                           "alone", applicable=False)
        archs = registry.get_supported_archs()
        if BASE_ARCH not in archs or importlib.util.find_spec(BASE_MODULE) is None:
            return Verdict(State.UNRECOGNISED, f"vLLM has no {BASE_ARCH} ({BASE_MODULE}) for 4.7 to build on",
                           applicable=False)
        has_config, tf_version = _transformers_has_config()
        if not has_config:
            return Verdict(State.UNRECOGNISED, f"transformers {tf_version} has no {CONFIG_CLASS}: a 4.7 checkpoint's "
                           "config cannot be read", applicable=False)
        return Verdict(State.MISSING, f"vLLM's registry has no {ARCH}; it has {BASE_ARCH} and transformers "
                       f"{tf_version} has {CONFIG_CLASS}")
    except Exception as exc:  # noqa: BLE001 - a probe never raises
        return Verdict(State.UNDETERMINED, f"probe failed: {type(exc).__name__}: {exc}", applicable=False)


def register(module: ModuleType | None = None) -> None:
    """``ModelRegistry.register_model(ARCH, MODEL)`` (vLLM's public API, the lazy ``module:Class`` form); keeps what
    was there for :func:`unregister`. Idempotent. Raises what ``register_model`` raises."""
    registry = _registry(module)
    entry = _entry(registry)
    if is_ours(entry):
        return
    _BEFORE[:] = [entry]
    registry.register_model(ARCH, MODEL)


def unregister(module: ModuleType | None = None) -> bool:
    """Undo :func:`register`: the registry holds under ARCH what it held before (nothing, on 0.22-0.31). Returns
    whether the backport was registered. The model module, if vLLM imported it, stays imported (its processor
    registration is keyed by its own class, which nothing resolves any more)."""
    registry = _registry(module)
    if not is_ours(_entry(registry)):
        return False
    before = _BEFORE[0] if _BEFORE else None
    if before is None:
        del registry.models[ARCH]
    else:
        registry.models[ARCH] = before
    _BEFORE.clear()
    return True
