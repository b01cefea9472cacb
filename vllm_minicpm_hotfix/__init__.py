"""vllm-minicpm-hotfix: make MiniCPM-V 4.6 load bit-exact on the vLLM you already have.

Public API:

* :func:`install` -- register the post-import hook on ``vllm.model_executor.models.minicpmv4_6`` (idempotent).
* :func:`status` -- what the hotfix did in this process, as a JSON-serialisable dict.
* ``__version__`` -- this copy's version (str): the installed distribution's metadata (``importlib.metadata``) when
  that distribution is this copy, else :data:`SOURCE_VERSION` (a bundle or a clone on ``PYTHONPATH`` has no
  metadata, or shadows another installed copy's). Computed on first access.

Importing this package is cheap: it imports neither wrapt, torch, vLLM nor ``importlib.metadata``.
"""

from __future__ import annotations

import os

#: The version of this source tree; equal to ``[project] version`` of pyproject.toml (tests/release/test_release.py).
SOURCE_VERSION = "0.1.0"
DISTRIBUTION = "vllm-minicpm-hotfix"
__all__ = ["install", "status", "__version__"]


def _metadata_version() -> str | None:
    """The version in the installed ``vllm-minicpm-hotfix`` distribution's metadata if that distribution is this
    copy (its wheel put this ``__init__.py`` there, or its editable ``.pth`` names this tree), else None."""
    try:
        from importlib import metadata

        dist = metadata.distribution(DISTRIBUTION)
        here = os.path.realpath(__file__)
        if os.path.realpath(str(dist.locate_file(f"{__name__}/__init__.py"))) == here:
            return dist.version
        tree = os.path.dirname(os.path.dirname(here))
        for f in dist.files or ():
            if f.name.endswith(".pth") and f.name != "vllm-minicpm-hotfix.pth":  # an editable install's path file
                lines = (ln.strip() for ln in f.read_text().splitlines()) if f.read_text() else ()
                if any(os.path.realpath(ln) == tree for ln in lines if ln and not ln.startswith(("#", "import"))):
                    return dist.version
    except Exception:  # noqa: BLE001 - no metadata (bundle, PYTHONPATH) or an unreadable one: the source version
        return None
    return None


def __getattr__(name: str) -> str:
    if name == "__version__":
        version = _metadata_version() or SOURCE_VERSION
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install() -> bool:
    """Register the post-import hook (see :func:`vllm_minicpm_hotfix.hook.install`)."""
    from .hook import install as _install

    return _install()


def status() -> dict:
    """This process's record: ``pid``, ``mode``, ``hook_installed``, ``module_imported``, ``vllm_version`` and, once
    vLLM has imported the model module, every fix of :data:`vllm_minicpm_hotfix.fixes.REGISTRY` by ``NAME`` with its
    ``verdict``, ``reason``, ``applied``, ``why``, ``error``, ``label`` and ``first_use`` (probed at the first use
    of its code path; ``verdict`` is ``"deferred"`` until then; the processor path's fixes, if they still wait, are
    probed and decided by this call, as vLLM's first processor would); once vLLM has imported its model registry, every
    backport of :data:`vllm_minicpm_hotfix.backports.BACKPORTS` under ``backports`` by ``NAME`` with its ``member``,
    ``verdict`` (``missing`` / ``correct`` / ...), ``reason``, ``registered``, ``why`` and ``error``."""
    import sys

    from .record import current

    deferred = sys.modules.get(__name__ + ".fixes._base.deferred")
    if deferred is not None:  # the processor-path probes, if they still wait: probed now, as their first use would
        deferred.resolve_group()
    return current().as_dict()
