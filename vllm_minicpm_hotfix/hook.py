"""The activation core: a ``wrapt`` post-import hook on ``vllm.model_executor.models.minicpmv4_6`` (the fixes) and
one on ``vllm.model_executor.models.registry`` (the backports).

:func:`install` registers :func:`on_import` with ``wrapt.register_post_import_hook`` (wrapt's ``importer.py``): it
runs when vLLM imports the model module, or at once if it is already imported. Every activation path -- the
``vllm.general_plugins`` entry point, the ``.pth`` bootstrap, ``sitecustomize.py`` and an explicit
``vllm_minicpm_hotfix.install()`` -- ends here, and installing twice registers once.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from types import ModuleType

from .record import FixStatus, current, installed_vllm_version, log_summary, logger, summary_line, summary_logged

TARGET_MODULE = "vllm.model_executor.models.minicpmv4_6"
#: vLLM's model registry module (``ModelRegistry``): the backports (:mod:`vllm_minicpm_hotfix.backports`) register
#: the architectures a release lacks when it is imported, before vLLM resolves any architecture.
REGISTRY_MODULE = "vllm.model_executor.models.registry"
#: The other family members' model modules (``fixes._base.FAMILY``; not imported here, to keep this module light).
MEMBER_MODULES = ("vllm.model_executor.models.minicpmv4_7", "vllm_minicpm_hotfix.backports.models.minicpmv4_7",
                  "vllm.model_executor.models.minicpm_ocr", "vllm_minicpm_hotfix.backports.models.minicpm_ocr")

_LOCK = threading.Lock()
_installed = False


def on_import(module: ModuleType) -> None:
    """Apply every fix of :data:`vllm_minicpm_hotfix.fixes.REGISTRY`, in order, to the freshly imported model module.
    Never raises: a failure is logged, recorded in the status, and the module is left exactly as vLLM defined it
    (each fix is transactional). Each fix runs in its own ``try``, so one failing does not stop the others."""
    status = current()
    try:
        status.module_imported = True
        status.vllm_version = installed_vllm_version()
    except Exception:  # pragma: no cover - the status record itself broken
        pass
    try:
        from .fixes import REGISTRY, _base
    except Exception as exc:  # noqa: BLE001 - a broken install must not break vLLM's import
        logger.warning("vllm-minicpm-hotfix: the fixes could not be imported, vLLM left unpatched: %s", exc)
        return
    waiting = [name for name in MEMBER_MODULES if _base.initialising(name)]
    if waiting:  # vLLM is importing 4.7, which imports this module first: on_member_import runs the fixes
        logger.info("vllm-minicpm-hotfix: %s imported by %s: the fixes run when that import is complete",
                    module.__name__, ", ".join(waiting))
        return
    _check_disabled([fix.NAME for fix in REGISTRY])
    for fix in REGISTRY:
        _guarded(fix.NAME, fix.LABEL, lambda m, fix=fix: _base.run(fix, m), module)
    try:
        # The members every fix was just probed for: those whose model module vLLM has finished importing.
        status.models = list(_base.member_modules(module, imported_only=True))
        names = [fix.NAME for fix in REGISTRY]
        if not _base.deferred.hold_summary(names):  # else written when the group is probed
            log_summary(status, names)
    except Exception as exc:  # noqa: BLE001 - pragma: no cover - the summary itself broken
        logger.warning("vllm-minicpm-hotfix: the summary line failed: %s\n%s", exc, traceback.format_exc())


def on_member_import(member_module: ModuleType) -> None:
    """The post-import hook on every other family member's model module (:data:`MEMBER_MODULES`: vLLM 0.32+'s
    ``minicpmv4_7``), run when that module's body is complete.

    Serving 4.7, vLLM imports ``minicpmv4_7``, which imports ``minicpmv4_6`` first: :func:`on_import` then finds
    ``minicpmv4_7`` still executing (its classes do not exist yet) and waits; this runs :func:`on_import` once
    ``minicpmv4_7`` is complete, so every fix probes 4.6 and 4.7 on their own, unpatched classes. If the hook already
    ran without the member (a process that imported ``minicpmv4_6`` alone and ``minicpmv4_7`` later), every fix is
    reverted and the hook runs again with both members -- probes judge stock classes, and two fixes on one
    attribute chain in registry order -- and one WARNING line says so (the summary line is logged once per process).
    Nothing happens if the hook already probed the member. Never raises: a failure is logged."""
    try:
        from .fixes import REGISTRY, _base

        _base.mark_complete(member_module.__name__)
        member = _base.FAMILY.get(member_module.__name__)
        target = sys.modules.get(TARGET_MODULE)
        status = current()
        if member is None or target is None or member in status.models:
            return
        ran = bool(status.fixes)
        if ran:
            _base.revert()
        on_import(target)
        if ran and summary_logged():  # a line still held is written later, with every member
            line = summary_line(current(), [fix.NAME for fix in REGISTRY])
            logger.warning("vllm-minicpm-hotfix: %s imported in pid %d after the summary line; every fix re-run for %s: "
                           "%s", member, status.pid, ", ".join(current().models),
                           line.partition(f"pid {status.pid}: ")[2])  # not the summary line itself: one per process
    except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's import
        logger.warning("vllm-minicpm-hotfix: the post-import hook on %s failed: %s\n%s",
                       getattr(member_module, "__name__", "?"), exc, traceback.format_exc())


def _check_disabled(known: list[str]) -> None:
    """One WARNING per process for names ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` lists that no fix has, naming the
    known fixes (recorded in ``status()["notes"]``); the other fixes are run as usual. Never raises."""
    try:
        from .decision import DISABLED_VAR, disabled_from_env

        unknown = sorted(disabled_from_env() - set(known))
        status = current()
        note = (f"{DISABLED_VAR} names {', '.join(unknown)}, which no fix has (ignored); the fixes are: "
                f"{', '.join(known)}")
        if unknown and note not in status.notes:
            status.notes.append(note)
            logger.warning("vllm-minicpm-hotfix: %s", note)
    except Exception:  # noqa: BLE001 - pragma: no cover - the record itself broken
        pass


def on_registry_import(module: ModuleType) -> None:
    """The post-import hook on vLLM's model registry module (:data:`REGISTRY_MODULE`): every backport's probe and
    registration (:func:`vllm_minicpm_hotfix.backports.run`). Never raises: a failure logs one WARNING line and
    leaves the registry as vLLM made it."""
    try:
        from . import backports

        backports.run(module)
    except Exception as exc:  # noqa: BLE001 - nothing may escape into vLLM's import
        logger.warning("vllm-minicpm-hotfix: the backports could not run, vLLM's model registry left as it was: %s",
                       exc)


def _guarded(name: str, label: str, apply: Callable[[ModuleType], object], module: ModuleType) -> None:
    """Run one fix; record an exception as an ``error`` :class:`FixStatus` under ``name`` and log it."""
    try:
        apply(module)
    except BaseException as exc:  # noqa: BLE001 - nothing may escape into vLLM's import
        if not isinstance(exc, Exception):
            raise
        try:
            current().fixes[name] = FixStatus(
                name, "error", "", False, "hook failed; vLLM left as it was", f"{type(exc).__name__}: {exc}", label
            )
            logger.warning(
                "vllm-minicpm-hotfix: the post-import hook failed (%s), vLLM left unpatched: %s\n%s",
                name, exc, traceback.format_exc(),
            )
        except Exception:  # pragma: no cover - logging itself broken
            pass


def install() -> bool:
    """Register the post-import hook in this process (idempotent). Returns False if it was already registered.

    Honours ``VLLM_MINICPM_HOTFIX=off`` only at decision time, so ``status()`` still shows the hook saw the module.

    Raises:
        ImportError: ``wrapt`` is not importable.
    """
    global _installed
    with _LOCK:
        if _installed:
            return False
        import wrapt

        _installed = True
        current().hook_installed = True
        wrapt.register_post_import_hook(on_registry_import, REGISTRY_MODULE)
        wrapt.register_post_import_hook(on_import, TARGET_MODULE)
        for name in MEMBER_MODULES:
            wrapt.register_post_import_hook(on_member_import, name)
        return True
