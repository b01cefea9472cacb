"""Activation at ``import vllm``: import wrapt and register the post-import hook, in every process that imports vLLM.

Three paths call :func:`install_now`:

* the start-up module ``_vllm_minicpm_hotfix_arm`` (top level, next to this package), which waits on
  ``sys.meta_path`` as a finder -- armed after ``pip install`` by ``vllm-minicpm-hotfix.pth`` (``source="pth"``) or,
  on Python 3.15+, by ``vllm-minicpm-hotfix.start`` (``source="start"``, PEP 829), and by the ``sitecustomize.py`` of
  a PYTHONPATH-injected folder (``source="sitecustomize"``) -- when ``import vllm`` starts,
  before any of vLLM's own code runs. Start-up itself loads only that one small module, never this package: most
  processes of an environment never import vLLM;
* the ``vllm.general_plugins`` entry point (:mod:`vllm_minicpm_hotfix.plugin`, ``source="plugin"``);
* :func:`vllm_minicpm_hotfix.install` goes straight to :func:`vllm_minicpm_hotfix.hook.install`.

``wrapt``: an installed one always wins. Only when the environment has none is the pure-Python copy a bundle ships
in ``<bundle>/_vllm_minicpm_hotfix_vendor`` (next to this package, see :mod:`vllm_minicpm_hotfix.cli.bundle`) appended
to the *end* of ``sys.path``.

``VLLM_MINICPM_HOTFIX=off``: :func:`install_now` does nothing (the start-up module does not even arm). An explicit
``vllm_minicpm_hotfix.install()`` still registers the hook, which then decides "off" and leaves vLLM untouched.

Idempotent across paths: the hook registers once per process, and a second copy of the package (say a bundle on
PYTHONPATH shadowing a pip install) finds the classes already marked as patched and leaves them alone. Nothing here
raises.
"""

import sys

from ._wrapt import VENDOR_DIR, ensure_wrapt
#: The start-up module the ``.pth`` and ``sitecustomize.py`` import (top level, next to the package). Both may import
#: nothing, so they spell the name themselves; tests/activation/test_names.py keeps them equal to this.
ARM_MODULE = "_vllm_minicpm_hotfix_arm"
#: The attribute that marks the start-up module waiting on ``sys.meta_path`` (the start-up module's own
#: ``FINDER_FLAG``, kept equal by tests/activation/test_names.py).
FINDER_FLAG = "_vllm_minicpm_hotfix_waiting"
#: The ``.pth`` file a pip install puts in site-packages (the file of that name at the repository root).
PTH_NAME = "vllm-minicpm-hotfix.pth"
#: Its PEP 829 start-up file next to it (Python 3.15+ call its entry point and skip the ``.pth``'s import line).
START_NAME = "vllm-minicpm-hotfix.start"
#: The module attribute (``= True``) that marks the hotfix's ``sitecustomize.py``.
SITECUSTOMIZE_MARKER = "VLLM_MINICPM_HOTFIX_SITECUSTOMIZE"

#: What activated the hotfix in this process, in order ("pth", "start", "sitecustomize", "plugin", ...), for tests and
#: doctor.
activations = []


def disabled(environ=None):
    """Whether ``VLLM_MINICPM_HOTFIX`` switches the hotfix off (:func:`vllm_minicpm_hotfix.decision.mode_from_env`)."""
    from .decision import Mode, mode_from_env

    return mode_from_env(environ)[0] is Mode.OFF


def install_now(source="explicit"):
    """Register the post-import hook now (wrapt and the hook module are imported here). Returns True if this call
    registered it, False if it was already registered, switched off, or failed (logged). Never raises."""
    try:
        if disabled():
            return False
        ensure_wrapt()
        from . import hook

        done = hook.install()
        activations.append(source)
        return done
    except Exception as exc:  # noqa: BLE001 - never break vLLM's import or its plugin loading
        try:
            import logging

            logging.getLogger("vllm.minicpm_hotfix").warning(
                "vllm-minicpm-hotfix: could not activate (%s) in pid %d, vLLM left unpatched: %s: %s",
                source, sys.modules["os"].getpid(), type(exc).__name__, exc,
            )
        except Exception:  # noqa: BLE001, S110 - logging itself broken
            pass
        return False
