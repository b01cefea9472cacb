"""What every backport's probe, registration and undo share: a lazy ``module:Class`` entry in vLLM's
``ModelRegistry`` for an architecture the installed vLLM lacks, built on the 4.6 model it has, for a checkpoint whose
config the installed transformers reads.

A backport module (:mod:`vllm_minicpm_hotfix.backports`) holds one :class:`LazyBackport` and exposes its ``probe``,
``register`` and ``unregister`` as the module's functions. Nothing here imports vLLM, torch or transformers at import
time.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from ..decision import State, Verdict

#: vLLM's registry module (``ModelRegistry``), where the hook runs the backports (``hook.REGISTRY_MODULE``).
REGISTRY_MODULE = "vllm.model_executor.models.registry"
#: What every backport builds on: MiniCPM-V 4.6's architecture in vLLM's registry and its model module.
BASE_ARCH = "MiniCPMV4_6ForConditionalGeneration"
BASE_MODULE = "vllm.model_executor.models.minicpmv4_6"


@dataclass
class LazyBackport:
    """One architecture registered lazily: ``arch`` resolved to ``model_module:arch``, where vLLM's registry has no
    ``arch`` of its own, has :data:`BASE_ARCH`, and transformers' auto mapping has ``config_class`` under
    ``model_type``. ``short`` names the member in the probe's reasons ("4.7", "MiniCPM-OCR")."""

    arch: str
    model_module: str
    config_class: str
    model_type: str
    short: str
    #: What the registry held under ``arch`` before :meth:`register` (restored by :meth:`unregister`).
    before: list[Any] = field(default_factory=list)

    @property
    def model(self) -> str:
        """What :meth:`register` hands ``ModelRegistry.register_model``: ``"module:Class"``."""
        return f"{self.model_module}:{self.arch}"

    def entry(self, registry: Any) -> Any:
        """What the registry holds under ``arch`` (a ``_LazyRegisteredModel`` / ``_RegisteredModel``), or None."""
        models = getattr(registry, "models", None)
        return models.get(self.arch) if isinstance(models, dict) else None

    def is_ours(self, entry: Any) -> bool:
        """Whether a registry entry is this backport (by any copy of the package: same module name)."""
        return entry is not None and where(entry).partition(":")[0] == self.model_module

    def registered(self, module: ModuleType | None = None) -> bool:
        """Whether vLLM's registry resolves ``arch`` to the backport now."""
        return self.is_ours(self.entry(registry_of(module)))

    def probe(self, module: ModuleType | None = None) -> Verdict:
        """``missing`` where the registry lacks ``arch``, has the 4.6 model and transformers has the config;
        ``correct`` (not applicable) where the registry has ``arch`` of vLLM's own or another plugin's;
        ``unrecognised`` where the 4.6 model or the config is not there (vLLM's own ``arch`` included: vLLM cannot
        read such a checkpoint either). Never raises."""
        try:
            registry = registry_of(module)
            entry = self.entry(registry)
            if entry is not None and not self.is_ours(entry):
                at = where(entry)
                if at.startswith("vllm."):
                    has_config, tf_version = transformers_has(self.model_type, self.config_class)
                    if not has_config:  # vLLM 0.33's MiniCPM-OCR with the transformers it requires (< 5.21)
                        return Verdict(State.UNRECOGNISED, f"transformers {tf_version} has no {self.config_class}, "
                                       f"which vLLM's own {self.arch} needs to read a {self.short} checkpoint's "
                                       f"config ({at})", applicable=False)
                    return Verdict(State.CORRECT, f"vLLM's own: its registry has {self.arch} ({at})", applicable=False)
                return Verdict(State.CORRECT, f"{self.arch} is registered by {at} (not vLLM's own, not this "
                               "hotfix's): left alone", applicable=False)
            if BASE_ARCH not in registry.get_supported_archs() or importlib.util.find_spec(BASE_MODULE) is None:
                return Verdict(State.UNRECOGNISED, f"vLLM has no {BASE_ARCH} ({BASE_MODULE}) for {self.short} to "
                               "build on", applicable=False)
            has_config, tf_version = transformers_has(self.model_type, self.config_class)
            if not has_config:
                return Verdict(State.UNRECOGNISED, f"transformers {tf_version} has no {self.config_class}: a "
                               f"{self.short} checkpoint's config cannot be read", applicable=False)
            return Verdict(State.MISSING, f"vLLM's registry has no {self.arch}; it has {BASE_ARCH} and transformers "
                           f"{tf_version} has {self.config_class}")
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            return Verdict(State.UNDETERMINED, f"probe failed: {type(exc).__name__}: {exc}", applicable=False)

    def register(self, module: ModuleType | None = None) -> None:
        """``ModelRegistry.register_model(arch, model)`` (vLLM's public API, the lazy form); keeps what was there for
        :meth:`unregister`. Idempotent. Raises what ``register_model`` raises."""
        registry = registry_of(module)
        entry = self.entry(registry)
        if self.is_ours(entry):
            return
        self.before[:] = [entry]
        registry.register_model(self.arch, self.model)

    def unregister(self, module: ModuleType | None = None) -> bool:
        """Undo :meth:`register`: the registry holds under ``arch`` what it held before. Returns whether the backport
        was registered. The model module, if vLLM imported it, stays imported (its processor registration is keyed by
        its own class, which nothing resolves any more)."""
        registry = registry_of(module)
        if not self.is_ours(self.entry(registry)):
            return False
        before = self.before[0] if self.before else None
        if before is None:
            del registry.models[self.arch]
        else:
            registry.models[self.arch] = before
        self.before.clear()
        return True


