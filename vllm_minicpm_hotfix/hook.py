"""The activation core: a ``wrapt`` post-import hook on ``vllm.model_executor.models.minicpmv4_6``.

:func:`install` registers :func:`on_import` with ``wrapt.register_post_import_hook`` (wrapt's ``importer.py``): it
runs when vLLM imports the model module, or at once if it is already imported. Every activation path -- the
``vllm.general_plugins`` entry point, the ``.pth`` bootstrap, ``sitecustomize.py`` and an explicit
``vllm_minicpm_hotfix.install()`` -- ends here, and installing twice registers once.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from types import ModuleType

from .record import FixStatus, current, installed_vllm_version, log_summary, logger

TARGET_MODULE = "vllm.model_executor.models.minicpmv4_6"

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
    for fix in REGISTRY:
        _guarded(fix.NAME, fix.LABEL, lambda m, fix=fix: _base.run(fix, m), module)
    try:
        status.models = list(_base.member_modules(module))  # the members every fix was just probed for
        log_summary(status, [fix.NAME for fix in REGISTRY])
    except Exception as exc:  # noqa: BLE001 - pragma: no cover - the summary itself broken
        logger.warning("vllm-minicpm-hotfix: the summary line failed: %s\n%s", exc, traceback.format_exc())


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
        wrapt.register_post_import_hook(on_import, TARGET_MODULE)
        return True
