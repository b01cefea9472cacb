"""vllm-minicpm-hotfix, activated by PYTHONPATH injection: this folder named in ``PYTHONPATH`` arms the MiniCPM-V 4.6
hotfix in every Python process started with it (vLLM's API server, EngineCore, workers, Ray workers all inherit it).

Used from a clone of the repository (``PYTHONPATH=/path/to/vllm-minicpm-hotfix``, needs wrapt in the environment)
and as the ``sitecustomize.py`` of a folder made by ``vllm-minicpm-hotfix bundle DIR`` (the package and a
pure-Python wrapt next to it, for images that have no wrapt). See docs/activation.md.

At start-up it does two things and imports nothing beyond what the interpreter has already loaded:

1. ``import _vllm_minicpm_hotfix_arm`` (the small start-up module next to this file), which arms itself on import
   (as "sitecustomize"): a finder that waits for ``import vllm`` and only then imports the package and wrapt and
   registers the post-import hook (``VLLM_MINICPM_HOTFIX=off``: nothing at all). Already armed by the ``.pth`` (the
   package pip-installed too): nothing more.
2. Chains to the ``sitecustomize`` module the interpreter would have run without us -- the next one on
   ``sys.path`` after this folder (Debian and Ubuntu Pythons ship one; so do some images) -- so nothing the image
   had is lost. The module it ran is kept as ``CHAINED``.

It never raises: a failure in the hotfix is ignored, and an error in the chained module is reported the way Python
reports one in its own ``sitecustomize`` ("Error in sitecustomize; ...") and start-up goes on.
"""

import sys

#: Marks this file as the hotfix's sitecustomize (``vllm-minicpm-hotfix bundle`` copies files that carry it).
VLLM_MINICPM_HOTFIX_SITECUSTOMIZE = True
#: The ``sitecustomize`` module this one chained to, or None.
CHAINED = None


def _activate():
    try:
        import _vllm_minicpm_hotfix_arm  # noqa: F401 - arms itself on import
    except Exception:  # noqa: BLE001, S110 - a broken hotfix must not break start-up (or the chain below)
        pass


def _same_dir(entry, here, realpath):
    try:
        return realpath(entry or ".") == here
    except Exception:  # noqa: BLE001 - an odd sys.path entry is simply not ours
        return False


def _find_next():
    """The spec of the next ``sitecustomize`` on ``sys.path`` after the folder holding this file, or None.

    Fast path (every start-up pays for it): the ``sys.path`` entry this file was imported from is its folder's name
    as a string, so a list lookup finds it and only the next ``sitecustomize`` found is resolved (one ``realpath``).
    Only when that fails -- the entry spelled otherwise, or the next one found is this folder again under another
    name (a symbolic link, ``/a/../a``) -- is every entry resolved and compared."""
    os_path = sys.modules["os"].path
    # The interpreter's own path finder (``importlib.machinery.PathFinder``), already loaded: importing
    # ``importlib`` here would cost every process of the environment a few milliseconds.
    finder = getattr(sys.modules.get("_frozen_importlib_external"), "PathFinder", None)
    if finder is None:  # pragma: no cover - an interpreter without the frozen importlib
        from importlib.machinery import PathFinder as finder
    path = list(sys.path)
    folder = os_path.dirname(__file__)
    if folder in path:
        rest = [p for p in path[path.index(folder) + 1:] if p != folder]
        spec = finder.find_spec("sitecustomize", rest)
        origin = getattr(spec, "origin", None)
        if not origin or os_path.realpath(os_path.dirname(origin)) != os_path.realpath(folder):
            return spec
    here = os_path.realpath(os_path.dirname(os_path.abspath(__file__)))
    for i, entry in enumerate(path):
        if isinstance(entry, str) and _same_dir(entry, here, os_path.realpath):
            rest = [p for p in path[i + 1:] if not (isinstance(p, str) and _same_dir(p, here, os_path.realpath))]
            break
    else:
        return None  # not imported from sys.path (exec'd by hand?): nothing to chain to
    return finder.find_spec("sitecustomize", rest)


def _run(spec):
    """Execute the module ``spec`` describes as ``sitecustomize`` (it sees itself in ``sys.modules`` while it runs,
    as it would if Python had imported it); afterwards ``sys.modules["sitecustomize"]`` is this module again."""
    global CHAINED
    bootstrap = sys.modules.get("_frozen_importlib")
    module_from_spec = getattr(bootstrap, "module_from_spec", None)
    if module_from_spec is None:  # pragma: no cover
        from importlib.util import module_from_spec
    module = module_from_spec(spec)
    ours = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
        CHAINED = module
    finally:
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _chain():
    try:
        spec = _find_next()
        if spec is None or spec.loader is None:
            return
        _run(spec)
    except Exception as exc:  # noqa: BLE001 - what site.execsitecustomize does with the image's own
        # What site.execsitecustomize prints for an error in the interpreter's own sitecustomize.
        try:
            if sys.flags.verbose:
                sys.excepthook(*sys.exc_info())
            else:
                sys.stderr.write(
                    "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                    f"{type(exc).__name__}: {exc}\n"
                )
        except Exception:  # noqa: BLE001, S110 - stderr itself broken: nothing left to report to
            pass


_activate()
_chain()
