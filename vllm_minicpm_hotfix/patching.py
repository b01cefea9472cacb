"""Apply the decision to an imported ``vllm.model_executor.models.minicpmv4_6``: transactional and idempotent.

Every attribute set here is recorded with its previous value, so a failure half-way restores the module exactly as
vLLM defined it, and :func:`revert` can undo a successful patch (tests and ``importlib.reload`` use that).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from . import decision, qkv_loader
from .record import FixStatus, current, installed_vllm_version, logger

_MISSING = object()
#: (class, attribute) -> value before we set it (``_MISSING`` if the class itself did not define it).
_ORIGINALS: dict[tuple[type, str], Any] = {}

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


def is_patched(cls: type, attr: str = "load_weights") -> bool:
    return getattr(cls.__dict__.get(attr), qkv_loader.MARKER_ATTR, None) is not None


def _apply_qkv_fix(module: ModuleType) -> None:
    model_cls = getattr(module, decision.MODEL_CLASS)
    attn_cls = getattr(module, decision.ATTN_CLASS)
    undo: list = []
    try:
        _set(attn_cls, "load_weights", qkv_loader.load_weights, undo)
        original = getattr(model_cls, "load_weights")
        _set(model_cls, "load_weights", qkv_loader.wrap_model_load_weights(original, attn_cls), undo)
    except BaseException:
        _undo(undo)
        raise
    for cls, attr, old in undo:
        _ORIGINALS.setdefault((cls, attr), old)


def revert(module: ModuleType | None = None) -> bool:
    """Restore every class attribute the hotfix set (in ``module`` only, if given). Returns whether any was set."""
    keys = [k for k in _ORIGINALS if module is None or k[0].__module__ == module.__name__]
    _undo([(cls, attr, _ORIGINALS.pop((cls, attr))) for cls, attr in keys])
    if keys:
        fix = current().fixes.get(QKV_FIX)
        if fix is not None:
            fix.applied = False
            fix.why = "reverted"
    return bool(keys)


def apply_qkv_fix(module: ModuleType) -> FixStatus:
    """Decide and, if so decided, attach the q/k/v loader to ``module``'s classes. Records and returns the outcome.

    Idempotent: a module already patched is reported as such and left alone. Raises only what the patching itself
    raises (the caller, the post-import hook, catches and logs it); the module is then left exactly as it was.
    """
    status = current()
    mode = decision.Mode(status.mode)
    attn_cls = getattr(module, decision.ATTN_CLASS, None)
    if isinstance(attn_cls, type) and is_patched(attn_cls):
        fix = status.fixes.get(QKV_FIX) or FixStatus(QKV_FIX, "n/a", "patched before this status record began", True, "")
        fix.applied, fix.why = True, "already patched in this process"
        status.fixes[QKV_FIX] = fix
        return fix

    if mode is decision.Mode.OFF:
        verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)")
    else:
        verdict = decision.probe_qkv_loading(module)
    chosen = decision.decide(mode, verdict)
    fix = FixStatus(QKV_FIX, verdict.state.value, verdict.reason, False, chosen.why)
    status.fixes[QKV_FIX] = fix
    version = installed_vllm_version()
    if chosen.apply:
        _apply_qkv_fix(module)
        fix.applied = True
        # WARNING, not INFO: patching vLLM must be impossible to miss, also where vLLM has not configured its
        # logging yet (0.32+ configures it lazily, so an INFO line from a script would be dropped).
        logger.warning(
            "vllm-minicpm-hotfix: MiniCPM-V 4.6 vit_merger q/k/v loader PATCHED in pid %d (vLLM %s, mode %s): %s",
            os.getpid(), version, mode.value, chosen.why,
        )
    elif verdict.state in (decision.State.UNRECOGNISED, decision.State.UNDETERMINED) and mode is not decision.Mode.OFF:
        logger.warning("vllm-minicpm-hotfix: not applied in pid %d (vLLM %s): %s", os.getpid(), version, chosen.why)
    else:
        logger.info("vllm-minicpm-hotfix: not applied in pid %d (vLLM %s): %s", os.getpid(), version, chosen.why)
    return fix
