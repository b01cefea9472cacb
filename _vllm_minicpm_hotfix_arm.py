"""vllm-minicpm-hotfix start-up arming: the only code the hotfix runs in every Python process of an environment.

Imported at interpreter start-up by ``vllm-minicpm-hotfix.pth`` (pip install, Python 3.10-3.14) and by the
hotfix's ``sitecustomize.py`` (PYTHONPATH injection), which then call :func:`activate`; on Python 3.15+ (PEP 829)
``site`` calls :func:`start`, the entry point named in ``vllm-minicpm-hotfix.start``, and skips the ``.pth``'s import
line. It is a top-level module, shipped next to the ``vllm_minicpm_hotfix`` package, so that start-up loads this one
small file and not the package, and it imports nothing (``os`` only through ``sys.modules``, where ``site`` has put
it).

**This module is the waiting finder.** A module object satisfies the ``sys.meta_path`` finder protocol
(``find_spec``, ``invalidate_caches``), so :func:`activate` puts the module itself at the front of
``sys.meta_path`` -- no class is created at start-up (that alone cost ~50 us of a ~11 ms ``python -c pass``;
docs/benchmarks.md). :func:`find_spec` finds nothing itself; on the first ``import vllm`` it takes the module off
``sys.meta_path``, looks vLLM up over the finders that followed it and -- only if vLLM is there (otherwise it goes
back in its place and waits on) -- calls ``vllm_minicpm_hotfix._bootstrap.install_now``, which imports wrapt and
registers the post-import hook before any of vLLM's own code runs.

``VLLM_MINICPM_HOTFIX=off`` (the off values of ``vllm_minicpm_hotfix.decision.mode_from_env``): nothing at all.
Nothing here raises.
"""

import sys

ENV_VAR = "VLLM_MINICPM_HOTFIX"
#: Values of ``VLLM_MINICPM_HOTFIX`` that switch the hotfix off (``decision.mode_from_env``'s; a test keeps them equal).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))
#: Attribute that marks the waiting finder on ``sys.meta_path``, whichever copy of this module it is.
FINDER_FLAG = "_vllm_minicpm_hotfix_waiting"
_vllm_minicpm_hotfix_waiting = True

#: What armed this process ("pth", "start", "sitecustomize"), or None while not armed.
source = None
_fired = False


def disabled(environ=None):
    """Whether ``VLLM_MINICPM_HOTFIX`` switches the hotfix off."""
    if environ is None:
        os = sys.modules.get("os")
        environ = os.environ if os is not None else {}
    return environ.get(ENV_VAR, "").strip().lower() in OFF_VALUES


def waiting():
    """The finder waiting for ``import vllm`` in this process (a copy of this module), or None."""
    for finder in sys.meta_path:
        if getattr(finder, FINDER_FLAG, False):
            return finder
    return None


def find_spec(fullname, path=None, target=None):
    """``sys.meta_path`` finder protocol: None for every name. On the first ``import vllm`` this module leaves
    ``sys.meta_path``, finishes the search for ``vllm`` over the finders that followed it (the import system is
    iterating ``sys.meta_path`` while we shorten it, so one would otherwise be skipped), installs the post-import
    hook if vLLM was found, and returns that spec; if vLLM is not there it goes back in its place and waits on."""
    global _fired
    if fullname != "vllm" or _fired:
        return None
    _fired = True
    me = sys.modules.get(__name__)
    meta_path = sys.meta_path
    try:
        index = meta_path.index(me)
    except ValueError:
        index, rest = None, []
    else:
        rest = meta_path[index + 1:]
        del meta_path[index]
    spec = None
    for finder in rest:
        find = getattr(finder, "find_spec", None)
        if find is not None:
            spec = find(fullname, path, target)
            if spec is not None:
                break
    if spec is not None:
        _install(source)
    elif index is not None:
        # No vLLM here: `import vllm` fails as it would without us, we import nothing, and wait on in our place (a
        # later `import vllm` after sys.path changed still finds us).
        _fired = False
        meta_path.insert(index, me)
    return spec


def invalidate_caches():
    """``sys.meta_path`` finder protocol (``importlib.invalidate_caches``): nothing cached."""


def _install(src):
    try:
        from vllm_minicpm_hotfix._bootstrap import install_now
    except Exception as exc:  # noqa: BLE001 - never break `import vllm`
        try:
            import logging

            logging.getLogger("vllm.minicpm_hotfix").warning(
                "vllm-minicpm-hotfix: could not activate (%s) in pid %d, vLLM left unpatched: %s: %s",
                src, sys.modules["os"].getpid(), type(exc).__name__, exc,
            )
        except Exception:  # noqa: BLE001, S110 - logging itself broken
            pass
        return False
    return install_now(src)


def start():
    """PEP 829 entry point (``_vllm_minicpm_hotfix_arm:start`` in ``vllm-minicpm-hotfix.start``): ``site`` of Python
    3.15+ resolves it with ``pkgutil.resolve_name`` and calls it with no arguments at start-up. Same as
    ``activate("start")``, so idempotent with the ``.pth`` and ``sitecustomize.py``; returns None, never raises."""
    activate("start")


def activate(src):
    """Arm the hotfix in this process: install it at once if vLLM is already imported, else put this module on
    ``sys.meta_path`` to wait for ``import vllm``. ``src`` names the path ("pth", "start", "sitecustomize"). Returns
    True if this call armed or installed it, False if it was off, already armed (by any copy of this module) or failed.
    Imports nothing while waiting; never raises."""
    global source
    try:
        if disabled():
            return False
        if "vllm" in sys.modules:
            return _install(src)
        if waiting() is not None:
            return False
        me = sys.modules.get(__name__)
        if me is None:  # not imported as a module (exec'd by hand): nothing to arm
            return False
        source = src
        sys.meta_path.insert(0, me)
        return True
    except Exception:  # noqa: BLE001 - never break interpreter start-up
        return False
