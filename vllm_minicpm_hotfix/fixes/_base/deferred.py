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

``VLLM_MINICPM_HOTFIX_PROBES=eager`` (or :data:`EAGER` set true) probes every fix at import as before (the tests that
pin each fix's verdict use it); :func:`resolve_all` resolves every pending fix now (``doctor``'s child, which must
judge them all).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ... import decision
from ...record import FixStatus, current, installed_vllm_version, logger
from .deciding import decide_and_apply
from .patching import has_set, resolve as resolve_target, revert_fix, set_attributes

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


def enabled(fix: ModuleType) -> bool:
    """Whether ``fix`` is deferred in this process: it declares ``DEFER_AT`` and probes are not eager."""
    if EAGER or os.environ.get(ENV_VAR, "").strip().lower() == "eager":
        return False
    return bool(getattr(fix, "DEFER_AT", None)) and callable(getattr(fix, "uses_path", None))


def is_trigger(value: Any) -> bool:
    """Whether ``value`` (a class attribute) is a trigger set by :func:`defer`."""
    return isinstance(getattr(value, TRIGGER_ATTR, None), str)


def pending(name: str) -> bool:
    """Whether the fix ``name`` is deferred and its probe has not run yet in this process (its trigger in place)."""
    return name in _PENDING and has_set(name)


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
    """Resolve every pending fix now (``doctor``'s child). Returns ``{NAME: entry}`` of those resolved."""
    out = {}
    for name in list(_PENDING):
        entry = resolve(name)
        if entry is not None:
            out[name] = entry
    return out
