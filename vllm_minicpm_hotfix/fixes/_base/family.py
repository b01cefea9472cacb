"""The model family: which vLLM classes are whose, the vLLM class names the fixes patch, and the class policy every
wrapper the framework builds applies before a fix's behaviour runs.

vLLM 0.32+ defines MiniCPM-V 4.7's classes (``vllm/model_executor/models/minicpmv4_7.py``) as subclasses of the 4.6
classes of ``minicpmv4_6.py``, so a value set on a 4.6 class also runs for 4.7 instances. A fix declares the members
it applies to (``MODELS``); :func:`covers` says whether it acts for one instance, judged by the module that defines
the instance's *own* class: declared members act, a subclass in a module no member owns (a future 4.8) is reported
once (:func:`note_unknown`) and handed to vLLM's code, an undeclared member's class is left to vLLM's code.
Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

from ...record import current, logger

#: vLLM's model module of each family member -> the member's name in messages (the first present of a member's is
#: its module: vLLM's own, else the hotfix's backport of it).
FAMILY: dict[str, str] = {
    "vllm.model_executor.models.minicpmv4_6": "MiniCPM-V 4.6",
    "vllm.model_executor.models.minicpmv4_7": "MiniCPM-V 4.7",
    "vllm_minicpm_hotfix.backports.models.minicpmv4_7": "MiniCPM-V 4.7",  # the backport's, on releases without 4.7
    "vllm.model_executor.models.minicpm_ocr": "MiniCPM-OCR",  # vLLM 0.33+
    "vllm_minicpm_hotfix.backports.models.minicpm_ocr": "MiniCPM-OCR",  # the backport's, where transformers has OCR
}
V46, V47, VOCR = "MiniCPM-V 4.6", "MiniCPM-V 4.7", "MiniCPM-OCR"
#: Default ``MODELS`` of a fix that declares none: 4.6 only.
DEFAULT_MODELS: tuple[str, ...] = (V46,)

#: The classes of vLLM's ``minicpmv4_6.py`` (0.22-0.33) the fixes patch, by role; every fix names them from here.
MODEL_CLASS = "MiniCPMV4_6ForConditionalGeneration"
INFO_CLASS = "MiniCPMV4_6ProcessingInfo"
PROCESSOR_CLASS = "MiniCPMV4_6MultiModalProcessor"
ATTN_CLASS = "MiniCPMV4_6ViTWindowAttentionSelfAttn"
#: vLLM 0.32+'s own MiniCPM-V 4.7 model module and model class (what a fix of 4.7's own code patches).
V47_MODULE = "vllm.model_executor.models.minicpmv4_7"
V47_MODEL_CLASS = "MiniCPMV4_7ForConditionalGeneration"


def model_of(obj: Any) -> str | None:
    """The family member (``"MiniCPM-V 4.6"``, ...) that ``obj`` -- a vLLM model, processing info or multimodal
    processor instance, or such a class -- belongs to, by the module of its *own* class (not an ancestor's); None for
    a class no member owns."""
    cls = obj if isinstance(obj, type) else type(obj)
    return FAMILY.get(getattr(cls, "__module__", ""))


def base_named(obj: Any, name: str) -> type | None:
    """The class called ``name`` (a vLLM 4.6 class, e.g. :data:`PROCESSOR_CLASS`) among the ancestors of ``obj`` (an
    instance or a class, itself included), nearest first; None if it has none."""
    cls = obj if isinstance(obj, type) else type(obj)
    return next((c for c in cls.__mro__ if c.__name__ == name), None)


def models_of(fix: ModuleType) -> tuple[str, ...]:
    """The family members ``fix`` declares (its ``MODELS``; :data:`DEFAULT_MODELS` if it declares none)."""
    return tuple(getattr(fix, "MODELS", DEFAULT_MODELS))


def class_name(cls: type) -> str:
    """``module.QualName`` of a class: the key of an undeclared subclass in ``status()["fixes"][NAME]["models"]``."""
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------------------------------------------------------
# The class policy
# --------------------------------------------------------------------------------------------------------------------

#: fix NAME -> the members it acts for in this process (those whose own verdict and the mode chose to apply it, set
#: by the runner); a fix applied outside the runner (a test calling ``apply``) acts for all it declares.
_ACTIVE: dict[str, frozenset[str]] = {}

#: (fix NAME, class) pairs already reported as an undeclared subclass in this process (logged once each).
_REPORTED: set[tuple[str, type]] = set()


def covers(fix: ModuleType, subject: Any) -> bool:
    """Whether ``fix`` acts for ``subject``: an instance or class (its own class's member), or a member's name. The
    member must be one ``fix`` declares and, for a fix the hook ran, one it chose to apply to. A class no member
    owns is reported once (:func:`note_unknown`); None (nothing to judge) is not covered."""
    if subject is None:
        return False
    if isinstance(subject, str):
        member = subject
    else:  # model_of(subject), inlined: every wrapped call of a request asks
        cls = subject if isinstance(subject, type) else type(subject)
        member = FAMILY.get(getattr(cls, "__module__", ""))
    if member is None:
        note_unknown(fix, subject)
        return False
    active = _ACTIVE.get(fix.NAME)
    return member in (active if active is not None else models_of(fix))


def undeclared_row(fix: ModuleType, cls: type, base: type) -> dict[str, Any]:
    """The ``status()`` row of a subclass ``cls`` of vLLM's ``base`` that no member owns."""
    return {
        "declared": False, "verdict": "n/a", "reason": "", "applied": False, "unknown": True,
        "why": (f"{class_name(cls)} subclasses vLLM's {base.__name__} but is no member of the family this hotfix "
                f"knows ({', '.join(dict.fromkeys(FAMILY.values()))}); {fix.NAME} does not cover it: its instances get vLLM's own "
                "code"),
    }


def note_unknown(fix: ModuleType, obj: Any) -> None:
    """Record (in ``status()``, under the fix's ``models``) and log once that ``fix``'s wrapper was reached by an
    instance of a subclass of a family class that no member owns, and handed it to vLLM; a class of no family at all
    (another model a resolver named) is simply not covered. Never raises."""
    try:
        cls = obj if isinstance(obj, type) else type(obj)
        base = next((b for b in cls.__mro__[1:] if b.__module__ in FAMILY), None)
        if base is None or (fix.NAME, cls) in _REPORTED:
            return
        _REPORTED.add((fix.NAME, cls))
        row = undeclared_row(fix, cls, base)
        entry = current().fixes.get(fix.NAME)
        if entry is not None:
            entry.models[class_name(cls)] = row
        logger.warning("vllm-minicpm-hotfix: %s", row["why"])
    except Exception:  # noqa: BLE001 - reporting must never break vLLM's call
        pass


# --------------------------------------------------------------------------------------------------------------------
# The members present in this process, and the views a probe judges them on
# --------------------------------------------------------------------------------------------------------------------

#: Model modules whose body has run to its end (their post-import hook fired): importlib keeps
#: ``__spec__._initializing`` set until its loader returns, which is after wrapt's post-import hooks ran.
_COMPLETE: set[str] = set()


def mark_complete(mod_name: str) -> None:
    """Record that ``mod_name``'s body has been executed to its end (called from its post-import hook)."""
    _COMPLETE.add(mod_name)


def initialising(mod_name: str) -> bool:
    """Whether ``mod_name`` is in ``sys.modules`` but its body is still being executed (importlib's
    ``__spec__._initializing``, unless :func:`mark_complete` said otherwise): its classes may not exist yet."""
    mod = sys.modules.get(mod_name)
    if mod is None or mod_name in _COMPLETE:
        return False
    return bool(getattr(getattr(mod, "__spec__", None), "_initializing", False))


def imported_member(mod_name: str) -> ModuleType | None:
    """The member model module ``mod_name`` if vLLM has finished importing it in this process, else None (never
    imports anything)."""
    mod = sys.modules.get(mod_name)
    return None if mod is None or initialising(mod_name) else mod


def _import_member(mod_name: str) -> ModuleType | None:
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    try:
        if importlib.util.find_spec(mod_name) is None:
            return None
        return importlib.import_module(mod_name)
    except Exception:  # noqa: BLE001 - a member module that does not import is not served by this vLLM anyway
        return None


def member_modules(module: ModuleType, *, imported_only: bool = False) -> dict[str, ModuleType]:
    """The family members present in this vLLM, each as the module a fix's probe runs on: ``module`` (vLLM's 4.6
    model module) for its own member and, for every other member whose model module exists here (imported now if
    vLLM has not yet), a :func:`member_view`. Never raises: a member module that fails to import is left out.

    ``imported_only`` (the post-import hook and first-use probes): only the members whose model module vLLM has
    finished importing in this process (:func:`imported_member`). A process serving 4.6 never imports
    ``minicpmv4_7``; one serving 4.7 imports ``minicpmv4_7``, which imports ``minicpmv4_6`` first -- the hook then
    runs at the end of that import (``hook.on_member_import``)."""
    own = FAMILY.get(module.__name__, DEFAULT_MODELS[0])
    out: dict[str, ModuleType] = {own: module}
    for mod_name, member in FAMILY.items():
        if member in out:
            continue
        other = imported_member(mod_name) if imported_only else _import_member(mod_name)
        if other is not None:
            out[member] = member_view(module, other)
    return out


def member_view(module: ModuleType, other: ModuleType) -> ModuleType:
    """A module named as ``other`` holding everything of ``module``, except that each class of ``module`` that
    ``other`` subclasses is ``other``'s class: same name with ``other``'s member tag (``4_6`` -> ``4_7``), or, for a
    member named otherwise, the subclass whose name ends as the 4.6 name does after ``MiniCPMV4_6``
    (``MiniCPMV4_6ProcessingInfo`` -> ``MiniCPMOcrProcessingInfo``). A probe written against the 4.6 names thereby
    judges the member's own classes."""
    tag = module.__name__.rsplit("minicpmv", 1)[-1]
    other_tag = other.__name__.rsplit("minicpmv", 1)[-1] if "minicpmv" in other.__name__ else None
    prefix = f"MiniCPMV{tag}"
    classes = [v for v in vars(other).values() if isinstance(v, type)]
    view = ModuleType(other.__name__)
    swapped: dict[str, str] = {}
    view.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    for name, value in vars(module).items():
        if not (isinstance(value, type) and tag in name):
            continue
        if other_tag is not None:
            sub = getattr(other, name.replace(tag, other_tag), None)
        else:
            suffix = name[len(prefix):] if name.startswith(prefix) else None
            sub = next((c for c in classes if suffix and c.__name__.endswith(suffix) and c is not value
                        and issubclass(c, value)), None)
        if isinstance(sub, type) and issubclass(sub, value):
            setattr(view, name, sub)
            swapped[name] = sub.__name__
    view.__member_module__ = other
    view.__member_names__ = swapped
    return view


#: The package of the backports' model modules (a member whose module is here runs the hotfix's classes).
BACKPORT_MODELS = "vllm_minicpm_hotfix.backports.models."


def member_reason(view: ModuleType, reason: str) -> str:
    """A probe's ``reason`` as it reads for the member ``view`` stands for: the vLLM classes the view swapped named as
    that member's and "MiniCPM-V 4.6" as the member; unchanged for a module that is not a view. For a member the
    hotfix's backport registered (its module under :data:`BACKPORT_MODELS`), the text starts by saying so: its
    classes are the hotfix's, so "vLLM's own" code in the probe's words is the backport's code where it overrides
    the 4.6 class and vLLM's 4.6 code where it inherits it."""
    names = getattr(view, "__member_names__", None)
    if not names:
        return reason
    for old, new in names.items():
        reason = reason.replace(old, new)
    member = FAMILY.get(view.__name__, DEFAULT_MODELS[0])
    reason = reason.replace(DEFAULT_MODELS[0], member)
    if view.__name__.startswith(BACKPORT_MODELS):
        note = f"{member} by the hotfix's backport (vLLM has none here)"
        head, sep, rest = reason.partition(": ") if reason.startswith("not needed") else ("", "", reason)
        reason = f"{head}{sep}{note}: {rest}"
    return reason
