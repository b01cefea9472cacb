"""What the hotfix did in this process: the vLLM version, the mode, and per fix the verdict and whether it applied.

The record is filled by the post-import hook (:mod:`vllm_minicpm_hotfix.hook`) and read through
:func:`vllm_minicpm_hotfix.status`. Everything in it is JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
from typing import Any

#: A child of vLLM's ``vllm`` logger, so our lines appear in vLLM's own log stream with its format; without vLLM's
#: logging they reach Python's last-resort handler at WARNING and above.
logger = logging.getLogger("vllm.minicpm_hotfix")


def level_from_env(environ: Any = None) -> int:
    """The hotfix logger's level: what ``VLLM_LOGGING_LEVEL`` names when it is set (``INFO`` shows each fix's reason,
    ``DEBUG`` more), else ``WARNING`` -- vLLM's own default is INFO, and the hotfix's default is its one WARNING
    line per process (:func:`summary_line`), not a line per fix. An unknown name counts as unset."""
    value = (os.environ if environ is None else environ).get("VLLM_LOGGING_LEVEL", "").strip().upper()
    level = logging.getLevelName(value) if value else None
    return level if isinstance(level, int) else logging.WARNING


logger.setLevel(level_from_env())


@dataclasses.dataclass
class FixStatus:
    """One fix's outcome in this process."""

    name: str
    #: broken | correct | unrecognised | undetermined | error | deferred (probed at first use, not yet) | left out
    verdict: str
    reason: str
    applied: bool
    why: str  #: why it was (not) applied
    error: str | None = None  #: an exception caught inside the hook, if any
    label: str = ""  #: what the fix repairs, in words (the fix module's LABEL)
    #: Per family member present in this vLLM ("MiniCPM-V 4.6", "MiniCPM-V 4.7") and per subclass no member owns
    #: ("module.QualName"): ``declared`` (in the fix's MODELS), ``verdict`` / ``reason`` (its probe on that member's
    #: classes), ``applied`` (the fix acts for it), ``why``; ``unknown`` for a subclass no member owns.
    models: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    #: probed at the first use of its code path instead of at import (fixes._base.deferred): verdict ``deferred`` until
    #: then, the real verdict after
    first_use: bool = False
    #: Attributes this fix's value wraps another fix's value of (two fixes set one attribute): ``"Class.attr"`` -> the
    #: NAME of the fix whose wrapper it calls (``fixes._base.shared_targets`` names every such attribute).
    wraps: dict[str, str] = dataclasses.field(default_factory=dict)
    #: left out by ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` (not probed, not applied; verdict ``left out``)
    left_out: bool = False


@dataclasses.dataclass
class BackportStatus:
    """One backport's outcome in this process (:mod:`vllm_minicpm_hotfix.backports`): an architecture the installed
    vLLM lacks, registered by the hotfix, or left to vLLM."""

    name: str
    member: str  #: the family member it provides ("MiniCPM-V 4.7")
    verdict: str  #: missing | correct (vLLM's own, or another plugin's) | unrecognised | undetermined | error
    reason: str
    registered: bool  #: vLLM's registry resolves the architecture to the hotfix's classes
    why: str  #: why it was (not) registered
    error: str | None = None  #: an exception caught inside the hook, if any
    label: str = ""


def backport_says(row: Any) -> str | None:
    """What the summary line and ``doctor`` say of one backport (a :class:`BackportStatus` or its ``status()`` dict):
    "registered by the hotfix", "vLLM's own", "registered by another plugin", "not registered" (needed, not
    registered: ``off``), "failed" (the hook raised), or None where there is nothing to say (the architecture cannot
    be served here for another reason: no 4.6 classes, or a transformers without the config)."""
    get = row.get if isinstance(row, dict) else lambda key: getattr(row, key, None)
    if get("registered"):
        return "registered by the hotfix"
    verdict, reason = get("verdict"), str(get("reason") or "")
    if verdict == "error":
        return "failed"
    if verdict == "correct":
        return "vLLM's own" if reason.startswith("vLLM's own") else "registered by another plugin"
    if verdict == "missing":
        return "not registered"
    return None


