"""The machinery every fix shares: run one fix (mode, probe, decision, apply, record, one log line), transactional
attribute setting, revert.

A *fix* is a module in this package with the same small interface (the idea of ddtrace's one ``patch()`` module per
integration under ``contrib/``, or OpenTelemetry's one ``BaseInstrumentor`` per library, made smaller)::

    NAME: str                 # key in status()["fixes"], doctor, the README release table, e.g. "qkv_loader"
    LABEL: str                # what it fixes, in words, for the one log line
    SETS: tuple[str, ...]     # what apply() sets: "Class.attr" in the model module, "pkg.module:Class.attr" elsewhere
    MODELS: tuple[str, ...]   # the family members it applies to ("MiniCPM-V 4.6", "MiniCPM-V 4.7"); see covers()
    SCOPE: str                # optional: the checkpoints it matters for (doctor: unapplied is WARN, not FAIL)
    SCOPE_CHECK: str          # optional, with SCOPE: the command that checks a checkpoint for it (default: --model)
    def probe(module) -> decision.Verdict    # behaviour of the installed code; never raises; no version strings
    def apply(module) -> None                # only through set_attributes(NAME, ...)
    DEFER_AT: str                            # optional: probe at the first use of this entry point (_deferred)

Two rules for ``probe``: it judges by running the installed code (vLLM's, transformers') on stand-ins, never by a
version string; and re-run on a module where the fix *is* applied it must answer ``CORRECT`` -- ``doctor`` re-probes
every fix in a fresh vLLM process after the hook ran and reports a fix whose patched code still fails its own probe.

:data:`vllm_minicpm_hotfix.fixes.REGISTRY` lists them in the order the post-import hook runs them (:func:`run` each,
each guarded on its own). Every value :func:`set_attributes` puts on a class is recorded with the value it replaced
(so a failure half-way restores the classes exactly as vLLM defined them, and :func:`revert_fix` undoes a fix) and,
where the value takes attributes, marked with the fix's name (``__vllm_minicpm_hotfix__``), so that a second copy of
the package in the same process (a bundle on PYTHONPATH shadowing a pip install) sees the fix as applied.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from .. import decision
from . import _deferred
from ..record import FixStatus, current, installed_vllm_version, logger

#: Attribute that marks a value set by a fix; its value is the fix's NAME.
MARKER_ATTR = "__vllm_minicpm_hotfix__"

_MISSING = object()
#: fix name -> {(owner, attribute): value before the fix set it (``_MISSING`` if the owner itself did not define it)}.
_ORIGINALS: dict[str, dict[tuple[Any, str], Any]] = {}


# --------------------------------------------------------------------------------------------------------------------
# The model family: which classes a fix applies to
# --------------------------------------------------------------------------------------------------------------------

#: vLLM's model module of each family member -> the member's name in messages. vLLM 0.32+ defines MiniCPM-V 4.7's
#: classes in ``minicpmv4_7.py`` as subclasses of the 4.6 classes, so a wrapper set on a 4.6 class also runs for 4.7
#: instances; a fix acts on an instance only if the member it belongs to is in the fix's ``MODELS``.
FAMILY: dict[str, str] = {
    "vllm.model_executor.models.minicpmv4_6": "MiniCPM-V 4.6",
    "vllm.model_executor.models.minicpmv4_7": "MiniCPM-V 4.7",
}

#: Default ``MODELS`` of a fix that declares none: 4.6 only.
DEFAULT_MODELS: tuple[str, ...] = ("MiniCPM-V 4.6",)


def model_of(obj: Any) -> str | None:
    """The family member (``"MiniCPM-V 4.6"``, ``"MiniCPM-V 4.7"``) that ``obj`` -- a vLLM model, processing info or
    multimodal processor instance, or such a class -- belongs to, judged by the module that defines its *own* class
    (not an ancestor's): a subclass vLLM defines in a module not in :data:`FAMILY` (a future 4.8) is ``None``."""
    cls = obj if isinstance(obj, type) else type(obj)
    return FAMILY.get(getattr(cls, "__module__", ""))


def models_of(fix: ModuleType) -> tuple[str, ...]:
    """The family members ``fix`` declares (its ``MODELS``; :data:`DEFAULT_MODELS` if it declares none)."""
    return tuple(getattr(fix, "MODELS", DEFAULT_MODELS))


def covers(fix: ModuleType | tuple[str, ...], obj: Any) -> bool:
    """Whether ``fix`` (a fix module, or its ``MODELS`` tuple) applies to ``obj``'s class: its wrappers hand every
    other instance to vLLM's own code."""
    models = fix if isinstance(fix, tuple) else models_of(fix)
    return model_of(obj) in models


# --------------------------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------------------------


def resolve(module: ModuleType, target: str) -> tuple[Any, str] | None:
    """``(owner, attribute)`` for one entry of a fix's ``SETS``, or None if the owner does not exist here.

    ``"Class.attr"`` is looked up in ``module`` (the model module); ``"pkg.module:Class.attr"`` in that module, which
    is imported only if it is already in ``sys.modules`` or importable without error. Never raises.
    """
    try:
        if ":" in target:
            mod_name, _, path = target.partition(":")
            owner: Any = importlib.import_module(mod_name)
        else:
            owner, path = module, target
        *owners, attr = path.split(".")
        for part in owners:
            owner = getattr(owner, part)
        return owner, attr
    except Exception:  # noqa: BLE001 - a target that is not there is simply not patched
        return None


def patched_by(owner: Any, attr: str) -> str | None:
    """The NAME of the fix whose value ``owner.attr`` is (defined on ``owner`` itself), or None."""
    value = getattr(owner, "__dict__", {}).get(attr, _MISSING)
    if value is _MISSING:
        return None
    # Two fixes may wrap the same attribute (the later one wraps the earlier one's value): the value's own mark names
    # the fix that set it last; unmarkable values fall back to the record, latest fix first.
    mark = getattr(value, MARKER_ATTR, None)
    if isinstance(mark, str):
        return mark
    for fix, saved in reversed(_ORIGINALS.items()):
        if (owner, attr) in saved:
            return fix
    return None


def is_patched(fix: ModuleType, module: ModuleType) -> bool:
    """Whether any attribute ``fix`` sets is, in ``module``'s classes, a value ``fix`` set (this copy or another)."""
    for target in fix.SETS:
        found = resolve(module, target)
        if found is not None and patched_by(*found) == fix.NAME:
            return True
    return False


# --------------------------------------------------------------------------------------------------------------------
# Transactional setting and revert
# --------------------------------------------------------------------------------------------------------------------


def _mark(value: Any, fix: str) -> None:
    try:
        setattr(value, MARKER_ATTR, fix)
    except (AttributeError, TypeError):  # e.g. a bound method, a builtin: recorded in _ORIGINALS only
        pass


def _set(owner: Any, attr: str, value: Any, undo: list) -> None:
    undo.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
    setattr(owner, attr, value)


def _undo(undo: list) -> None:
    for owner, attr, old in reversed(undo):
        if old is _MISSING:
            if attr in owner.__dict__:
                delattr(owner, attr)
        else:
            setattr(owner, attr, old)


def set_attributes(fix: str, changes: Iterable[tuple[Any, str, Callable[[Any], Any]]]) -> None:
    """Set attributes for ``fix``, all or nothing.

    ``changes`` yields ``(owner, attribute, make)``; the new value is ``make(current value)`` (the current value as
    ``getattr`` sees it, inherited or not; None if absent). The new value is marked with ``fix``. On any exception
    every attribute already set is restored and the exception re-raised. The replaced values are kept for
    :func:`revert_fix`.
    """
    undo: list = []
    try:
        for owner, attr, make in changes:
            new = make(getattr(owner, attr, None))
            _mark(new, fix)
            _set(owner, attr, new, undo)
    except BaseException:
        _undo(undo)
        raise
    saved = _ORIGINALS[fix] = _ORIGINALS.pop(fix, {})  # (re)inserted last: the record is in apply order
    for owner, attr, old in undo:
        saved.setdefault((owner, attr), old)


def _owner_module(owner: Any) -> str:
    return owner.__name__ if isinstance(owner, ModuleType) else getattr(owner, "__module__", "")


def revert_fix(fix: str, module: ModuleType | None = None) -> bool:
    """Restore what ``fix`` set (in ``module``'s own classes only, if given; attributes set on other modules'
    classes are restored only when ``module`` is None); mark its status entry ``reverted``. Returns whether anything
    was set."""
    saved = _ORIGINALS.get(fix, {})
    keys = [k for k in saved if module is None or _owner_module(k[0]) == module.__name__]
    if keys:
        _deferred.forget(fix)  # a trigger reverted before its first use: nothing left to probe
    undo = []
    for owner, attr in keys:
        old = saved.pop((owner, attr))
        # A later fix wrapped this fix's value (two fixes set one attribute): hand it this fix's original, so that
        # reverting it restores vLLM's own value; the class keeps the later fix's value (which still calls this one's
        # until it is reverted in turn -- revert() undoes the latest first and is exact).
        later = next((s for f, s in _ORIGINALS.items()
                      if f != fix and getattr(s.get((owner, attr)), MARKER_ATTR, None) == fix), None)
        if later is not None:
            later[(owner, attr)] = old
        else:
            undo.append((owner, attr, old))
    _undo(undo)
    if keys:
        entry = current().fixes.get(fix)
        if entry is not None:
            entry.applied, entry.why = False, "reverted"
    return bool(keys)


def revert(module: ModuleType | None = None) -> bool:
    """Restore every attribute any fix set; with ``module``, every fix that set anything in ``module``'s classes,
    including what the same fix set elsewhere (transformers, vLLM's layers), and every registered fix that is patched
    as seen from ``module`` (one whose ``SETS`` name only other modules, e.g. ``vllm.config.model``). Returns whether
    any was set."""
    from . import REGISTRY  # not at import time: this package's __init__ imports this module

    seen = {fix.NAME for fix in REGISTRY if module is not None and is_patched(fix, module)}
    reverted = False
    # Latest applied first: where two fixes wrap the same attribute, the earlier fix's original is the one that stays.
    for fix, saved in reversed(list(_ORIGINALS.items())):
        if module is None or fix in seen or any(_owner_module(owner) == module.__name__ for owner, _ in saved):
            reverted |= revert_fix(fix)
    return reverted


# --------------------------------------------------------------------------------------------------------------------
# Running one fix
# --------------------------------------------------------------------------------------------------------------------


def run(fix: ModuleType, module: ModuleType) -> FixStatus:
    """What the post-import hook does for one fix: read the mode, probe (not under ``off``), decide, apply, record
    the outcome in the status record under ``fix.NAME`` and log one line with the pid.

    A fix already patched in this process (by this copy of the package or another) is reported as such and left
    alone. Raises only what ``fix.apply`` raises (the hook catches and logs it); the classes are then left exactly as
    they were (:func:`set_attributes` is all or nothing).
    """
    status = current()
    name = fix.NAME
    if is_patched(fix, module):
        entry = status.fixes.get(name) or FixStatus(name, "n/a", "patched before this status record began", True, "")
        entry.applied, entry.why = True, "already patched in this process"
        status.fixes[name] = entry
        return entry
    mode = decision.Mode(status.mode)
    if mode is not decision.Mode.OFF and _deferred.enabled(fix):  # probed at first use of its code path
        deferred = _deferred.defer(fix, module, mode)
        if deferred is not None:
            return deferred
    if mode is decision.Mode.OFF:
        verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)")
    else:
        verdict = fix.probe(module)
    chosen = decision.decide(mode, verdict)
    entry = FixStatus(name, verdict.state.value, verdict.reason, False, chosen.why, label=fix.LABEL)
    status.fixes[name] = entry
    version = installed_vllm_version()
    if chosen.apply:
        fix.apply(module)
        entry.applied = True
        # WARNING, not INFO: patching vLLM must be impossible to miss, also where vLLM has not configured its
        # logging yet (0.32+ configures it lazily, so an INFO line from a script would be dropped).
        logger.warning(
            "vllm-minicpm-hotfix: MiniCPM-V 4.6 %s PATCHED in pid %d (vLLM %s, mode %s): %s",
            fix.LABEL, os.getpid(), version, mode.value, chosen.why,
        )
    else:
        unsure = verdict.state in (decision.State.UNRECOGNISED, decision.State.UNDETERMINED)
        level = logging.WARNING if unsure and mode is not decision.Mode.OFF else logging.INFO
        logger.log(
            level, "vllm-minicpm-hotfix: %s not applied in pid %d (vLLM %s): %s", fix.LABEL, os.getpid(), version,
            chosen.why,
        )
    return entry