def bind(namespace: dict[str, Any], backport: LazyBackport) -> None:
    """Give a backport module (its ``globals()``) the backport interface bound to ``backport``: ``MODEL`` (what
    ``register`` hands vLLM), ``probe(module=None) -> Verdict`` (never raises), ``register(module=None)``,
    ``unregister(module=None) -> bool``, ``registered(module=None) -> bool``, ``is_ours(entry) -> bool``; ``module``
    is vLLM's registry module (imported if None). Also ``REGISTRY_MODULE``, ``BASE_ARCH``, ``BASE_MODULE``."""
    namespace.update(MODEL=backport.model, probe=backport.probe, register=backport.register,
                     unregister=backport.unregister, registered=backport.registered, is_ours=backport.is_ours,
                     REGISTRY_MODULE=REGISTRY_MODULE, BASE_ARCH=BASE_ARCH, BASE_MODULE=BASE_MODULE)


def registry_of(module: ModuleType | None) -> Any:
    """vLLM's ``ModelRegistry`` from its registry module (imported if None), or ``module`` itself if it is one."""
    if module is None:
        module = sys.modules.get(REGISTRY_MODULE) or importlib.import_module(REGISTRY_MODULE)
    return getattr(module, "ModelRegistry", module)


def where(entry: Any) -> str:
    """``module:Class`` of a registry entry (lazy: its names; eager: its class)."""
    module = getattr(entry, "module_name", None)
    if module is None:
        cls = getattr(entry, "model_cls", None) or getattr(entry, "interfaces", None)
        cls = cls if isinstance(cls, type) else type(entry)
        return f"{cls.__module__}:{cls.__qualname__}"
    return f"{module}:{getattr(entry, 'class_name', '?')}"


def transformers_has(model_type: str, config_class: str) -> tuple[bool, str]:
    """Whether the installed transformers has ``config_class`` for ``model_type``, and its version. transformers'
    own auto mapping (``CONFIG_MAPPING_NAMES``, which ``AutoConfig`` reads a ``config.json`` with) answers where vLLM
    has imported it already (it has, by the time its model registry is imported: a dict look-up); else the class
    itself is looked up (imports its configuration module, ~5 ms)."""
    try:
        import transformers

        version = str(getattr(transformers, "__version__", "?"))
        auto = sys.modules.get("transformers.models.auto.configuration_auto")
        names = getattr(auto, "CONFIG_MAPPING_NAMES", None)
        if isinstance(names, dict):
            return names.get(model_type) == config_class, version
        return hasattr(transformers, config_class), version
    except Exception as exc:  # noqa: BLE001 - no transformers: nothing can read the config
        return False, f"(not importable: {type(exc).__name__})"