@dataclasses.dataclass
class Status:
    pid: int
    mode: str
    hook_installed: bool = False
    module_imported: bool = False
    vllm_version: str | None = None
    fixes: dict[str, FixStatus] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The model family members this vLLM defines (``fixes._base.FAMILY`` whose module exists), set by the hook.
    models: list[str] = dataclasses.field(default_factory=list)
    #: Per backport NAME (``backports.BACKPORTS``), set by the hook on vLLM's model registry module.
    backports: dict[str, BackportStatus] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_LOCK = threading.RLock()
_STATUS: Status | None = None


def current() -> Status:
    """This process's record (created on first use; a forked child starts a fresh one)."""
    global _STATUS
    with _LOCK:
        if _STATUS is None or _STATUS.pid != os.getpid():
            from .decision import mode_from_env

            mode, problem = mode_from_env()
            _STATUS = Status(pid=os.getpid(), mode=mode.value)
            if problem:
                _STATUS.notes.append(problem)
                logger.warning("vllm-minicpm-hotfix: %s", problem)
        return _STATUS


def installed_vllm_version() -> str | None:
    """``vllm.__version__`` if vLLM is already imported in this process (never imports it)."""
    vllm = sys.modules.get("vllm")
    return getattr(vllm, "__version__", None) if vllm is not None else None


# --------------------------------------------------------------------------------------------------------------------
# The one WARNING line per process
# --------------------------------------------------------------------------------------------------------------------

#: Every summary line starts with this.
SUMMARY_PREFIX = "vllm-minicpm-hotfix: "

#: What :func:`summary_line` writes (anywhere on a line, after vLLM's own prefix), as a pattern with named groups
#: ``models``, ``vllm``, ``mode``, ``pid``, ``applied``, ``total``, ``names`` (the applied fixes by number:
#: :func:`_render`) and ``rest`` (the ``; ...`` parts before the pointer to doctor, or empty).
SUMMARY_PATTERN = re.compile(
    r"vllm-minicpm-hotfix: (?P<models>MiniCPM-V [^,\n]+|no MiniCPM-V model), vLLM (?P<vllm>\S+), mode (?P<mode>\w+), "
    r"pid (?P<pid>\d+): patched (?P<applied>\d+)/(?P<total>\d+) \((?P<names>[^)\n]*)\)(?P<rest>(; [^;\n]+)*); "
    r"details: vllm-minicpm-hotfix doctor$",
    re.MULTILINE,
)

#: The longest the line may be, vLLM's prefix of about 60 characters included (``(APIServer pid=12345) WARNING
#: 12-08 01:02:03 [record.py:267] ``): a person reads it in a terminal next to vLLM's own lines.
SUMMARY_BUDGET = 300

#: The most characters of module names the summary line's ``not covered`` part spells out; past it, the modules are
#: counted (``N modules``), so the part is at most 30 characters (``; not covered: `` and 15).
NOT_COVERED_NAMES = 15

#: What the line says of a backport (:func:`backport_says`), as the line's last words for it.
_BACKPORT_SAYS = ("registered by the hotfix", "vLLM's own", "registered by another plugin", "not registered", "failed")


def _not_covered(modules: list[str]) -> str:
    """``modules`` (at least one) as their comma-separated names if those fit in :data:`NOT_COVERED_NAMES`
    characters, else as ``N module(s)``."""
    listed = ", ".join(modules)
    if len(listed) <= NOT_COVERED_NAMES:
        return listed
    return f"{len(modules)} module{'' if len(modules) == 1 else 's'}"


def _render(chosen: list[str], registry: list[str]) -> str:
    """``chosen`` (a subset of ``registry``) by number (``#1`` is the registry's first fix, the order ``doctor``
    lists them in): ``all``, ``none``, their list (``#1 #4``) or ``all but`` the others, whichever is shorter."""
    if not chosen:
        return "none"
    others = [f"#{i}" for i, n in enumerate(registry, 1) if n not in chosen]
    if not others:
        return "all"
    listed = " ".join(f"#{i}" for i, n in enumerate(registry, 1) if n in chosen)
    but = "all but " + " ".join(others)
    return listed if len(listed) <= len(but) else but


