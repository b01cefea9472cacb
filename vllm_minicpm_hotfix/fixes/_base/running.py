"""Running one fix in the post-import hook: left out, already patched, probed at first use, or decided now."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ... import decision
from ...record import FixStatus, current, logger
from . import deferred, family
from .deciding import decide_and_apply, undeclared, unknown_subclasses
from .patching import is_patched


def run(fix: ModuleType, module: ModuleType) -> FixStatus:
    """What the post-import hook does for one fix: a fix ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` names is left out
    (not probed, nothing set; its status row says so); a fix already patched in this process (by this copy of the
    package or another) is reported as such and left alone; one whose probe waits for its code path's first use is
    given its trigger (:mod:`.deferred`), with one status row per member present; any other is decided now
    (:func:`.deciding.decide_and_apply`). A fix that must come after a left-out one (``AFTER``) runs alone, and its
    ``why`` says so: every ``AFTER`` is an order between two fixes that each work without the other. Raises only what
    ``fix.apply`` raises (the hook catches and logs it)."""
    status = current()
    name = fix.NAME
    left_out = decision.disabled_from_env()
    if name in left_out:
        return leave_out(fix, module)
    entry = _run(fix, module, status)
    alone = [n for n in getattr(fix, "AFTER", ()) if n in left_out]
    if alone:
        entry.why = (f"{entry.why}; {', '.join(alone)} left out by {decision.DISABLED_VAR}: {name} runs without it "
                     f"(it only comes after it)")
    return entry


def leave_out(fix: ModuleType, module: ModuleType) -> FixStatus:
    """Record ``fix`` as left out by ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` (nothing probed or set), one row per member
    present, and log it at INFO."""
    why = f"left out: {decision.DISABLED_VAR} names it"
    entry = FixStatus(fix.NAME, "left out", why, False, why, label=fix.LABEL, left_out=True)
    for member in family.member_modules(module, imported_only=True):
        declared = member in family.models_of(fix)
        entry.models[member] = {"declared": declared, "verdict": "left out" if declared else "n/a", "reason": why,
                                "applied": False, "why": why if declared else undeclared(fix, member)}
    current().fixes[fix.NAME] = entry
    logger.info("vllm-minicpm-hotfix: %s (%s) not applied: %s", fix.NAME, fix.LABEL, why)
    return entry


def _run(fix: ModuleType, module: ModuleType, status: Any) -> FixStatus:
    name = fix.NAME
    if is_patched(fix, module):
        entry = status.fixes.get(name) or FixStatus(name, "n/a", "patched before this status record began", True, "")
        entry.applied, entry.why = True, "already patched in this process"
        status.fixes[name] = entry
        return entry
    mode = decision.Mode(status.mode)
    if mode is not decision.Mode.OFF and deferred.enabled(fix):
        group = isinstance(fix.DEFER_AT, deferred.Group)
        entry = (deferred.defer_group if group else deferred.defer)(fix, module, mode)
        if entry is not None:
            for member in family.member_modules(module, imported_only=True):
                entry.models[member] = pending_row(fix, member, entry)
            entry.models.update(unknown_subclasses(fix, module))  # said now, not only at first use
            return entry
    return decide_and_apply(fix, module, mode)


def pending_row(fix: ModuleType, member: str, entry: FixStatus) -> dict[str, Any]:
    """The status row of ``member`` for a fix whose probe waits for first use."""
    declared = member in family.models_of(fix)
    return {"declared": declared, "verdict": entry.verdict if declared else "n/a", "reason": entry.reason,
            "applied": False, "why": entry.why if declared else undeclared(fix, member)}
