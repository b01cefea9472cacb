"""vllm-minicpm-hotfix start-up arming: the only code the hotfix runs in every Python process of an environment.

Imported at interpreter start-up by ``vllm-minicpm-hotfix.pth`` (pip install) and by the hotfix's
``sitecustomize.py`` (PYTHONPATH injection), which then call :func:`activate`. It is a top-level module, shipped next
to the ``vllm_minicpm_hotfix`` package, so that start-up loads this one small file and not the package: it imports
nothing (``os`` only through ``sys.modules``, where ``site`` has put it).

:func:`activate` puts :class:`_WaitForVllm` at the front of ``sys.meta_path``. It finds nothing itself; on the first
``import vllm`` it takes itself off ``sys.meta_path``, looks vLLM up over the finders that followed it, and -- only if
vLLM is there (otherwise it goes back and waits on) -- calls ``vllm_minicpm_hotfix._bootstrap.install_now``, which imports wrapt and registers the
post-import hook before any of vLLM's own code runs. ``VLLM_MINICPM_HOTFIX=off`` (the off values of
``vllm_minicpm_hotfix.decision.mode_from_env``): nothing at all. Nothing here raises.
"""

import sys

ENV_VAR = "VLLM_MINICPM_HOTFIX"
#: Values of ``VLLM_MINICPM_HOTFIX`` that switch the hotfix off (``decision.mode_from_env``'s; a test keeps them equal).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))
#: Attribute that marks the waiting finder on ``sys.meta_path``, whichever copy of this module made it.
FINDER_FLAG = "_vllm_minicpm_hotfix_waiting"


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
    """A ``sys.meta_path`` finder that finds nothing. On the first ``import vllm`` it removes itself, finishes the
    search for ``vllm`` over the finders that followed it (the import system is iterating ``sys.meta_path`` while we
    shorten it, so one would otherwise be skipped) and, if vLLM was found, installs the post-import hook; if not, it
    puts itself back and keeps waiting."""

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
            index, rest = None, []
        else:
            rest = meta_path[index + 1:]
            del meta_path[index]
        spec = None
        for finder in rest:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is not None:
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
        if spec is not None:
            _install(self.source)
        elif index is not None:
            # No vLLM here: `import vllm` fails as it would without us, we import nothing and wait on, in our place
            # (a later `import vllm` after sys.path changed still finds us).
            self.fired = False
            meta_path.insert(index, self)
        return spec

    def invalidate_caches(self):
        pass


def _install(source):
    try:
        from vllm_minicpm_hotfix._bootstrap import install_now
    except Exception as exc:  # noqa: BLE001 - never break `import vllm`
        try:
            import logging

            logging.getLogger("vllm.minicpm_hotfix").warning(
                "vllm-minicpm-hotfix: could not activate (%s) in pid %d, vLLM left unpatched: %s: %s",
                source, sys.modules["os"].getpid(), type(exc).__name__, exc,
            )
        except Exception:  # noqa: BLE001, S110 - logging itself broken
            pass
        return False
    return install_now(source)


def activate(source):
    """Arm the hotfix in this process: install it at once if vLLM is already imported, else wait for
    ``import vllm``. ``source`` names the path ("pth", "sitecustomize"). Returns True if this call armed or installed
    it. Imports nothing while waiting; never raises."""
    try:
        if disabled():
            return False
        if "vllm" in sys.modules:
            return _install(source)
        if waiting() is not None:
            return False
        sys.meta_path.insert(0, _WaitForVllm(source))
        return True
    except Exception:  # noqa: BLE001 - never break interpreter start-up
        return False
