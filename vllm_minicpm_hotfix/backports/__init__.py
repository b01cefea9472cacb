"""Backports: model architectures a vLLM release lacks, added through vLLM's public registries. A backport is not a
fix: it repairs nothing of vLLM's; it gives a release a model a later release ships.

Every module listed in :data:`BACKPORTS` has the same small interface::

    NAME: str                        # key in status()["backports"], doctor; the module's name, e.g. "minicpmv4_7"
    LABEL: str                       # what it adds, in words
    ARCH: str                        # the architecture it registers ("MiniCPMV4_7ForConditionalGeneration")
    MEMBER: str                      # the family member it gives ("MiniCPM-V 4.7")
    def probe(registry_module) -> Verdict   # MISSING where vLLM lacks it and it can be added; never raises
    def register(registry_module) -> None   # ModelRegistry.register_model(ARCH, "module:Class"), the lazy form
    def unregister(registry_module) -> bool # undo register

:func:`run` is what the post-import hook on vLLM's model registry module (``vllm.model_executor.models.registry``,
:func:`vllm_minicpm_hotfix.hook.on_registry_import`) calls in every vLLM process: per backport, the mode
(``VLLM_MINICPM_HOTFIX``), its probe and :func:`vllm_minicpm_hotfix.decision.decide` say whether to register; the
outcome goes to ``status()["backports"][NAME]`` and one INFO line. A backport is registered under ``auto`` and
``force`` where its probe answers ``missing``, never under ``off`` and never over an architecture vLLM (or another
plugin) registers itself.

Importing this package imports the backport modules, none of which imports vLLM, torch or transformers; the model
classes live in :mod:`vllm_minicpm_hotfix.backports.models`, which only vLLM's registry imports.
"""

from __future__ import annotations

import traceback
from types import ModuleType

from .. import decision
from ..record import BackportStatus, current, logger
from . import minicpm_ocr, minicpmv4_7

#: The backports, in the order the hook runs them.
BACKPORTS: tuple[ModuleType, ...] = (minicpmv4_7, minicpm_ocr)


def run(registry_module: ModuleType) -> dict[str, BackportStatus]:
    """Probe, decide and register every backport on vLLM's registry module; record each in the status. Never raises:
    a backport that fails is unregistered again (vLLM left as it was), recorded as ``error`` and named in one
    WARNING line. Returns the status rows."""
    status = current()
    for backport in BACKPORTS:
        try:
            status.backports[backport.NAME] = _run_one(backport, registry_module, decision.Mode(status.mode))
        except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's import
            try:
                backport.unregister(registry_module)
            except Exception:  # noqa: BLE001, S110 - already as vLLM had it
                pass
            status.backports[backport.NAME] = BackportStatus(
                backport.NAME, backport.MEMBER, "error", "", False, "hook failed; vLLM left as it was",
                f"{type(exc).__name__}: {exc}", backport.LABEL)
            logger.warning("vllm-minicpm-hotfix: the backport %s (%s) failed, vLLM left without it: %s\n%s",
                           backport.NAME, backport.MEMBER, exc, traceback.format_exc())
    return status.backports


def _run_one(backport: ModuleType, registry_module: ModuleType, mode: decision.Mode) -> BackportStatus:
    if mode is decision.Mode.OFF:
        verdict = decision.Verdict(decision.State.UNDETERMINED, "not probed (off)", applicable=False)
    else:
        verdict = backport.probe(registry_module)
    chosen = decision.decide(mode, verdict)
    if chosen.apply:
        backport.register(registry_module)
    row = BackportStatus(backport.NAME, backport.MEMBER, verdict.state.value, verdict.reason, chosen.apply,
                         chosen.why, label=backport.LABEL)
    logger.info("vllm-minicpm-hotfix: backport %s (%s) %s: %s", backport.NAME, backport.MEMBER,
                "REGISTERED" if chosen.apply else "not registered", chosen.why)
    return row


def by_name(name: str) -> ModuleType:
    """The backport module whose ``NAME`` is ``name``. Raises ``KeyError`` naming the known ones."""
    for backport in BACKPORTS:
        if backport.NAME == name:
            return backport
    raise KeyError(f"no backport named {name!r}; known: {[b.NAME for b in BACKPORTS]}")


def names() -> list[str]:
    """Every backport's ``NAME``, in order."""
    return [backport.NAME for backport in BACKPORTS]


__all__ = ["BACKPORTS", "by_name", "names", "run"]
