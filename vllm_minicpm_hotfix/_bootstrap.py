"""Start-up activation: arm the hotfix in every Python process, install it only in those that import vLLM.

Two start-up paths call :func:`activate`: the ``vllm-minicpm-hotfix.pth`` file a ``pip install`` puts in
site-packages (``source="pth"``), and the ``sitecustomize.py`` of a PYTHONPATH-injected folder
(``source="sitecustomize"``). Both run in *every* Python process of the environment, most of which never import
vLLM, so nothing is imported here at start-up: this module imports only ``sys`` (``os`` is only touched through
``sys.modules``, where ``site`` has already put it). :func:`activate` puts one small finder, :class:`_WaitForVllm`, at
the front of ``sys.meta_path``. It finds nothing itself; when the top-level ``vllm`` package is first imported it
takes itself off ``sys.meta_path`` and calls :func:`install_now`, which imports ``wrapt`` and the post-import hook
(:mod:`vllm_minicpm_hotfix.hook`) and registers it, before any of vLLM's own code runs. The ``vllm.general_plugins``
entry point (:mod:`vllm_minicpm_hotfix.plugin`) calls :func:`install_now` directly.

``wrapt``: an installed one always wins. Only when the environment has none is the pure-Python copy a bundle ships
in ``<bundle>/_vllm_minicpm_hotfix_vendor`` (next to this package, see :mod:`vllm_minicpm_hotfix.bundle`) appended
to the *end* of ``sys.path``.

``VLLM_MINICPM_HOTFIX=off`` (or ``0``, ``false``, ``no``, ``disable``, ``disabled``): the automatic paths do
nothing at all -- no finder, no wrapt, no hook. An explicit ``vllm_minicpm_hotfix.install()`` still registers the
hook, which then decides "off" and leaves vLLM untouched.

Idempotent across paths: only one waiting finder per process (whoever arms second sees the first), and the hook
registers once per process; a second copy of the package (say a bundle on PYTHONPATH shadowing a pip install) finds
the classes already marked as patched and leaves them alone. Nothing here raises.
"""

import sys

ENV_VAR = "VLLM_MINICPM_HOTFIX"
#: Values of :data:`ENV_VAR` that switch the hotfix off (the same set as ``decision.mode_from_env``).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))
#: Folder, next to the package, where a bundle keeps its pure-Python wrapt.
VENDOR_DIR = "_vllm_minicpm_hotfix_vendor"
#: Attribute that marks our finder on ``sys.meta_path``, whichever copy of this module made it.
FINDER_FLAG = "_vllm_minicpm_hotfix_waiting"

#: What activated the hotfix in this process, in order ("pth", "sitecustomize", "plugin", ...), for tests and doctor.
activations = []


def disabled(environ=None):
    """Whether ``VLLM_MINICPM_HOTFIX`` switches the hotfix off."""
    if environ is None:
        os = sys.modules.get("os")
        environ = os.environ if os is not None else {}
    return environ.get(ENV_VAR, "").strip().lower() in OFF_VALUES


def waiting():
    """The finder waiting for ``import vllm`` in this process, or None."""
    for finder in sys.meta_path:
        if getattr(finder, FINDER_FLAG, False):
            return finder
    return None


class _WaitForVllm:
    """A ``sys.meta_path`` finder that finds nothing. On the first ``import vllm`` it removes itself and installs
    the post-import hook, then finishes the search for ``vllm`` over the finders that followed it (the import system
    is iterating ``sys.meta_path`` while we shorten it, so one would otherwise be skipped)."""

    _vllm_minicpm_hotfix_waiting = True

    def __init__(self, source):
        self.source = source
        self.fired = False

    def __repr__(self):
        return f"<vllm-minicpm-hotfix: waiting for 'import vllm' ({self.source})>"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "vllm" or self.fired:
            return None
        self.fired = True
        meta_path = sys.meta_path
        try:
            index = meta_path.index(self)
        except ValueError:
            rest = []
        else:
            rest = meta_path[index + 1:]
            del meta_path[index]
        install_now(self.source)
        for finder in rest:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def invalidate_caches(self):
        pass


def activate(source="bootstrap"):
    """Arm the hotfix in this process: install it at once if vLLM is already imported, else wait for
    ``import vllm``. Returns True if this call armed or installed it. Imports nothing; never raises."""
    try:
        if disabled():
            return False
        if "vllm" in sys.modules:
            return install_now(source)
        if waiting() is not None:
            return False
        sys.meta_path.insert(0, _WaitForVllm(source))
        return True
    except Exception:  # noqa: BLE001 - never break interpreter start-up
        return False


def _ensure_wrapt():
    """Make ``import wrapt`` work: the installed wrapt if there is one, else a bundle's pure-Python copy."""
    try:
        import wrapt  # noqa: F401
        return
    except ImportError:
        pass
    import os

    vendor = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), VENDOR_DIR)
    if os.path.isdir(vendor) and vendor not in sys.path:
        sys.path.append(vendor)


def install_now(source="explicit"):
    """Register the post-import hook now (wrapt and the hook module are imported here). Returns True if this call
    registered it, False if it was already registered, switched off, or failed (logged). Never raises."""
    try:
        if disabled():
            return False
        _ensure_wrapt()
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
