"""Deciding one fix: probe it per family member present, combine each verdict with the mode, apply it for the members
that need it, record the outcome in the status record and log its reason at INFO."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ... import decision
from ...record import FixStatus, current, logger
from . import family
from .patching import resolve, wraps_of


def short(text: str, limit: int = 300) -> str:
    """``text`` on one line, cut at ``limit`` characters (the full reason is in ``status()`` and ``doctor``)."""
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 3] + "..."


def undeclared(fix: ModuleType, member: str) -> str:
    return f"{fix.NAME} does not declare {member}: its instances get vLLM's own code"


def unknown_subclasses(fix: ModuleType, module: ModuleType) -> dict[str, dict[str, Any]]:
    """Every class defined so far in this process (``__subclasses__``, recursively) that subclasses a class ``fix``
    patches in ``module`` and that no family member owns: ``{module.QualName: status row}``. Never raises."""
    out: dict[str, dict[str, Any]] = {}
    for target in getattr(fix, "SETS", ()):
        found = resolve(module, target, imported_only=True)
        if found is None or not isinstance(found[0], type) or found[0].__module__ not in family.FAMILY:
            continue
        base = found[0]
        todo = list(base.__subclasses__())
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if cls.__module__ not in family.FAMILY:
                out.setdefault(family.class_name(cls), family.undeclared_row(fix, cls, base))
    return out


def decide_and_apply(fix: ModuleType, module: ModuleType, mode: decision.Mode,
                     entry: FixStatus | None = None) -> FixStatus:
    """Probe ``fix`` per declared family member (not under ``off``), decide, apply for the members that need it (the
    wrappers then act for exactly those), record (in ``entry`` if given, else a new :class:`FixStatus`: the
    top-level verdict / reason / why are the 4.6 member's, ``models`` holds every member's and every undeclared
    subclass's) and log the reason at INFO. Raises only what ``fix.apply`` raises (the classes are then as they
    were: applying is all or nothing)."""
    status = current()
    name = fix.NAME
    declared = family.models_of(fix)
    own = family.FAMILY.get(module.__name__, family.DEFAULT_MODELS[0])
    rows: dict[str, dict[str, Any]] = {}
    choices: dict[str, decision.Decision] = {}
    verdicts: dict[str, decision.Verdict] = {}
    for member, view in family.member_modules(module, imported_only=True).items():
        if member not in declared:
            rows[member] = {"declared": False, "verdict": "n/a", "reason": "", "applied": False,
                            "why": undeclared(fix, member)}
            continue
        if mode is decision.Mode.OFF:
            verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)")
        else:
            verdict = fix.probe(view)
        verdicts[member], choices[member] = verdict, decision.decide(mode, verdict)
        rows[member] = {"declared": True, "verdict": verdict.state.value,
                        "reason": family.member_reason(view, verdict.reason), "applied": False,
                        "why": family.member_reason(view, choices[member].why)}
    verdict, chosen = verdicts.get(own), choices.get(own)
    if verdict is None:  # a fix of another member only (canvas_mrope: 4.7): its probe on this module's own classes
        verdict = (fix.probe(module) if mode is not decision.Mode.OFF
                   else decision.Verdict(decision.State.UNDETERMINED, "not probed (off)"))
        chosen = decision.Decision(False, f"{name} does not declare {own}: {verdict.reason}")
    acting = frozenset(m for m, c in choices.items() if c.apply)
    if entry is None:
        entry = FixStatus(name, verdict.state.value, verdict.reason, False, chosen.why, label=fix.LABEL)
    else:  # a deferred fix resolved at first use: the entry status() already lists, updated in place
        entry.verdict, entry.reason, entry.applied, entry.why = verdict.state.value, verdict.reason, False, chosen.why
    entry.models = rows
    status.fixes[name] = entry
    if acting:
        family._ACTIVE[name] = acting
        try:
            fix.apply(module)
        except BaseException:
            family._ACTIVE.pop(name, None)
            raise
        entry.applied = True
        entry.wraps = wraps_of(name)
        if not chosen.apply:
            entry.why = f"applied for {', '.join(sorted(acting))} only; {own}: {chosen.why}"
        for member in acting:
            rows[member]["applied"] = True
    # INFO: the hook's one WARNING line per process (record.summary_line) names every fix applied; the reasons are
    # here, shown with VLLM_LOGGING_LEVEL=INFO (and by `doctor`, in full).
    logger.info(
        "vllm-minicpm-hotfix: %s (%s) %s%s: %s", name, fix.LABEL, "PATCHED" if entry.applied else "not applied",
        f" for {' and '.join(sorted(acting))}" if acting else "", short(entry.why),
    )
    for cls_name, row in unknown_subclasses(fix, module).items():
        rows[cls_name] = row
        logger.info("vllm-minicpm-hotfix: %s", row["why"])
    return entry