def _expand(text: str, registry: list[str]) -> list[str]:
    """The inverse of :func:`_render`: NAMEs in registry order."""
    if text == "all":
        return list(registry)
    if text.startswith("none"):
        return []
    but = text.startswith("all but ")
    numbers = {int(t) for t in re.findall(r"#(\d+)", text)}
    return [n for i, n in enumerate(registry, 1) if (i in numbers) is not but]


def _short(member: str) -> str:
    """A family member as the line names it after the models part: ``4.7``, ``OCR``."""
    return member.removeprefix("MiniCPM-V ").removeprefix("MiniCPM-")


def _long(short: str) -> str:
    """The inverse of :func:`_short`."""
    return f"MiniCPM-V {short}" if short[:1].isdigit() else f"MiniCPM-{short}"


def _backports_part(status: Status) -> str:
    """``; MEMBERS: what`` per thing said of the backports (:func:`backport_says`), members grouped, e.g. ``; 4.7,
    OCR: registered by the hotfix`` or ``; 4.7: vLLM's own``; empty where there is nothing to say."""
    said: dict[str, list[str]] = {}
    for row in (status.backports or {}).values():
        says = backport_says(row)
        if says:
            said.setdefault(says, []).append(_short(row.member))
    return "".join(f"; {', '.join(members)}: {says}" for says, members in said.items())


def summary_line(status: Status, registry: list[str]) -> str:
    """The one WARNING line the post-import hook logs per process, once every fix has run.

    ``registry``: every fix's ``NAME`` in registry order (:func:`vllm_minicpm_hotfix.fixes.names`). The line is::

        vllm-minicpm-hotfix: MiniCPM-V 4.6, vLLM 0.28.0, mode auto, pid 13977: patched 11/18 (all but #2 #4 #6
        #10 #11 #15 #17); left out: #2 #6; 4.7, OCR: registered by the hotfix; details: vllm-minicpm-hotfix doctor

    (one line; wrapped here). It counts and points; the names and reasons are each fix's INFO line
    (``VLLM_LOGGING_LEVEL=INFO``) and ``doctor``'s rows. Fixes are named by number, ``#1`` the registry's first (the
    order ``doctor`` lists them in), rendered by :func:`_render`: ``all``, ``none`` (``none: off`` under
    ``VLLM_MINICPM_HOTFIX=off``), their list or ``all but`` the others, whichever is shorter. After the applied ones
    come, where there are any: ``; left out: #N`` (``VLLM_MINICPM_HOTFIX_DISABLED_FIXES``), ``; could not tell: #N``
    (the probe answered ``unrecognised`` / ``undetermined``: left alone), ``; failed: #N`` (raised inside the hook;
    the traceback is a WARNING of its own), ``; not covered: MODULES`` (subclasses of the patched classes that no family
    member owns, e.g. ``minicpmv4_8``; counted past :data:`NOT_COVERED_NAMES` characters) and the backports
    (:func:`_backports_part`). With 18 fixes the worst realistic line (0.28.0, auto, fixes left out, both backports
    registered) is about 215 characters, within :data:`SUMMARY_BUDGET` with vLLM's prefix.

    A fix whose probe waits for the first use of its code path (``fixes._base.deferred``) is not counted until then;
    while the processor path's group waits, the hook holds the line and the group writes it once probed.
    :func:`parse_summary` reads the line back. Pure: reads ``status`` only.
    """
    fixes = status.fixes
    applied = [n for n in registry if n in fixes and fixes[n].applied]
    names = "none: off" if not applied and status.mode == "off" else _render(applied, registry)
    unsure = [n for n in registry if n in fixes and not fixes[n].applied
              and fixes[n].verdict in ("unrecognised", "undetermined") and status.mode != "off"]
    failed = [n for n in registry if n in fixes and fixes[n].verdict == "error"]
    left_out = [n for n in registry if n in fixes and fixes[n].left_out]
    # Subclasses of the patched classes that no family member owns (a model vLLM added after this package): each
    # fix that would reach them hands them to vLLM, and says so here and in doctor.
    uncovered = sorted({key.rpartition(".")[0].rpartition(".")[2] or key for n in registry if n in fixes
                        for key, row in (fixes[n].models or {}).items() if isinstance(row, dict) and row.get("unknown")})
    rest = "".join(f"; {label}: {_render(chosen, registry)}" for label, chosen in
                   (("left out", left_out), ("could not tell", unsure), ("failed", failed)) if chosen) + (
        f"; not covered: {_not_covered(uncovered)}" if uncovered else "") + _backports_part(status)
    if status.models:
        numbers = [m.split()[-1] for m in status.models]
        models = f"MiniCPM-V {'/'.join(numbers)}"
    else:
        models = "no MiniCPM-V model"
    return (f"{SUMMARY_PREFIX}{models}, vLLM {status.vllm_version}, mode {status.mode}, pid {status.pid}: patched "
            f"{len(applied)}/{len(registry)} ({names}){rest}; details: vllm-minicpm-hotfix doctor")


