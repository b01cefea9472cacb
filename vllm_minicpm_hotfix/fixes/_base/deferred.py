"""Probes deferred to first use: a fix whose code path the served checkpoint may never use (quantized layouts) is
probed the first time vLLM enters that path, not at import.

A fix opts in with two attributes::

    DEFER_AT: str                         # the entry point of its code path, a PATCHES target ("Class.__init__")
    def uses_path(*args, **kwargs) -> bool  # for a call of DEFER_AT (self first): does this call take the path?

At hook time (:func:`.running.run`, modes ``auto`` and ``force``) such a fix is not probed:
:func:`defer` sets a *trigger* on ``DEFER_AT`` (through :func:`.patching.set_attributes`, so
revert and a second copy of the package see it) and records the fix as ``deferred`` -- "probed at first use" in
``status()`` and ``doctor``. The trigger hands every call that does not take the path (``uses_path`` false) to
vLLM's own function unchanged. The first call that does take it runs :func:`resolve`: the trigger is removed, the
fix's real ``probe`` runs on the classes exactly as vLLM defined them, :func:`~vllm_minicpm_hotfix.decision.decide`
chooses as it would have at import, the fix is applied or not, the status entry gets the real verdict, one log line
is written -- and the call goes on to the function now in place (the fix's, or vLLM's). A failure in the probe or
``apply`` is logged and recorded, and the call runs vLLM's own code (never an exception from the hotfix).

A fix may instead join a :class:`Group` (``DEFER_AT = PROCESSOR_PATH``): the fixes of vLLM's multimodal processor,
whose probes import transformers' MiniCPM-V processor modules (2-3 ms each, which vLLM imports itself when it first
builds its processor). They wait together for the first call of any of the group's triggers (the construction of
vLLM's processing info; the model's ``embed_multimodal``), of ``status()``, or of :func:`resolve_all`; then
:func:`resolve_group` probes and applies them in registry order, exactly as the hook would have at import -- every fix
before them in the registry already decided, none after them (none after them touches what they touch) -- and
writes the hook's summary line, which the hook holds (:func:`hold_summary`) while the group waits: still one WARNING
line per process, naming every fix applied. Every processor-path target needs a processing info or a model
instance, so no group target runs before the group is resolved.

``VLLM_MINICPM_HOTFIX_PROBES=eager`` (or :data:`EAGER` set true) probes every fix at import as before (the tests that
pin each fix's verdict use it); :func:`resolve_all` resolves every pending fix now (``doctor``'s child, which must
judge them all).
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from ... import decision
from ...record import FixStatus, current, installed_vllm_version, log_summary, logger
from .deciding import decide_and_apply
from .family import INFO_CLASS, MODEL_CLASS
from .patching import ON_REVERT, has_set, is_patched, resolve as resolve_target, revert_fix, set_attributes

#: ``VLLM_MINICPM_HOTFIX_PROBES``: ``eager`` probes every fix at import; anything else (default ``lazy``) defers.
ENV_VAR = "VLLM_MINICPM_HOTFIX_PROBES"
#: Set true to probe every fix at import whatever the environment says.
EAGER = False
#: Attribute marking a trigger (its value: the fix's NAME).
TRIGGER_ATTR = "__vllm_minicpm_hotfix_deferred__"
#: The ``verdict`` of a status entry whose probe has not run yet.
PENDING = "deferred"
FIRST_USE = "probed at first use"

_LOCK = threading.RLock()
#: fix NAME -> (fix, model module) for every trigger set in this process.
_PENDING: dict[str, tuple[ModuleType, ModuleType]] = {}


class Group(NamedTuple):
    """Fixes probed together at the first call of any of ``triggers`` (``"Class.attr"`` in the model module)."""

    name: str  #: the key its triggers are recorded under (never a fix's NAME)
    triggers: tuple[str, ...]
    path: str  #: what the first use is, in words ("the first ... that ...")


#: The fixes of vLLM's multimodal processor: probed when vLLM first builds its processing info (API server, EngineCore,
#: worker: each builds one before processing or embedding a multimodal input) or first embeds one.
PROCESSOR_PATH = Group("processor path", (f"{INFO_CLASS}.__init__", f"{MODEL_CLASS}.embed_multimodal"),
                       "processing info or multimodal embedding vLLM builds")

#: The fixes waiting for :data:`PROCESSOR_PATH`, in registry order, with their model module; and the summary line the
#: hook holds until they are resolved (the registry's NAMEs), if it holds one.
_GROUP: list[tuple[ModuleType, ModuleType]] = []
_HELD: list[list[str]] = []


def enabled(fix: ModuleType) -> bool:
    """Whether ``fix`` is deferred in this process: it declares ``DEFER_AT`` (a target with ``uses_path``, or a
    :class:`Group`) and probes are not eager."""
    if EAGER or os.environ.get(ENV_VAR, "").strip().lower() == "eager":
        return False
    at = getattr(fix, "DEFER_AT", None)
    return isinstance(at, Group) or (bool(at) and callable(getattr(fix, "uses_path", None)))


def is_trigger(value: Any) -> bool:
    """Whether ``value`` (a class attribute) is a trigger set by :func:`defer`."""
    return isinstance(getattr(value, TRIGGER_ATTR, None), str)


def pending(name: str) -> bool:
    """Whether the fix ``name`` is deferred and its probe has not run yet in this process (its trigger in place)."""
    if name in _PENDING:
        return has_set(name)
    return has_set(PROCESSOR_PATH.name) and any(fix.NAME == name for fix, _ in _GROUP)


def hold_summary(registry: list[str]) -> bool:
    """The hook's summary line: held (True) while a group waits, to be written when it is resolved -- or, in a
    process that never builds vLLM's processor (a script that only imports the model), at its exit; False if
    nothing waits (the hook writes it now)."""
    with _LOCK:
        if _GROUP and has_set(PROCESSOR_PATH.name):
            _HELD[:] = [list(registry)]
            return True
        _HELD.clear()
        return False


def _write_held() -> None:
    """The summary line the hook held, if it still is: written once (when the group is probed or emptied, or at
    exit). Never raises."""
    with _LOCK:
        held = _HELD[:1]
        _HELD.clear()
    if held:
        try:
            log_summary(current(), held[0])
        except Exception as exc:  # noqa: BLE001 - pragma: no cover - the summary itself broken
            logger.warning("vllm-minicpm-hotfix: the summary line failed: %s", exc)


def defer_group(fix: ModuleType, module: ModuleType, mode: decision.Mode) -> FixStatus | None:
    """Add ``fix`` to its group (``fix.DEFER_AT``), setting the group's triggers on ``module`` first if they are not
    in place; None (the caller probes at once) if a trigger target is not there, or another copy of the package holds
    a trigger there (that copy decides; this one probes now and the other then finds the fix applied)."""
    group: Group = fix.DEFER_AT
    with _LOCK:
        if not has_set(group.name):
            found = [resolve_target(module, t) for t in group.triggers]
            if any(f is None or is_trigger(f[0].__dict__.get(f[1])) for f in found):
                return None
            _GROUP.clear()
            set_attributes(group.name, [(owner, attr, _group_trigger(owner, attr)) for owner, attr in found])
        if any(f is fix for f, _ in _GROUP):  # the hook run again in this process while the group waits
            return current().fixes.get(fix.NAME)
        _GROUP.append((fix, module))
    entry = FixStatus(fix.NAME, PENDING, f"{FIRST_USE}: the first {group.path}", False,
                      f"{FIRST_USE} (mode {mode.value})", label=fix.LABEL, first_use=True)
    current().fixes[fix.NAME] = entry
    return entry


def _stop_waiting(name: str) -> bool:
    """:data:`.patching.ON_REVERT`'s entry: the fix ``name`` taken out of the group if it waits there (never
    applied); once no fix waits, the group's triggers go and the held summary line is written."""
    with _LOCK:
        at = next((i for i, (fix, _) in enumerate(_GROUP) if fix.NAME == name), None)
        if at is None:
            return False
        del _GROUP[at]
        if _GROUP:
            return True
    revert_fix(PROCESSOR_PATH.name)
    _write_held()
    return True


