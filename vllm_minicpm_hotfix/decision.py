"""The decision every fix shares: the mode (``VLLM_MINICPM_HOTFIX``), the verdict a fix's probe returns, and how the
two combine.

No fix decides from a version string (dev builds, vendor forks and future releases carry versions no list knows):
each fix's ``probe(module)`` runs the installed vLLM's (and transformers') own code on stand-ins and returns a
:class:`Verdict`; :func:`decide` turns mode + verdict into apply / leave alone. The probes live with their fixes in
:mod:`vllm_minicpm_hotfix.fixes`.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import NamedTuple

ENV_VAR = "VLLM_MINICPM_HOTFIX"


class Mode(str, enum.Enum):
    """``VLLM_MINICPM_HOTFIX``: ``auto`` (default) patches where vLLM is broken, ``force`` wherever the class
    exists, ``off`` never."""

    AUTO = "auto"
    FORCE = "force"
    OFF = "off"


#: Values of ``VLLM_MINICPM_HOTFIX`` that mean ``off`` (the start-up module ``_vllm_minicpm_hotfix_arm`` keeps a copy,
#: since it may import nothing; tests/activation/test_hook.py keeps the two equal).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))


def mode_from_env(environ: Mapping[str, str] | None = None) -> tuple[Mode, str | None]:
    """Read ``VLLM_MINICPM_HOTFIX``. Returns ``(mode, problem)``: an unknown value yields ``AUTO`` and a message."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in ("", "auto", "1", "on", "true", "yes"):
        return Mode.AUTO, None
    if value in ("force", "always"):
        return Mode.FORCE, None
    if value in OFF_VALUES:
        return Mode.OFF, None
    return Mode.AUTO, f"{ENV_VAR}={raw!r} is not one of auto, force, off; using auto"


#: ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES=name[,name...]``: fixes left out (not probed, not applied) in every process
#: that reads it, the rest applied as the mode says (the convention of OpenTelemetry's
#: ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS``).
DISABLED_VAR = "VLLM_MINICPM_HOTFIX_DISABLED_FIXES"


def disabled_from_env(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The fix NAMEs ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` lists (comma-separated, spaces and case ignored; empty
    when unset). Names no fix has are kept: the hook reports them once."""
    raw = (os.environ if environ is None else environ).get(DISABLED_VAR, "")
    return frozenset(n.strip().lower() for n in raw.split(",") if n.strip())


class State(str, enum.Enum):
    BROKEN = "broken"  #: the installed code misbehaves in the way the fix repairs
    CORRECT = "correct"  #: the installed code behaves correctly: the fix is not needed
    UNRECOGNISED = "unrecognised"  #: the classes / methods the fix targets are not there
    UNDETERMINED = "undetermined"  #: the probe itself could not run on this installation
    #: a backport's verdict (:mod:`vllm_minicpm_hotfix.backports`): the architecture is not in the installed vLLM's
    #: model registry and everything it needs is installed, so the backport registers it
    MISSING = "missing"


class Verdict(NamedTuple):
    """What a fix's probe found. ``applicable``: the fix can safely be applied here (``force`` applies it wherever
    this is true; ``UNRECOGNISED`` is never applicable). ``guard``: an ``UNDETERMINED`` verdict of a guard (a fix
    that only refuses what would fail later anyway) whose probe showed the guard itself works on this installation:
    ``auto`` applies it too, so a probe that cannot tell does not silently take the protection away. Immutable (a
    ``NamedTuple``, not a frozen dataclass: the class is made in the post-import hook of every vLLM process, and a
    dataclass costs half a millisecond there)."""

    state: State
    reason: str
    applicable: bool = True
    guard: bool = False

    @property
    def broken(self) -> bool:
        return self.state is State.BROKEN


class Decision(NamedTuple):
    """Whether a fix is applied, and why (from :func:`decide`)."""

    apply: bool
    why: str


def decide(mode: Mode, verdict: Verdict) -> Decision:
    """Combine the mode and a fix's verdict.

    ``off``: never. Not applicable (``UNRECOGNISED``, or ``verdict.applicable`` false): never, ``force`` included --
    there the fix could only do nothing or harm. ``force``: wherever applicable. ``auto``: where the verdict is
    ``BROKEN`` (a backport: ``MISSING``); a verdict the probe could not reach (``UNDETERMINED``) leaves vLLM
    untouched, except a guard's whose probe showed the guard works here (``verdict.guard``): applied.
    """
    if mode is Mode.OFF:
        return Decision(False, f"{ENV_VAR}=off")
    if verdict.state is State.UNRECOGNISED:
        return Decision(False, f"layout not recognised, vLLM left untouched: {verdict.reason}")
    if not verdict.applicable:
        suffix = f" ({ENV_VAR}=force does not apply it here: not applicable)" if mode is Mode.FORCE else ""
        return Decision(False, f"{verdict.reason}{suffix}")
    if mode is Mode.FORCE:
        return Decision(True, f"{ENV_VAR}=force (verdict: {verdict.state.value})")
    if verdict.state is State.BROKEN:
        return Decision(True, f"broken here: {verdict.reason}")
    if verdict.state is State.MISSING:
        return Decision(True, f"missing here: {verdict.reason}")
    if verdict.state is State.UNDETERMINED and verdict.guard:
        return Decision(True, f"could not tell whether vLLM needs it ({verdict.reason}); applied anyway: a guard that "
                              "only refuses what would fail later")
    if verdict.state is State.CORRECT:
        return Decision(False, f"not needed: {verdict.reason}" if not verdict.reason.startswith("not needed") else verdict.reason)
    return Decision(
        False,
        f"could not tell whether the fix is needed ({verdict.reason}); vLLM left untouched, "
        f"set {ENV_VAR}=force to apply it anyway",
    )