def summary_logged() -> bool:
    """Whether this process has logged its summary line (:func:`log_summary`)."""
    return getattr(logger, "_vllm_minicpm_hotfix_summary_pid", None) == os.getpid()


def log_summary(status: Status, registry: list[str]) -> bool:
    """Log :func:`summary_line` at WARNING, once per process: a second copy of the package in the same process (a
    bundle next to a pip install) logs nothing. Returns whether it logged. The mark is kept on the shared
    ``vllm.minicpm_hotfix`` logger object (one per process, whichever copy created it), keyed by pid so a forked
    child logs its own line."""
    with _LOCK:
        if summary_logged():
            return False
        logger._vllm_minicpm_hotfix_summary_pid = os.getpid()  # type: ignore[attr-defined]
    logger.warning("%s", summary_line(status, registry))
    return True


def parse_summary(log: str, registry: list[str]) -> list[dict[str, Any]]:
    """Every :func:`summary_line` in ``log`` (text of any number of lines), in order, as dicts: ``models`` (list of
    member names), ``vllm``, ``mode``, ``pid`` (int), ``applied`` (NAMEs, ``all`` / ``all but`` expanded against
    ``registry``, in registry order), ``total`` (int), ``left_out``, ``could_not_tell`` and ``failed`` (NAMEs),
    ``backports`` (MiniCPM-V member -> what the line says of it, e.g. ``{"MiniCPM-V 4.7": "registered by the
    hotfix"}``; MiniCPM-OCR's part is on the line and not in this dict, as before),
    ``line`` (the line
    from ``vllm-minicpm-hotfix:`` on)."""
    out = []
    says = "|".join(re.escape(w) for w in _BACKPORT_SAYS)
    for m in SUMMARY_PATTERN.finditer(log):
        applied = _expand(m["names"], registry)
        rest = {k: _expand(v, registry)
                for k, v in re.findall(r"; (left out|could not tell|failed): ([^;]+)", m["rest"])}
        backports = {_long(member): what for members, what in re.findall(rf"; ([\w.]+(?:, [\w.]+)*): ({says})(?=;|$)",
                                                                        m["rest"]) for member in members.split(", ")
                     if member[:1].isdigit()}  # the MiniCPM-V members (4.7), as the tests of serving read them
        models = m["models"]
        out.append({
            "models": [] if models.startswith("no ") else [f"MiniCPM-V {n}" for n in models.split()[-1].split("/")],
            "vllm": m["vllm"], "mode": m["mode"], "pid": int(m["pid"]), "applied": applied,
            "total": int(m["total"]), "could_not_tell": rest.get("could not tell", []), "failed": rest.get("failed", []),
            "left_out": rest.get("left out", []), "backports": backports, "line": m.group(0),
        })
    return out
