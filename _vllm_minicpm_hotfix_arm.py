# vllm-minicpm-hotfix start-up arming: the only code the hotfix runs in every Python process of an environment.
#
# Imported at interpreter start-up, and arms itself when imported (the last lines below):
#   * by ``vllm-minicpm-hotfix.pth`` (pip install; Python 3.10-3.14), whose line is the plain ``import`` of this module
#     -- the one statement any ``.pth`` that imports something costs;
#   * on Python 3.15+ (PEP 829) by ``site`` resolving ``_vllm_minicpm_hotfix_arm:start``, the entry point in
#     ``vllm-minicpm-hotfix.start``, whose presence makes ``site`` skip the ``.pth``'s import line;
#   * by the hotfix's ``sitecustomize.py`` (PYTHONPATH injection, bundles).
# It is a top-level module next to the ``vllm_minicpm_hotfix`` package, so that start-up loads this one small file and
# not the package, and it imports nothing (``os`` only through ``sys.modules``, where ``site`` has put it). Its
# explanations are comments, not docstrings: comments are not in the bytecode every process loads
# (docs/benchmarks.md measures what each piece costs).
#
# This module is the waiting finder: a module object satisfies the ``sys.meta_path`` finder protocol (``find_spec``;
# ``invalidate_caches`` is optional), so :func:`activate` puts the module itself at the front of ``sys.meta_path`` --
# no class is created at start-up. ``find_spec`` finds nothing itself; on the first ``import vllm`` it takes the module off
# ``sys.meta_path``, looks vLLM up over the finders that followed it and -- only if vLLM is there (otherwise it goes
# back in its place and waits on) -- calls ``vllm_minicpm_hotfix._bootstrap.install_now``, which imports wrapt and
# registers the post-import hook before any of vLLM's own code runs.
#
# ``VLLM_MINICPM_HOTFIX=off`` (the off values of ``vllm_minicpm_hotfix.decision.mode_from_env``): nothing at all.
# Nothing here raises.
"""vllm-minicpm-hotfix start-up arming: a finder waiting for ``import vllm`` (see the comments at the top)."""

import sys

ENV_VAR = "VLLM_MINICPM_HOTFIX"
# Values of VLLM_MINICPM_HOTFIX that switch the hotfix off (decision.mode_from_env's; a test keeps them equal).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))
# Attribute that marks the waiting finder on sys.meta_path, whichever copy of this module it is.
FINDER_FLAG = "_vllm_minicpm_hotfix_waiting"
_vllm_minicpm_hotfix_waiting = True

# What armed this process ("pth", "start", "sitecustomize"), or None while not armed.
source = None
_fired = False


def disabled(environ=None):
    """Whether ``VLLM_MINICPM_HOTFIX`` (in ``environ``, default ``os.environ``) switches the hotfix off."""
    if environ is None:
        os = sys.modules.get("os")
        environ = os.environ if os is not None else {}
    return environ.get(ENV_VAR, "").strip().lower() in OFF_VALUES


def find_spec(fullname, path=None, target=None):
    """``sys.meta_path`` protocol: None for every name; the first ``import vllm`` installs the hotfix (see top)."""
    # The import system is iterating sys.meta_path while we shorten it, so one finder would otherwise be skipped:
    # finish the search for vllm over the finders that followed us ourselves.
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
    if spec is None:
        # No vLLM here: `import vllm` fails as it would without us, we import nothing, and wait on in our place (a
        # later `import vllm` after sys.path changed still finds us).
        if index is not None:
            _fired = False
            meta_path.insert(index, me)
        return None
    _install(source)
    return spec


def _install(src):
    # vllm_minicpm_hotfix._bootstrap.install_now(src) (wrapt, the post-import hook); a failure is logged, never raised.
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
    """PEP 829 entry point of ``vllm-minicpm-hotfix.start`` (Python 3.15+; no arguments, returns None, never raises)."""
    # Importing this module (pkgutil.resolve_name did) armed the finder already: record that the .start file did it;
    # arm it if the import did not.
    global source
    if source == "pth" and _armed_on_import:
        source = "start"
    else:
        activate("start")


def activate(src):
    """Arm the hotfix in this process for the path ``src`` ("pth", "start", "sitecustomize"); True if this call armed
    (or, vLLM already imported, installed) it, False if off, already armed by any copy of this module, or failed."""
    # Install at once if vLLM is already imported, else put this module on sys.meta_path to wait for `import vllm`.
    # Imports nothing while waiting; never raises.
    global source
    try:
        if disabled():
            return False
        if "vllm" in sys.modules:
            return _install(src)
        for finder in sys.meta_path:
            if getattr(finder, FINDER_FLAG, False):
                return False
        me = sys.modules.get(__name__)
        if me is None:  # not imported as a module (exec'd by hand): nothing to arm
            return False
        source = src
        sys.meta_path.insert(0, me)
        return True
    except Exception:  # noqa: BLE001 - never break interpreter start-up (or vLLM's import)
        return False


# Arm on import, as described at the top -- never when vLLM is already imported (a process importing this module
# later, a test): arming is for processes that have not imported vLLM yet. The path is "sitecustomize" while
# Python imports a sitecustomize, else "pth" (``start()`` then says "start" on Python 3.15+).
_armed_on_import = "vllm" not in sys.modules and activate("sitecustomize" if "sitecustomize" in sys.modules else "pth")
