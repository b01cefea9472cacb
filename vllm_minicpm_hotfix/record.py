"""What the hotfix did in this process: the vLLM version, the mode, and per fix the verdict and whether it applied.

The record is filled by the post-import hook (:mod:`vllm_minicpm_hotfix.hook`) and read through
:func:`vllm_minicpm_hotfix.status`. Everything in it is JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from typing import Any

#: A child of vLLM's ``vllm`` logger, so our lines appear in vLLM's own log stream with its format and level
#: (``VLLM_LOGGING_LEVEL``); without vLLM's logging they reach Python's last-resort handler at WARNING and above.
logger = logging.getLogger("vllm.minicpm_hotfix")


@dataclasses.dataclass
class FixStatus:
    """One fix's outcome in this process."""

    name: str
    verdict: str  #: broken | correct | unrecognised | undetermined | error | deferred (probed at first use, not yet)
    reason: str
    applied: bool
    why: str  #: why it was (not) applied
    error: str | None = None  #: an exception caught inside the hook, if any
    label: str = ""  #: what the fix repairs, in words (the fix module's LABEL)
    #: probed at the first use of its code path instead of at import (fixes._deferred): verdict ``deferred`` until
    #: then, the real verdict after
    first_use: bool = False


@dataclasses.dataclass
class Status:
    pid: int
    mode: str
    hook_installed: bool = False
    module_imported: bool = False
    vllm_version: str | None = None
    fixes: dict[str, FixStatus] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

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