ON_REVERT.append(_stop_waiting)
atexit.register(_write_held)  # a no-op unless a line is still held


def _group_trigger(owner: Any, attr: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def trigger(*args: Any, **kwargs: Any) -> Any:
            resolve_group()  # a no-op once resolved; a second thread waits here for the first one's decisions
            now = owner.__dict__.get(attr)
            if now is None or is_trigger(now):  # nothing of a fix there now: vLLM's own (inherited or defined)
                return original(*args, **kwargs)
            return now(*args, **kwargs)  # a fix's function

        trigger.__wrapped__ = original
        setattr(trigger, TRIGGER_ATTR, PROCESSOR_PATH.name)
        return trigger

    return make


def resolve_group() -> list[FixStatus]:
    """Probe and apply every fix waiting for :data:`PROCESSOR_PATH`, in registry order, as the hook would have at
    import (the triggers removed first, so the probes see vLLM's classes as the earlier fixes left them), then write
    the summary line the hook held. Returns their status entries (none if nothing waits). Never raises: a fix that
    fails is recorded and logged as the hook records it, and left unapplied."""
    with _LOCK:
        if not _GROUP or not has_set(PROCESSOR_PATH.name):
            _GROUP.clear()
            return []
        waiting = list(_GROUP)
        _GROUP.clear()
        revert_fix(PROCESSOR_PATH.name)
        status, out = current(), []
        for fix, module in waiting:
            entry = status.fixes.get(fix.NAME) or FixStatus(fix.NAME, PENDING, "", False, "", label=fix.LABEL)
            entry.first_use = True
            status.fixes[fix.NAME] = entry
            try:
                if is_patched(fix, module):  # another copy of the package applied it meanwhile
                    entry.applied, entry.why = True, "already patched in this process"
                else:
                    decide_and_apply(fix, module, decision.Mode(status.mode), entry)
            except Exception as exc:  # noqa: BLE001 - a failure here must not break vLLM's processing
                revert_fix(fix.NAME)
                entry.verdict, entry.applied, entry.why = "error", False, "hook failed at first use; vLLM left as it was"
                entry.error = f"{type(exc).__name__}: {exc}"
                logger.warning("vllm-minicpm-hotfix: %s failed at first use (%s), vLLM left unpatched: %s", fix.NAME,
                               fix.LABEL, exc, exc_info=True)  # fmt: skip
            out.append(entry)
    _write_held()
    return out


def defer(fix: ModuleType, module: ModuleType, mode: decision.Mode) -> FixStatus | None:
    """Set ``fix``'s trigger on ``module`` and record it as pending (see the module docstring); None (nothing set)
    if ``DEFER_AT`` is not in ``module``: the caller probes at once. Raises what
    :func:`.patching.set_attributes` raises (the hook catches it)."""
    found = resolve_target(module, fix.DEFER_AT)
    if found is None:  # the entry point is not there: the real probe says what that means, now
        return None
    owner, attr = found
    name = fix.NAME
    trigger_ref: list[Any] = [None]

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def trigger(*args: Any, **kwargs: Any) -> Any:
            try:
                takes_path = bool(fix.uses_path(*args, **kwargs))
            except Exception:  # noqa: BLE001 - undecidable: vLLM's own code, as without the hotfix
                takes_path = False
            if not takes_path:
                return original(*args, **kwargs)
            resolve(name)  # a no-op once resolved; a second thread waits here for the first one's decision
            now = owner.__dict__.get(attr)
            if now is None or now is trigger_ref[0]:  # not replaced (reverted from outside): vLLM's own
                return original(*args, **kwargs)
            return now(*args, **kwargs)  # the fix's function, or vLLM's own

        trigger.__wrapped__ = original
        setattr(trigger, TRIGGER_ATTR, name)
        trigger_ref[0] = trigger
        return trigger

    entry = FixStatus(name, PENDING, f"{FIRST_USE}: the first {fix.DEFER_AT} that {fix.PATH}", False,
                      f"{FIRST_USE} (mode {mode.value})", label=fix.LABEL,
                      first_use=True)
    set_attributes(name, [(owner, attr, make)])
    with _LOCK:
        _PENDING[name] = (fix, module)
    current().fixes[name] = entry
    logger.info("vllm-minicpm-hotfix: %s (%s) %s: the first %s that %s", name, fix.LABEL, FIRST_USE, fix.DEFER_AT,
                fix.PATH)
    return entry


def resolve(name: str) -> FixStatus | None:
    """Run the deferred fix ``name``'s probe now and apply it or not, as the hook would have at import (see the
    module docstring). Returns its status entry (the same object ``status()`` lists, updated in place); None if
    ``name`` is not pending. Never raises."""
    with _LOCK:
        found = _PENDING.pop(name, None)
        if found is None or not has_set(name):  # not pending, or its trigger reverted from outside since
            return None
        fix, module = found
        status = current()
        entry = status.fixes.get(name) or FixStatus(name, PENDING, "", False, "", label=fix.LABEL, first_use=True)
        status.fixes[name] = entry
        try:
            revert_fix(name)  # the trigger goes; the probe sees vLLM's own classes
            mode = decision.Mode(status.mode)
            decide_and_apply(fix, module, mode, entry)  # per family member, as the hook would have
            entry.why = f"{entry.why} ({FIRST_USE})"
            if entry.applied:
                acting = [m for m, row in entry.models.items() if isinstance(row, dict) and row.get("applied")]
                logger.warning("vllm-minicpm-hotfix: %s %s PATCHED in pid %d (vLLM %s, mode %s, %s): %s",
                               " and ".join(acting) or "MiniCPM-V", fix.LABEL, os.getpid(), installed_vllm_version(),
                               mode.value, FIRST_USE, entry.why)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failure here must not break vLLM's model construction
            revert_fix(name)
            entry.verdict, entry.applied, entry.why = "error", False, "hook failed at first use; vLLM left as it was"
            entry.error = f"{type(exc).__name__}: {exc}"
            logger.warning("vllm-minicpm-hotfix: %s failed at first use (%s), vLLM left unpatched: %s", name,
                           fix.LABEL, exc, exc_info=True)  # fmt: skip
        return entry


def resolve_all() -> dict[str, FixStatus]:
    """Resolve every pending fix now (``doctor``'s child), the group first. Returns ``{NAME: entry}`` of those
    resolved."""
    out = {entry.name: entry for entry in resolve_group()}
    for name in list(_PENDING):
        entry = resolve(name)
        if entry is not None:
            out[name] = entry
    return out
