"""Apply the decision to an imported ``vllm.model_executor.models.minicpmv4_6``: transactional and idempotent.

Every attribute set here is recorded with its previous value, so a failure half-way restores the module exactly as
vLLM defined it, and :func:`revert` can undo a successful patch (tests and ``importlib.reload`` use that).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from . import decision, qkv_loader
from .record import FixStatus, current, installed_vllm_version, logger

_MISSING = object()
#: fix name -> {(class, attribute): value before we set it (``_MISSING`` if the class itself did not define it)}.
_ORIGINALS: dict[str, dict[tuple[type, str], Any]] = {}

QKV_FIX = "qkv_loader"


def _set(cls: type, attr: str, value: Any, undo: list) -> None:
    undo.append((cls, attr, cls.__dict__.get(attr, _MISSING)))
    setattr(cls, attr, value)


def _undo(undo: list) -> None:
    for cls, attr, old in reversed(undo):
        if old is _MISSING:
            if attr in cls.__dict__:
                delattr(cls, attr)
        else:
            setattr(cls, attr, old)


def set_attributes(fix: str, changes: Iterable[tuple[type, str, Callable[[Any], Any]]]) -> None:
    """Set class attributes for ``fix``, all or nothing: ``changes`` yields ``(class, attribute, make)`` and the new
    value is ``make(current value)``. On any exception every attribute already set is restored and it re-raises.
    The previous values are kept for :func:`revert_fix`."""
    undo: list = []
    try:
        for cls, attr, make in changes:
            _set(cls, attr, make(getattr(cls, attr, None)), undo)
    except BaseException:
        _undo(undo)
        raise
    saved = _ORIGINALS.setdefault(fix, {})
    for cls, attr, old in undo:
        saved.setdefault((cls, attr), old)


def revert_fix(fix: str, module: ModuleType | None = None) -> bool:
    """Restore what ``fix`` set (in ``module``'s classes only, if given); mark its status entry ``reverted``.
    Returns whether anything was set."""
    saved = _ORIGINALS.get(fix, {})
    keys = [k for k in saved if module is None or k[0].__module__ == module.__name__]
    _undo([(cls, attr, saved.pop((cls, attr))) for cls, attr in keys])
    if keys:
        entry = current().fixes.get(fix)
        if entry is not None:
            entry.applied, entry.why = False, "reverted"
    return bool(keys)


def revert(module: ModuleType | None = None) -> bool:
    """Restore every class attribute any fix set (in ``module`` only, if given). Returns whether any was set."""
    return any([revert_fix(fix, module) for fix in list(_ORIGINALS)])


def run_fix(
    name: str,
    module: ModuleType,
    *,
    label: str,
    already_patched: bool,
    probe: Callable[[], Any],
    decide: Callable[[decision.Mode, Any], decision.Decision],
    apply: Callable[[], None],
) -> FixStatus:
    """The plumbing every fix shares: read the mode, probe (not under ``off``), decide, apply, record the outcome in
    the status record under ``name`` and log one line with the pid.

    ``probe()`` returns a verdict with ``state`` (a :class:`decision.State`) and ``reason``; ``decide(mode, verdict)``
    a :class:`decision.Decision`; ``apply()`` patches (via :func:`set_attributes`). A fix already patched in this
    process is reported as such and left alone. Raises only what ``apply`` raises (the post-import hook catches and
    logs it); the module is then left exactly as it was.
    """
    status = current()
    if already_patched:
        fix = status.fixes.get(name) or FixStatus(name, "n/a", "patched before this status record began", True, "")
        fix.applied, fix.why = True, "already patched in this process"
        status.fixes[name] = fix
        return fix
    mode = decision.Mode(status.mode)
    if mode is decision.Mode.OFF:
        verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)")
    else:
        verdict = probe()
    chosen = decide(mode, verdict)
    fix = FixStatus(name, verdict.state.value, verdict.reason, False, chosen.why)
    status.fixes[name] = fix
    version = installed_vllm_version()
    if chosen.apply:
        apply()
        fix.applied = True
        # WARNING, not INFO: patching vLLM must be impossible to miss, also where vLLM has not configured its
        # logging yet (0.32+ configures it lazily, so an INFO line from a script would be dropped).
        logger.warning(
            "vllm-minicpm-hotfix: MiniCPM-V 4.6 %s PATCHED in pid %d (vLLM %s, mode %s): %s",
            label, os.getpid(), version, mode.value, chosen.why,
        )
    else:
        unsure = verdict.state in (decision.State.UNRECOGNISED, decision.State.UNDETERMINED)
        level = logging.WARNING if unsure and mode is not decision.Mode.OFF else logging.INFO
        logger.log(
            level, "vllm-minicpm-hotfix: %s not applied in pid %d (vLLM %s): %s", label, os.getpid(), version, chosen.why
        )
    return fix


# --------------------------------------------------------------------------------------------------------------------
# The q/k/v loader fix
# --------------------------------------------------------------------------------------------------------------------


def is_patched(cls: type, attr: str = "load_weights") -> bool:
    return getattr(cls.__dict__.get(attr), qkv_loader.MARKER_ATTR, None) is not None


def _apply_qkv_fix(module: ModuleType) -> None:
    model_cls = getattr(module, decision.MODEL_CLASS)
    attn_cls = getattr(module, decision.ATTN_CLASS)
    set_attributes(
        QKV_FIX,
        [
            (attn_cls, "load_weights", lambda _: qkv_loader.load_weights),
            (model_cls, "load_weights", lambda original: qkv_loader.wrap_model_load_weights(original, attn_cls)),
        ],
    )


def apply_qkv_fix(module: ModuleType) -> FixStatus:
    """Decide and, if so decided, attach the q/k/v loader to ``module``'s classes. Records and returns the outcome.

    Idempotent: a module already patched is reported as such and left alone. Raises only what the patching itself
    raises (the caller, the post-import hook, catches and logs it); the module is then left exactly as it was.
    """
    attn_cls = getattr(module, decision.ATTN_CLASS, None)
    return run_fix(
        QKV_FIX,
        module,
        label="vit_merger q/k/v loader",
        already_patched=isinstance(attn_cls, type) and is_patched(attn_cls),
        probe=lambda: decision.probe_qkv_loading(module),
        decide=decision.decide,
        apply=lambda: _apply_qkv_fix(module),
    )
