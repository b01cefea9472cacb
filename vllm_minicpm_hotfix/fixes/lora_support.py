"""Declare LoRA support on the 4.6 model class, as vLLM 0.25+ does, so that ``--enable-lora`` starts.

What breaks
-----------
vLLM's model runner refuses LoRA for a model class that its ``supports_lora`` (``vllm/model_executor/models/
interfaces.py``: ``isinstance`` against the ``SupportsLoRA`` protocol) rejects: ``LoRAModelRunnerMixin.load_lora_model``
(``vllm/v1/worker/lora_model_runner_mixin.py``) raises ``ValueError: MiniCPMV4_6ForConditionalGeneration does not
support LoRA yet.`` at start-up, so ``LLM(..., enable_lora=True)`` and ``vllm serve --enable-lora`` fail on 0.22-0.24.
vLLM 0.25 (#46740) adds ``SupportsLoRA`` to the class's bases and changes nothing else in the class: its
``packed_modules_mapping`` (``qkv_proj``, ``gate_up_proj``, ``in_proj_qkvz``, ``in_proj_ba``) and ``get_mm_mapping``
(language model ``language_model``, connector ``vit_merger`` + ``merger``, tower ``vpm``), which the LoRA manager
reads, are the same in 0.22-0.24 already, and so is the LoRA machinery that reads them (``LoRAModelManager``,
``enable_tower_connector_lora``, ``SupportsMultiModal.get_num_mm_encoder_tokens``).

What the fix does
-----------------
It sets on ``MiniCPMV4_6ForConditionalGeneration`` what inheriting ``SupportsLoRA`` gives the class in 0.25+: the
protocol's members the class does not define yet (``supports_lora = True`` and, as the installed protocol declares
them, ``embedding_modules = {}``, ``is_3d_moe_weight = False``, ``is_non_gated_moe = False``,
``lora_skip_prefixes = []``, each the protocol's own default, a fresh copy of a dict or list; ``lora_manager = None``
where the protocol only annotates it, 0.24+, until vLLM's ``LoRAModelManager`` sets it on the instance). The class's
``packed_modules_mapping`` and ``get_mm_mapping`` stay vLLM's. 4.7 (vLLM 0.32+) inherits ``SupportsLoRA`` itself.

The decision
------------
:func:`probe` asks the installed ``supports_lora`` about the class: ``broken`` if it says no (0.22-0.24),
``correct`` if yes (0.25+), for the class and for an instance (created without ``__init__``: the model runner
checks the built model, which on 0.24 must also have ``lora_manager``); ``unrecognised`` (not applicable) if the class, vLLM's ``SupportsLoRA`` or
``supports_lora``, or the class's ``packed_modules_mapping`` / ``get_mm_mapping`` (without which no LoRA manager can
wrap the model) are not there.

Upstream
--------
vllm-project/vllm#46740: 0.25 adds ``SupportsLoRA`` to the 4.6 class's bases (docs/lora.md).

Remove when
-----------
its probe sees the installed ``supports_lora`` accept the class and an instance on every release the hotfix supports:
once 0.22-0.24 are no longer supported.

"""

from __future__ import annotations

import copy
import importlib
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import MODEL_CLASS, V46, V47, attribute

NAME = "lora_support"
LABEL = "LoRA support declared on the model class (--enable-lora)"
INTERFACES = "vllm.model_executor.models.interfaces"
#: The class attributes vLLM's ``SupportsLoRA`` protocol declares (0.22-0.33); those the installed protocol has and
#: the class lacks are set.
ATTRIBUTES = ("supports_lora", "embedding_modules", "is_3d_moe_weight", "is_non_gated_moe", "lora_skip_prefixes",
              "lora_manager")
#: 4.7 subclasses the 4.6 class (vLLM 0.32+'s own, with SupportsLoRA through its base; the hotfix's backport on
#: 0.22-0.30, without it on 0.22-0.24).
MODELS = (V46, V47)
#: What the LoRA manager reads from the model besides the protocol's attributes.
NEEDS = ("packed_modules_mapping", "get_mm_mapping")


def _targets(module: ModuleType) -> tuple[type, type, Any] | str:
    cls = getattr(module, MODEL_CLASS, None)
    if not isinstance(cls, type):
        return f"{module.__name__} has no {MODEL_CLASS}"
    return _protocol_for(cls)


def _protocol_for(cls: type) -> tuple[type, type, Any] | str:
    try:
        interfaces = importlib.import_module(INTERFACES)
    except Exception as exc:  # noqa: BLE001
        return f"{INTERFACES} not importable: {type(exc).__name__}: {exc}"
    protocol, check = getattr(interfaces, "SupportsLoRA", None), getattr(interfaces, "supports_lora", None)
    if not isinstance(protocol, type) or not callable(check):
        return f"{INTERFACES} has no SupportsLoRA / supports_lora"
    missing = [n for n in NEEDS if not hasattr(cls, n)]
    if missing:
        return f"{MODEL_CLASS} has no {', '.join(missing)}: no LoRA manager can wrap it"
    return cls, protocol, check


def declared(cls: type, protocol: type) -> dict[str, Any]:
    """The protocol's members (of :data:`ATTRIBUTES`) that ``cls`` lacks -> the value to set: the protocol's own
    default, copied; None for a member it only annotates (``lora_manager``, 0.24+: vLLM's ``LoRAModelManager`` sets
    it on the instance); ``supports_lora`` (True) always, on the class itself."""
    out: dict[str, Any] = {"supports_lora": True}
    annotated = getattr(protocol, "__annotations__", {})
    for attr in ATTRIBUTES:
        if hasattr(cls, attr):
            continue
        if attr in vars(protocol):
            out.setdefault(attr, copy.copy(vars(protocol)[attr]))
        elif attr in annotated:
            out.setdefault(attr, None)
    return out


def declare(attr: str, original: Any, cls: Any) -> Any:
    """The ``PATCHES`` value for ``attr`` on the model class ``cls``: the protocol's member as an attribute of the
    declared members only (``_base.attribute``), or None where ``cls`` has it already (or the installed protocol
    lacks it). Raises ``RuntimeError`` if ``cls`` is no class a LoRA manager can wrap (see :func:`probe`), before
    anything is set."""
    found = _protocol_for(cls) if isinstance(cls, type) else f"{MODEL_CLASS} is not a class"
    if isinstance(found, str):
        raise RuntimeError(found)
    values = declared(cls, found[1])
    return attribute(values[attr]) if attr in values else None


#: Each attribute the installed protocol declares and the class lacks (:func:`declare`).
PATCHES = {f"{MODEL_CLASS}.{attr}": lambda old, owner, attr=attr: declare(attr, old, owner) for attr in ATTRIBUTES}


def probe(module: ModuleType) -> Verdict:
    """Does vLLM's ``supports_lora`` accept the 4.6 model class? Never raises; changes nothing."""
    found = _targets(module)
    if isinstance(found, str):
        return Verdict(State.UNRECOGNISED, found, applicable=False)
    cls, _, check = found
    try:
        # The class, and an instance (created without __init__) as the model runner checks the built model.
        ok = bool(check(cls)) and bool(check(object.__new__(cls)))
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"supports_lora({MODEL_CLASS}) failed: {type(exc).__name__}: {exc}")
    if not ok:
        return Verdict(State.BROKEN, f"vLLM's supports_lora rejects {MODEL_CLASS}: --enable-lora fails at start-up "
                                     f"({MODEL_CLASS} does not support LoRA yet)")
    return Verdict(State.CORRECT, f"vLLM's supports_lora accepts {MODEL_CLASS}")
