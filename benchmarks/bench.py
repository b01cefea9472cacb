#!/usr/bin/env python
"""The hotfix's cost, measured: interpreter start-up, import of vLLM's model module, full-size weight loading, the
post-import hook per vLLM process, vLLM's multimodal processor per request, a serving engine.

Run through ``benchmarks/run`` (it builds or reuses the vLLM environments with scripts/cpu-env and starts this file
with the vLLM 0.28.0 environment's interpreter); see docs/benchmarks.md for the table and how to read it.

    benchmarks/run                                   # everything, default repetitions
    benchmarks/run --smoke                           # every section at minimal repetitions (.ci/run)
    benchmarks/run --only hook,request               # a subset

Every figure compares A (without the hotfix, or with it reverted) with B (with it), side by side in one run, A and B
alternating, as medians with their ratio B/A and a 95% bootstrap interval.

1. start-up: ``python -c pass`` -- pip-installed (``.pth``) and bundle on ``PYTHONPATH`` (with its ``.pyc`` files,
   and, for information, a read-only bundle that never gets them).
2. import: ``import vllm.model_executor.models.minicpmv4_6`` with ``VLLM_TARGET_DEVICE=cpu`` on vLLM 0.28.0, where
   the hotfix patches (auto), pip-installed against not installed; plus an instrumented breakdown of the added time.
3. load: a full-size synthetic checkpoint (benchmarks/make_full_checkpoint.py) loaded through vLLM's own
   ``load_weights`` on vLLM 0.32.0 (benchmarks/load_one.py): auto (not patched there) against force-patched.
4. hook: the post-import hook's CPU and wall time per fix in fresh processes of three releases
   (benchmarks/hook_child.py), every probe at import (A) against as shipped, some probed at first use (B); target:
   B's whole hook at most 20 ms of CPU (issue 31).
5. request: vLLM's multimodal processor ``apply`` per case (4 image sizes, a video, each per-request kwarg), every
   fix reverted (A) and in place as the post-import hook and vLLM's first processor left it (B), alternating call by
   call in one process (benchmarks/request_inproc.py), 0.32.0 and 0.33.0.
6. serve: real ``vllm serve`` on 0.32.0, stock (A) against the hotfix pip-installed (B), default-kwarg image requests
   at concurrency 4 (benchmarks/serve_bench.py): wall per request (1 / throughput), time to first token, server CPU.
7. mixed: a sustained, seeded mixed load through real ``vllm serve`` on 0.32.0 at concurrency 8, stock (A) against the
   hotfix pip-installed (B) (benchmarks/load_bench.py, tests/support/load_mix.py): fresh images of several sizes with
   per-request kwargs, repeats (vLLM's processor cache), videos, and then requests the hotfix refuses; throughput,
   p50/p99 latency, RSS of the API server, EngineCore and worker per 1,000 requests, deaths and 5xx.

The environments with the package are throwaway overlays of the shared vLLM environment, made with the test suite's
helpers (tests/support/venvs.py): the wheel built from this tree and installed with ``uv pip install --no-deps``, and a
bundle written by ``vllm-minicpm-hotfix bundle``. Nothing is installed into the shared environments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

import common
from support import load_mix
from common import compare, interleave, log, median, median_ci, spawn

M46 = "vllm.model_executor.models.minicpmv4_6"
#: The hotfix's one summary line of a process that patched something (vllm_minicpm_hotfix.record.summary_line).
PATCH_LINE = re.compile(r"vllm-minicpm-hotfix: MiniCPM-V .*, pid \d+: patched [1-9]\d*/")
TARGETS = {"startup": 1.03, "import": 1.01, "load_time": 1.02, "load_rss": 1.01, "hook_cpu_ms": 20.0,
           "request": 1.02, "serve": 1.02}
SECTIONS = ("startup", "import", "load", "hook", "request", "serve", "mixed")
#: Section number of each in the table: the first three as before, then the hook, per request, serving.
SECTION_NO = {"startup": 1, "import": 2, "load": 3, "hook": 4, "request": 5, "serve": 6, "mixed": 7}


# --------------------------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every measured child: nothing that activates or configures the hotfix, no PYTHONPATH,
    ``PYTHONDONTWRITEBYTECODE=1`` (no child writes ``.pyc`` files into the shared environment; the package's own are
    compiled once beforehand, as ``pip install`` does), ``VLLM_TARGET_DEVICE=cpu``."""
    from support.venvs import clean_env

    env = clean_env(PYTHONDONTWRITEBYTECODE="1", VLLM_TARGET_DEVICE="cpu")
    for k in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONPROFILEIMPORTTIME", "PYTHONINSPECT"):
        env.pop(k, None)
    env.update(extra)
    return env


def compileall(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(path)], check=True, timeout=120,
                   stdout=subprocess.DEVNULL)


def make_envs(work: Path) -> dict[str, Path]:
    """base: an overlay of this environment without the package; pip: the same with the wheel installed (and its
    .pyc compiled, as pip does by default -- uv does not); bundle: a bundle with .pyc; bundle_nopyc: one without."""
    from support.venvs import build_wheel, make_bundle, overlay_env, pip_install, site_packages

    t0 = time.perf_counter()
    wheel = build_wheel(work / "wheel")
    base = overlay_env(work / "base", wrapt=True)
    pip = overlay_env(work / "pip", wrapt=True)
    pip_install(pip, str(wheel))
    installed = site_packages(pip) / "vllm_minicpm_hotfix"
    if installed.is_symlink() or not (site_packages(pip) / "vllm-minicpm-hotfix.pth").is_file():
        raise RuntimeError(f"the wheel did not install the package and its .pth into {site_packages(pip)}")
    compileall(installed)
    compileall(site_packages(pip) / "_vllm_minicpm_hotfix_arm.py")
    bundle = make_bundle(work / "bundle")  # `vllm-minicpm-hotfix bundle` writes the .pyc for this Python itself
    if not (bundle / "__pycache__").is_dir():
        raise RuntimeError(f"the bundle {bundle} has no bytecode")
    bundle_nopyc = make_bundle(work / "bundle-nopyc")
    for cache in list(bundle_nopyc.rglob("__pycache__")):  # a read-only mount in an image with another Python
        shutil.rmtree(cache)
    # Controls: what any .pth-based activation pays before running a line of its own code.
    pth_comment = overlay_env(work / "pth-comment", wrapt=True)
    (site_packages(pth_comment) / CONTROL_PTH).write_text("# a .pth file with nothing but this comment\n")
    pth_empty = overlay_env(work / "pth-empty", wrapt=True)
    (site_packages(pth_empty) / CONTROL_PTH).write_text(f"import {CONTROL_MODULE}\n")
    (site_packages(pth_empty) / f"{CONTROL_MODULE}.py").write_text("")
    compileall(site_packages(pth_empty) / f"{CONTROL_MODULE}.py")
    log(f"environments ready in {time.perf_counter() - t0:.1f} s under {work}")
    return {"base": base, "pip": pip, "bundle": bundle, "bundle_nopyc": bundle_nopyc, "pth_comment": pth_comment,
            "pth_empty": pth_empty}


#: The controls' .pth file (named like ours, so site processes it at the same place) and empty module.
CONTROL_PTH = "vllm-minicpm-hotfix.pth"
CONTROL_MODULE = "_vllm_minicpm_hotfix_control"


# --------------------------------------------------------------------------------------------------------------------
# 1. Interpreter start-up
# --------------------------------------------------------------------------------------------------------------------


def bench_startup(envs: dict[str, Path], pairs: int, warmup: int) -> list[dict]:
    base, pip = str(envs["base"]), str(envs["pip"])
    plain = child_env()
    cases = [
        ("startup_pip", "start-up `python -c pass`, pip-installed (.pth)", (base, plain), (pip, plain), True),
        ("startup_bundle", "start-up `python -c pass`, bundle on PYTHONPATH", (base, plain),
         (base, child_env(PYTHONPATH=str(envs["bundle"]))), True),
        ("startup_bundle_nopyc", "start-up, bundle on PYTHONPATH, read-only (no .pyc)", (base, plain),
         (base, child_env(PYTHONPATH=str(envs["bundle_nopyc"]))), False),
        ("startup_control_comment", "(control) start-up with a .pth holding only a comment", (base, plain),
         (str(envs["pth_comment"]), plain), False),
        ("startup_control_empty", "(control) start-up with a .pth importing an empty module", (base, plain),
         (str(envs["pth_empty"]), plain), False),
    ]
    rows = []
    for key, title, (py_a, env_a), (py_b, env_b), gated in cases:
        def run(py, env):
            r = spawn([py, "-c", "pass"], env, timeout=30)
            if r.rc != 0:
                raise RuntimeError(f"{py} -c pass exited {r.rc}")
            return r

        log(f"{title}: {pairs} pairs")
        a, b = interleave(pairs, lambda py=py_a, env=env_a: run(py, env), lambda py=py_b, env=env_b: run(py, env),
                          label=key, warmup=warmup,
                          progress_every=max(pairs // 4, 1) if pairs >= 40 else 0)
        wall = compare([r.wall_s * 1e3 for r in a], [r.wall_s * 1e3 for r in b])
        cpu = compare([r.cpu_s * 1e3 for r in a], [r.cpu_s * 1e3 for r in b])
        n_it = min(max(pairs // 4, 3), 50)
        detail = {"A": importtime_at_startup(py_a, env_a, n_it), "B": importtime_at_startup(py_b, env_b, n_it)}
        rows.append({"key": key, "title": title, "unit": "ms", "wall": wall, "cpu": cpu,
                     "target": TARGETS["startup"] if gated else None, "importtime_ms": detail,
                     "instructions": {"A": instructions(py_a, env_a), "B": instructions(py_b, env_b)}})
    return rows


def instructions(python: str, env: dict[str, str]) -> int | None:
    """Instructions executed by ``python -c pass`` (valgrind's callgrind, ``PYTHONHASHSEED=0``): deterministic, so
    unlike the times above it does not depend on what else the machine runs. None without valgrind."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    out = subprocess.run([valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", python, "-c", "pass"],
                         env={**env, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, timeout=300, check=False)
    found = [ln.rsplit(":", 1)[1].strip() for ln in out.stderr.splitlines() if "Collected :" in ln]
    return int(found[-1]) if out.returncode == 0 and found else None


STARTUP_MODULES = ("_vllm_minicpm_hotfix_arm", "sitecustomize", "site")


def importtime_at_startup(python: str, env: dict[str, str], runs: int) -> dict:
    """Median ``-X importtime`` cumulative times (ms) at start-up of the hotfix's start-up module,
    ``sitecustomize`` (ours chains to the environment's own) and ``site`` (everything start-up imports)."""
    found: dict[str, list[float]] = {m: [] for m in STARTUP_MODULES}
    for _ in range(runs):
        out = subprocess.run([python, "-X", "importtime", "-c", "pass"], env=env, capture_output=True, text=True,
                             timeout=30, check=True)
        seen = dict.fromkeys(STARTUP_MODULES, 0.0)
        for ln in out.stderr.splitlines():
            if ln.startswith("import time:") and "|" in ln:
                parts = [x.strip() for x in ln.split(":", 1)[1].split("|")]
                if parts[2] in seen and parts[1].isdigit():
                    seen[parts[2]] = int(parts[1]) / 1e3
        for m, v in seen.items():
            found[m].append(v)
    return {m: median(v) for m, v in found.items()}


def wrapt_import_alone(python: str, runs: int) -> dict:
    """``import wrapt`` in a fresh interpreter (``-X importtime`` cumulative, in ms), median of ``runs``."""
    tops, counts = [], []
    for _ in range(runs):
        out = subprocess.run([python, "-X", "importtime", "-c", "import wrapt"], env=child_env(),
                             capture_output=True, text=True, timeout=60, check=True)
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("import time:") and "|" in ln]
        for ln in lines:
            parts = [p.strip() for p in ln.split(":", 1)[1].split("|")]
            if parts[2] == "wrapt":
                tops.append(int(parts[1]) / 1e3)
        counts.append(len(lines))
    return {"cumulative_ms": median(tops), "modules_imported": median(counts)}


# --------------------------------------------------------------------------------------------------------------------
# 2. Import of the model module
# --------------------------------------------------------------------------------------------------------------------


def bench_import(envs: dict[str, Path], pairs: int, breakdown_runs: int, work: Path) -> tuple[dict, dict]:
    base, pip = str(envs["base"]), str(envs["pip"])
    env = child_env()
    out_a, out_b = str(work / "import-a.out"), str(work / "import-b.out")
    code = f"import {M46}"

    def run(py, out, patched):
        r = spawn([py, "-c", code], env, timeout=900, stdout_path=out, stderr_path=out)
        if r.rc != 0:
            raise RuntimeError(f"{py} -c {code!r} exited {r.rc}:\n{r.stderr[-3000:]}")
        if bool(PATCH_LINE.search(r.stderr)) is not patched:
            raise RuntimeError(f"expected patched={patched} in {py}, log:\n{r.stderr[-3000:]}")
        return r

    log(f"import {M46}: {pairs} pairs (about {pairs * 2 * 35 // 60 + 1} min on a quiet 2-core machine)")
    a, b = interleave(pairs, lambda: run(base, out_a, False), lambda: run(pip, out_b, True), label="import",
                      progress_every=1)
    row = {"key": "import", "title": f"`import {M46}`, pip-installed, vLLM 0.28.0 (patches)", "unit": "s",
           "wall": compare([r.wall_s for r in a], [r.wall_s for r in b]),
           "cpu": compare([r.cpu_s for r in a], [r.cpu_s for r in b]), "target": TARGETS["import"]}

    breakdown: dict = {"runs": breakdown_runs}
    if breakdown_runs:
        log(f"import breakdown: 1 run without, {breakdown_runs} instrumented with the hotfix")
        script = str(HERE / "import_breakdown.py")

        def instrumented(py):
            out = subprocess.run([py, script], env=env, capture_output=True, text=True, timeout=900, cwd=work,
                                 check=False)
            if out.returncode != 0:
                raise RuntimeError(f"import_breakdown.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        plain = instrumented(base)
        runs = [instrumented(pip) for _ in range(breakdown_runs)]
        keys = sorted({k for r in runs for k in r["timings_s"]})
        breakdown["pieces_ms"] = {k: median([r["timings_s"].get(k, 0.0) * 1e3 for r in runs]) for k in keys}
        breakdown["fixes"] = runs[0]["fixes"]
        breakdown["wrapt_finder_calls"] = median([r["counts"].get("wrapt_finder_calls", 0) for r in runs])
        wrapt_mods = runs[0]["wrapt_modules"]
        vllm_mods = set(plain["modules"])
        breakdown["wrapt_modules"] = len(wrapt_mods)
        breakdown["wrapt_modules_vllm_imports_anyway"] = sum(m in vllm_mods for m in wrapt_mods)
        breakdown["wrapt_modules_only_for_hotfix"] = sorted(m for m in wrapt_mods if m not in vllm_mods)
        added = sorted(set(runs[0]["modules"]) - vllm_mods)
        breakdown["modules_added"] = added
        breakdown["wrapt_alone"] = wrapt_import_alone(base, max(5, breakdown_runs))
        # Net import cost: -X importtime self times of the modules only the hotfix brings in.
        out = subprocess.run([pip, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True,
                             timeout=900, cwd=work, check=False)
        selfs: dict[str, float] = {}
        for ln in out.stderr.splitlines():
            if ln.startswith("import time:") and "|" in ln:
                parts = [x.strip() for x in ln.split(":", 1)[1].split("|")]
                if parts[0].isdigit():
                    selfs[parts[2]] = int(parts[0]) / 1e3
        breakdown["added_modules_self_ms"] = sum(selfs.get(m, 0.0) for m in added)
        breakdown["added_modules_top"] = sorted(((m, selfs.get(m, 0.0)) for m in added), key=lambda x: -x[1])[:6]
    return row, breakdown


# --------------------------------------------------------------------------------------------------------------------
# 3. Full-size load
# --------------------------------------------------------------------------------------------------------------------


def ensure_checkpoint(py_load: str) -> Path:
    log("full-size checkpoint: reusing the cached one or writing it (~1-2 min, ~2.6 GB)")
    out = subprocess.run([py_load, str(HERE / "make_full_checkpoint.py")], env=child_env(), capture_output=True,
                         text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"make_full_checkpoint.py failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    if out.stderr.strip():
        log(out.stderr.strip().splitlines()[-1])
    return Path(out.stdout.strip().splitlines()[-1])


def warm_page_cache(ckpt: Path) -> None:
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


LOAD_METRICS = (  # (key, title, unit, target, key of the CPU-time figure)
    ("load_s", "full-size load time (`load_weights`), vLLM 0.32.0", "s", "load_time", "load_cpu_s"),
    ("ru_maxrss_mib", "peak RSS of the process (ru_maxrss)", "MiB", "load_rss", None),
    ("load_peak_increase_mib", "peak RSS increase during the load (VmHWM - RSS before)", "MiB", None, None),
    ("anon_peak_increase_mib", "anonymous-memory peak increase during the load (sampled)", "MiB", None, None),
    ("rss_increase_mib", "RSS kept after the load (increase)", "MiB", None, None),
)


def bench_load(py_load: str, ckpt: Path, pairs: int, warmup: int, inproc_loads: int, work: Path) -> list[dict]:
    script = str(HERE / "load_one.py")
    results: dict[str, list[dict]] = {"A": [], "B": []}

    def run(mode, which):
        out, err = str(work / f"load-{which}.out"), str(work / f"load-{which}.err")
        r = spawn([py_load, script, str(ckpt)], child_env(VLLM_MINICPM_HOTFIX=mode), timeout=1200,
                  stdout_path=out, stderr_path=err)
        if r.rc != 0:
            raise RuntimeError(f"load_one.py ({mode}) exited {r.rc}:\n{r.stderr[-4000:]}")
        res = json.loads(Path(out).read_text().strip().splitlines()[-1])
        if res["patched"] is not (mode == "force") or not res["exact"]:
            raise RuntimeError(f"load_one.py ({mode}): patched={res['patched']} exact={res['exact']}")
        res["process_wall_s"] = r.wall_s
        return res

    warm_page_cache(ckpt)
    log(f"full-size load on vLLM 0.32.0: {pairs} pairs (about {pairs * 2 * 50 // 60 + 1} min on a quiet machine)")
    a, b = interleave(pairs, lambda: run("auto", "A"), lambda: run("force", "B"), label="load", warmup=warmup,
                      progress_every=1)
    rows = []
    for key, title, unit, target, cpu_key in LOAD_METRICS:
        xs, ys = [r.get(key) for r in a], [r.get(key) for r in b]
        if any(v is None for v in xs + ys):
            continue
        cpu = compare([r[cpu_key] for r in a], [r[cpu_key] for r in b]) if cpu_key else None
        rows.append({"key": f"load_{key}", "title": title, "unit": unit, "wall": compare(xs, ys), "cpu": cpu,
                     "target": TARGETS[target] if target else None})
    results["A"], results["B"] = a, b
    if inproc_loads:
        log(f"full-size load, one process: {inproc_loads} warm loads, stock and patched alternating")
        out = subprocess.run([py_load, str(HERE / "load_inproc.py"), str(ckpt), str(inproc_loads)],
                             env=child_env(), capture_output=True, text=True, timeout=600 + 60 * inproc_loads,
                             check=False)
        if out.returncode != 0:
            raise RuntimeError(f"load_inproc.py failed:\n{out.stderr[-4000:]}")
        loads = json.loads(out.stdout.strip().splitlines()[-1])["loads"]
        xs = [x for x in loads if not x["patched"]]
        ys = [x for x in loads if x["patched"]]
        n = min(len(xs), len(ys))
        xs, ys = xs[:n], ys[:n]
        rows.append({"key": "load_inproc", "unit": "s", "target": None,
                     "title": "warm reloads in one process, stock and patched alternating (load time)",
                     "wall": compare([x["load_s"] for x in xs], [y["load_s"] for y in ys]),
                     "cpu": compare([x["load_cpu_s"] for x in xs], [y["load_cpu_s"] for y in ys])})
        results["inproc"] = loads
    rows.append({"key": "load_raw", "raw": results})
    return rows


# --------------------------------------------------------------------------------------------------------------------
# 4. The post-import hook, per vLLM process
# --------------------------------------------------------------------------------------------------------------------


def hook_overlay(python: str, work: Path, release: str) -> str:
    """An overlay of ``python``'s environment with the wheel installed and compiled (as ``pip install`` leaves it)."""
    from support.venvs import overlay_env, pip_install, site_packages

    wheel = _wheel(work)
    env = overlay_env(work / f"hook-{release}", wrapt=True, over=python)
    pip_install(env, str(wheel))
    subprocess.run([str(env), "-m", "compileall", "-q", str(site_packages(env) / "vllm_minicpm_hotfix")],
                   check=True, timeout=300, stdout=subprocess.DEVNULL)
    return str(env)


_WHEEL: list[Path] = []


def _wheel(work: Path) -> Path:
    from support.venvs import build_wheel

    if not _WHEEL:
        _WHEEL.append(build_wheel(work / "wheel-hook"))
    return _WHEEL[0]


def bench_hook(pythons: dict[str, str], releases: list[str], pairs: int, work: Path) -> tuple[list[dict], dict]:
    """Fresh processes of each release, probes deferred (B, the default) and eager (A, every probe at import)
    alternating; each child (benchmarks/hook_child.py) times the hook inside its model-module import."""
    script = str(HERE / "hook_child.py")
    rows, detail = [], {}
    for rel in releases:
        py = hook_overlay(pythons[rel], work, rel)
        out = str(work / f"hook-{rel}.out")

        def run(probes, py=py, out=out, rel=rel):
            r = spawn([py, script, "-", probes], child_env(), timeout=900, stdout_path=out,
                      stderr_path=out + ".err")
            if r.rc != 0:
                raise RuntimeError(f"hook_child.py ({rel}, {probes}) exited {r.rc}:\n{r.stderr[-3000:]}")
            res = json.loads(Path(out).read_text().strip().splitlines()[-1])
            if "site-packages" not in res["package_file"]:
                raise RuntimeError(f"hook_child.py ({rel}) used {res['package_file']}, not the installed wheel")
            return res

        log(f"hook on vLLM {rel}: {pairs} pairs of fresh processes (eager / deferred)")
        a, b = [], []
        for i in range(pairs):
            for which in (("A", "B") if i % 2 == 0 else ("B", "A")):
                (a if which == "A" else b).append(run("eager" if which == "A" else "lazy"))
        ca, cb = [x["hook"]["cpu_ms"] for x in a], [x["hook"]["cpu_ms"] for x in b]
        wa, wb = [x["hook"]["wall_ms"] for x in a], [x["hook"]["wall_ms"] for x in b]
        rows.append({"key": f"hook_{rel}", "unit": "ms", "gate": "cpu", "abs_target": TARGETS["hook_cpu_ms"],
                     "b_ci": median_ci(cb), "target": None,
                     "title": f"post-import hook, CPU per vLLM process, vLLM {rel} (A: every probe at import; "
                              f"B: as shipped, {', '.join(b[0]['first_use']['fixes']) or 'none'} probed at first use)",
                     "cpu": compare(ca, cb), "wall": compare(wa, wb)})
        names = list(b[0]["fixes"])
        detail[rel] = {
            "vllm": b[0].get("vllm"),
            "install_ms": median([x["install"]["cpu_ms"] for x in b]),
            "import_fixes_ms": median([x["import_fixes"]["cpu_ms"] for x in b]),
            "fixes_ms": {n: {"A": median([x["fixes"][n]["cpu_ms"] for x in a]),
                             "B": median([x["fixes"][n]["cpu_ms"] for x in b])} for n in names},
            "status_B": b[0]["status"],
            "first_use_ms": median([x["first_use"]["cpu_ms"] for x in b]),
            "first_use_fixes": b[0]["first_use"]["fixes"],
        }
    return rows, detail


def hook_text(detail: dict) -> str:
    if not detail:
        return ""
    rels = list(detail)
    out = ["Hook detail (CPU ms per vLLM process, medians; B as shipped / A with every probe at import; "
           "`install`: importing the package and registering the hook, paid at `import vllm`, before the hook):", "",
           "| piece | " + " | ".join(f"vLLM {r} B / A" for r in rels) + " |", "|---|" + "---|" * len(rels)]
    out.append("| install (import package, register) | " + " | ".join(f"{detail[r]['install_ms']:.1f}" for r in rels)
               + " |")
    out.append("| import of the fix modules | " + " | ".join(f"{detail[r]['import_fixes_ms']:.1f}" for r in rels) + " |")
    for n in detail[rels[0]]["fixes_ms"]:
        cells = []
        for r in rels:
            f = detail[r]["fixes_ms"].get(n)
            st = detail[r]["status_B"].get(n, {})
            tag = " (first use)" if st.get("first_use") else ""
            cells.append("-" if f is None else f"{f['B']:.1f} / {f['A']:.1f}{tag}")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out.append("| B: paid at their first use instead (the processor-path group at vLLM's first processor, "
               "quantized_vision at the first quantized model: "
               f"{', '.join(detail[rels[0]]['first_use_fixes'])}) | "
               + " | ".join(f"{detail[r]['first_use_ms']:.1f}" for r in rels) + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------------
# 5. Per request: vLLM's multimodal processor
# --------------------------------------------------------------------------------------------------------------------


def bench_request(pythons: dict[str, str], releases: list[str], rounds: int, reps: int, work: Path) -> list[dict]:
    rows = []
    for rel in releases:
        log(f"per request on vLLM {rel}: {rounds} alternating rounds, min of {reps} calls per case")
        out = subprocess.run([pythons[rel], str(HERE / "request_inproc.py"), str(REPO), str(rounds), str(reps)],
                             env=child_env(), capture_output=True, text=True, timeout=3600, cwd=work, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"request_inproc.py ({rel}) failed:\n{out.stderr[-4000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        for name, c in res["cases"].items():
            if c["error"]:
                rows.append({"key": f"request_{rel}_{name}", "unit": "ms", "target": None, "gate": "cpu",
                             "title": f"vLLM {rel}: {name}: not timed ({c['error']})", "cpu": None, "wall": None})
                continue
            toks = c["tokens"]
            same = toks.get("A") == toks.get("B")
            # where stock ignores the kwarg it builds another prompt (other work): compared for information only
            note = "" if same else f" (stock ignores it: prompt {toks.get('A')} / {toks.get('B')} tokens, A / B)"
            rows.append({"key": f"request_{rel}_{name}", "unit": "ms", "gate": "cpu",
                         "target": TARGETS["request"] if same else None,
                         "title": f"processor `apply` CPU, vLLM {rel}: {name}{note}",
                         "cpu": compare(c["A"], c["B"]), "wall": compare(c["A_wall"], c["B_wall"])})
        rows[-1]["applied"] = res["applied"]
        rows[-1]["release"] = rel
    return rows


def request_text(rows: list[dict]) -> str:
    """Section 5's detail: the fixes B had in place per release, and each row's median of the per-round ratios (A
    and B of a round measured call by call in alternation) with its interval, next to the table's ratio of medians."""
    rows = [r for r in rows if r.get("section") == 5]
    if not rows:
        return ""
    out = ["Per-request detail. B's fixes in place (applied by the hook and at vLLM's first processor, checked by "
           "request_inproc.py before any call is timed): "
           + "; ".join(f"vLLM {r['release']}: {', '.join(r['applied'])}" for r in rows if r.get("applied")) + ".",
           "The table's ratio is the ratio of the medians of the rounds (the target's figure); the median of the "
           "per-round ratios B/A is shown beside it, with its interval (information):", "",
           "| case | ratio of medians [95% CI] | median of per-round ratios [95% CI] |", "|---|---|---|"]
    for r in rows:
        c = r.get("cpu")
        if not c:
            continue
        lo, hi = c["ratio_ci95"]
        plo, phi = c.get("paired_ratio_ci95", (float("nan"), float("nan")))
        out.append(f"| {r['title'].removeprefix('processor `apply` CPU, ')} | {c['ratio']:.3f} [{lo:.3f}, {hi:.3f}] | "
                   f"{c['paired_ratio_median']:.3f} [{plo:.3f}, {phi:.3f}] |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------------
# 6. A serving engine
# --------------------------------------------------------------------------------------------------------------------


def bench_serve(py32: str, rounds: int, batches: int, requests: int, work: Path) -> list[dict]:
    log(f"vllm serve on 0.32.0: {rounds} rounds (one server at a time), {batches} batches of {requests} requests, "
        f"concurrency 4")
    d = work / "serve"
    d.mkdir()
    out = subprocess.run([py32, str(HERE / "serve_bench.py"), str(d), str(rounds), str(batches), str(requests), "4"],
                         env=child_env(), capture_output=True, text=True, timeout=7200, cwd=work, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"serve_bench.py failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])

    def flat(which, key):
        return [v for r in res[which] for v in r[key]]

    def role(which, name):
        return [v * 1e3 for r in res[which] for v in r["cpu_per_request_by_role_s"][name]]

    same = res.get("same_prompts", False)
    # where the servers build different prompts for the same request they do different work: information only
    note = "" if same else " (NOT like for like: the servers built different prompts for the same requests)"
    return [
        {"key": "serve_s_per_request", "unit": "ms", "target": TARGETS["serve"] if same else None, "gate": "wall",
         "title": f"`vllm serve` 0.32.0: wall per request (1 / throughput), {requests} default-kwarg image requests "
                  f"x {batches} batches x {rounds} rounds, concurrency 4{note}",
         "wall": compare([v * 1e3 for v in flat("A", "s_per_request")], [v * 1e3 for v in flat("B", "s_per_request")]),
         "cpu": compare([v * 1e3 for v in flat("A", "cpu_per_request_s")],
                        [v * 1e3 for v in flat("B", "cpu_per_request_s")])},
        {"key": "serve_ttft", "unit": "ms", "target": None, "gate": "wall",
         "title": "  time to first token (median per batch)",
         "wall": compare([v * 1e3 for v in flat("A", "ttft_s")], [v * 1e3 for v in flat("B", "ttft_s")]), "cpu": None},
        {"key": "serve_cpu", "unit": "ms", "target": None, "gate": "cpu",
         "title": "  server CPU per request (API server + EngineCore + worker)",
         "cpu": compare([v * 1e3 for v in flat("A", "cpu_per_request_s")],
                        [v * 1e3 for v in flat("B", "cpu_per_request_s")]), "wall": None},
        *({"key": f"serve_cpu_{name}", "unit": "ms", "target": None, "gate": "cpu",
           "title": f"    of which {title}", "cpu": compare(role("A", name), role("B", name)), "wall": None}
          for name, title in (("api", "the API server (where the hotfix acts per request)"),
                              ("engine", "EngineCore"), ("worker", "the worker (the model)"))
          if all("cpu_per_request_by_role_s" in r for w in ("A", "B") for r in res[w])),
        {"key": "serve_started", "unit": "s", "target": None, "gate": "wall", "title": "  server start to healthy",
         "wall": compare([r["started_s"] for r in res["A"]], [r["started_s"] for r in res["B"]]), "cpu": None},
    ]


# --------------------------------------------------------------------------------------------------------------------
# 7. A sustained mixed load
# --------------------------------------------------------------------------------------------------------------------

#: The windows throughput and CPU per request are measured in: 20 s, or a third of a shorter phase (--smoke).
MIXED_WINDOW_S = 20.0


def mixed_window_s(seconds: float) -> float:
    return min(MIXED_WINDOW_S, seconds / 3)
VALID_KINDS = ("image", "repeat", "video")


def bench_mixed(py32: str, seconds: float, warmup: float, concurrency: int, rounds: int, max_requests: int,
                work: Path) -> tuple[list[dict], dict]:
    log(f"sustained mixed load on vllm serve 0.32.0: {rounds} round(s) of a stock and a hotfix server, each a valid "
        f"and a full phase of {warmup:.0f} + {seconds:.0f} s at concurrency {concurrency}")
    d = work / "mixed"
    d.mkdir()
    out = subprocess.run([py32, str(HERE / "load_bench.py"), str(d), str(seconds), str(warmup), str(concurrency),
                          str(rounds), str(max_requests)], env=child_env(), capture_output=True, text=True,
                         timeout=rounds * 2 * (2 * (warmup + seconds) + 1500) + 600, cwd=work, check=False)
    for line in out.stderr.splitlines():
        if line.startswith("[load bench]"):
            log(line[len("[load bench] "):])
    if out.returncode != 0:
        raise RuntimeError(f"load_bench.py failed:\n{out.stderr[-4000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    summary = mixed_summary(res)
    va, vb = summary["valid"]["A"], summary["valid"]["B"]
    same = summary["same_prompts"]
    note = "" if same else " (NOT like for like: the servers built different prompts for the same requests)"
    if not (va["complete"] and vb["complete"]):
        note += " (a server did not finish its valid phase: see the detail)"
    title = (f"`vllm serve` 0.32.0, sustained mixed load, valid part (fresh images of {len(res['mix']['sizes'])} "
             f"sizes with per-request kwargs, repeats, videos), {warmup:.0f} s warm-up + {seconds:.0f} s, concurrency "
             f"{concurrency}: wall per request (1 / throughput) per {mixed_window_s(seconds):.0f}-s window{note}")
    rows = [
        {"key": "mixed_s_per_request", "unit": "ms", "gate": "wall", "title": title,
         "target": TARGETS["serve"] if same and va["complete"] and vb["complete"] else None,
         "wall": compare([x * 1e3 for x in va["windows_s"]], [x * 1e3 for x in vb["windows_s"]]), "cpu": None},
        {"key": "mixed_p50", "unit": "ms", "gate": "wall", "target": None, "title": "  latency of a valid request, p50",
         "wall": qcompare([x * 1e3 for x in va["lat_valid"]], [x * 1e3 for x in vb["lat_valid"]], 0.5), "cpu": None},
        {"key": "mixed_p99", "unit": "ms", "gate": "wall", "target": None, "title": "  latency of a valid request, p99",
         "wall": qcompare([x * 1e3 for x in va["lat_valid"]], [x * 1e3 for x in vb["lat_valid"]], 0.99), "cpu": None},
    ]
    if all(va["cpu_windows_s"][r] and vb["cpu_windows_s"][r] for r in ("api", "engine", "worker")):
        rows += [{"key": f"mixed_cpu_{r}", "unit": "ms", "gate": "cpu", "target": None, "wall": None,
                  "title": f"  CPU per request of the {name}, per {mixed_window_s(seconds):.0f}-s window",
                  "cpu": compare([x * 1e3 for x in va["cpu_windows_s"][r]], [x * 1e3 for x in vb["cpu_windows_s"][r]])}
                 for r, name in (("api", "API server (where the hotfix acts per request)"), ("engine", "EngineCore"),
                                 ("worker", "worker (the model)"))]
    return rows, {"summary": summary, "raw": res}


def qcompare(a: list[float], b: list[float], q: float) -> dict:
    """:func:`common.compare`'s fields for the ``q`` quantile of two unpaired samples (the interval resamples each)."""
    qa, qb = load_mix.quantile(a, q), load_mix.quantile(b, q)
    lo, hi = common.quantile_ratio_ci(a, b, q)
    return {"n": min(len(a), len(b)), "a_median": qa, "b_median": qb, "delta": qb - qa,
            "ratio": qb / qa if qa else float("nan"), "ratio_ci95": [lo, hi], "paired_ratio_median": float("nan"),
            "a_min": min(a, default=float("nan")), "b_min": min(b, default=float("nan"))}


def _phase_figures(phases: list[dict], expect_seconds: float, width: float) -> dict:
    """The figures of one side's phases of one name (one per round), pooled."""
    roles = ("api", "engine", "worker")
    outs = [o for p in phases for o in p["outcomes"]]
    measured = [(p, o) for p in phases for o in p["outcomes"] if o[3] >= p["warmup_s"]]
    windows, slopes, levels = [], {r: [] for r in roles}, {r: [] for r in roles}
    cpu_windows: dict[str, list[float]] = {r: [] for r in roles}
    for p in phases:
        lo = p["warmup_s"]
        hi = max((o[4] for o in p["outcomes"]), default=lo)
        t = lo
        while t + width <= hi + 1e-9:
            n = sum(1 for o in p["outcomes"] if o[3] >= lo and t <= o[4] < t + width)
            if n:
                windows.append(width / n)
            t += width
        after = [s for s in p["samples"] if s[0] >= lo]
        t = lo
        while t + width <= hi + 1e-9:
            inside = [s for s in after if t <= s[0] < t + width]
            if len(inside) >= 2 and inside[-1][1] > inside[0][1] and len(inside[0]) > 5:
                for k, r in enumerate(roles):
                    cpu_windows[r].append((inside[-1][5 + k] - inside[0][5 + k]) / (inside[-1][1] - inside[0][1]))
            t += width
        for k, r in enumerate(roles):
            pts = [(s[1], s[2 + k] / 2**20) for s in after if s[2 + k]]
            if len(pts) >= 3:
                sl = load_mix.slope(pts) * 1000
                ci = [x * 1000 for x in common.slope_ci(pts)]
                slopes[r].append({"slope": sl, "ci": ci, "requests": pts[-1][0] - pts[0][0]})
                levels[r].append([pts[0][1], pts[-1][1]])
    span = sum(max((o[4] for o in p["outcomes"]), default=p["warmup_s"]) - p["warmup_s"] for p in phases)
    statuses: dict[str, dict[str, int]] = {}
    for o in outs:
        kind = o[1] if o[1] != "refused" else f"refused {o[9]}"
        st = statuses.setdefault(kind, {})
        st[str(o[2] or "no answer")] = st.get(str(o[2] or "no answer"), 0) + 1
    hits = [h for p in phases for h in p["cache_hit_rates"]]
    return {
        "requests": len(outs), "measured": len(measured),
        "by_kind": {k: sum(1 for _, o in measured if o[1] == k) for k in ("image", "repeat", "video", "refused")},
        "throughput": len(measured) / span if span > 0 else float("nan"),
        "windows_s": windows,
        "cpu_windows_s": cpu_windows,
        "lat_valid": [o[4] - o[3] for _, o in measured if o[1] in VALID_KINDS],
        "lat_refused": [o[4] - o[3] for _, o in measured if o[1] == "refused"],
        "server_errors": sum(1 for o in outs if o[2] == 0 or o[2] >= 500),
        "not_ok": sum(1 for o in outs if not o[7]),
        "not_ok_valid": sum(1 for o in outs if not o[7] and o[1] in VALID_KINDS),
        "deaths": sum(p["deaths"] for p in phases), "death": [p["death"] for p in phases if p["death"]],
        "guard": [p["guard"] for p in phases if p["guard"]],
        "complete": all(not p["deaths"] and not p["guard"] for p in phases) and len(phases) > 0,
        "seconds": [p["seconds"] for p in phases], "expect_seconds": expect_seconds,
        "slopes": slopes, "levels": levels, "statuses": statuses,
        "cache_hit_median": median(hits) if hits else None,
        "examples": sorted({o[8] for o in outs if o[8] and o[1] == "refused"})[:12],
        "prompts": {o[0]: o[5] for o in outs if o[1] in VALID_KINDS and o[2] == 200},
    }


def mixed_summary(res: dict) -> dict:
    out: dict = {"concurrency": res["concurrency"], "seconds": res["seconds"], "warmup_s": res["warmup_s"]}
    for phase in ("valid", "full"):
        out[phase] = {}
        for side in ("A", "B"):
            phases = [p for r in res[side] for p in r["phases"] if p["phase"] == phase]
            out[phase][side] = _phase_figures(phases, res["warmup_s"] + res["seconds"],
                                              mixed_window_s(res["seconds"]))
    pa, pb = out["valid"]["A"]["prompts"], out["valid"]["B"]["prompts"]
    common_idx = set(pa) & set(pb)
    out["same_prompts"] = bool(common_idx) and all(pa[i] == pb[i] for i in common_idx)
    out["prompts_compared"] = len(common_idx)
    out["started_s"] = {side: [r.get("started_s") for r in res[side]] for side in ("A", "B")}
    for phase in ("valid", "full"):
        for side in ("A", "B"):
            out[phase][side].pop("prompts")
    return out


def mixed_text(detail: dict) -> str:
    if not detail:
        return ""
    s = detail["summary"]
    raw = detail["raw"]

    def ms(xs, q):
        v = load_mix.quantile(xs, q)
        return "-" if math.isnan(v) else f"{v * 1e3:.0f} ms"

    def lat(f, key):
        return f"{ms(f[key], 0.5)} / {ms(f[key], 0.99)} (n {len(f[key])})" if f[key] else "-"

    def ratio_q(a, b, q):
        if len(a) < 3 or len(b) < 3:
            return "-"
        qa, qb = load_mix.quantile(a, q), load_mix.quantile(b, q)
        lo, hi = common.quantile_ratio_ci(a, b, q)
        return f"{qb / qa:.3f} [{lo:.3f}, {hi:.3f}]"

    def slope_cell(f, role):
        xs = f["slopes"][role]
        if not xs:
            return "-"
        parts = []
        for x, lv in zip(xs, f["levels"][role]):
            lo, hi = x["ci"]
            ci = "" if math.isnan(lo) else f" [{lo:+.0f}, {hi:+.0f}]"
            parts.append(f"{x['slope']:+.1f}{ci} ({lv[0]:.0f} -> {lv[1]:.0f} MiB over {x['requests']} req)")
        return "; ".join(parts)

    def end(f):
        bits = []
        if f["deaths"]:
            bits.append(f"engine died: {'; '.join(f['death'])[:400]}")
        if f["guard"]:
            bits.append(f"memory guard: {'; '.join(f['guard'])}")
        return " ".join(bits) or "none"

    def cpu_cell(f):
        w = f["cpu_windows_s"]
        if not all(w[r] for r in ("api", "engine", "worker")):
            return "-"
        return " / ".join(f"{median(w[r]) * 1e3:.0f}" for r in ("api", "engine", "worker")) + " ms"

    def cpu_ratio(a, b):
        if cpu_cell(a) == "-" or cpu_cell(b) == "-":
            return ""
        return " / ".join(f"{median(b['cpu_windows_s'][r]) / median(a['cpu_windows_s'][r]):.3f}"
                          for r in ("api", "engine", "worker"))

    def statuses(f):
        return "; ".join(f"{k}: " + ", ".join(f"{st} x{n}" for st, n in sorted(v.items()))
                         for k, v in sorted(f["statuses"].items()))

    lines = [f"Sustained mixed load (section 7, benchmarks/load_bench.py): vLLM 0.32.0, the real-geometry tiny "
             f"checkpoint, `{' '.join(raw['serve_args'])}`; seeded mix {raw['mix']['seed']}, concurrency "
             f"{s['concurrency']}, each phase {s['warmup_s']:.0f} s warm-up + {s['seconds']:.0f} s (at most "
             f"{raw['max_requests']} requests), {raw['max_tokens']} tokens per answer, every request with a 120 s "
             f"timeout; server start to healthy: A {s['started_s']['A']}, B {s['started_s']['B']} s. Valid-phase "
             f"prompts compared request by request: {s['prompts_compared']}, "
             f"{'all equal' if s['same_prompts'] else 'NOT all equal'}.", "",
             "| | stock (A) | hotfix (B) | B/A [95% CI] |", "|---|---|---|---|"]
    for phase, what in (("valid", "valid phase (the comparison)"), ("full", "full phase (refused requests added)")):
        a, b = s[phase]["A"], s[phase]["B"]
        if not a["requests"] and not b["requests"]:
            continue
        kinds = lambda f: ", ".join(f"{k} {v}" for k, v in f["by_kind"].items() if v)  # noqa: E731
        tp = (f"{b['throughput'] / a['throughput']:.3f}" if a["throughput"] and b["throughput"]
              and not math.isnan(a["throughput"]) else "-")
        lines += [
            f"| **{what}**: requests sent (after warm-up: by kind) | {a['requests']} ({kinds(a)}) | "
            f"{b['requests']} ({kinds(b)}) | |",
            f"| throughput after warm-up, requests/s | {a['throughput']:.2f} | {b['throughput']:.2f} | {tp} |",
            f"| latency of valid requests, p50 / p99 | {lat(a, 'lat_valid')} | {lat(b, 'lat_valid')} | "
            f"p50 {ratio_q(a['lat_valid'], b['lat_valid'], 0.5)}, "
            f"p99 {ratio_q(a['lat_valid'], b['lat_valid'], 0.99)} |",
        ]
        if phase == "full":
            lines.append(f"| latency of refused requests, p50 / p99 | {lat(a, 'lat_refused')} | "
                         f"{lat(b, 'lat_refused')} | p50 {ratio_q(a['lat_refused'], b['lat_refused'], 0.5)} |")
        lines += [
            f"| answers >= 500 or none / not as expected (valid ones) | {a['server_errors']} / {a['not_ok']} "
            f"({a['not_ok_valid']}) | {b['server_errors']} / {b['not_ok']} ({b['not_ok_valid']}) | |",
            f"| engine deaths, memory guard | {end(a)} | {end(b)} | |",
            f"| CPU per request (median of {mixed_window_s(s['seconds']):.0f}-s windows): API server / EngineCore / "
            f"worker | "
            f"{cpu_cell(a)} | {cpu_cell(b)} | {cpu_ratio(a, b)} |",
            *(f"| RSS of the {name} after warm-up: slope MiB per 1,000 requests [95% CI] (start -> end) | "
              f"{slope_cell(a, role)} | {slope_cell(b, role)} | |"
              for role, name in (("api", "API server"), ("engine", "EngineCore"), ("worker", "worker"))),
            f"| vLLM's `MM cache hit rate` (median of its log lines) | {a['cache_hit_median']} | "
            f"{b['cache_hit_median']} | |",
        ]
    full_a, full_b = s["full"]["A"], s["full"]["B"]
    lines += ["", f"Full phase, answers per kind: stock (A): {statuses(full_a) or '-'}.", "",
              f"Hotfix (B): {statuses(full_b) or '-'}."]
    if not full_a["complete"]:
        lines += ["", "**Stock did not finish the full phase** (above): its comparison with the hotfix is the valid "
                  "phase only; the full phase's figures of stock cover what it answered until then."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def fmt(v: float, unit: str) -> str:
    if unit == "ms":
        return f"{v:.1f} ms"
    if unit == "s":
        return f"{v:.2f} s"
    return f"{v:.0f} {unit}"


def settled(ratio: float, lo: float, hi: float, target: float | None) -> str:
    """The verdict on a ratio against its target: "met" only when the whole 95% interval is at or below it, "MISSED"
    when the whole interval is above it, "not settled" when the interval straddles it (or there is none)."""
    if not target:
        return ""
    if math.isnan(lo) or math.isnan(hi):
        return "not settled"  # no interval (too few pairs): nothing is settled
    if hi <= target:
        return "met"
    if lo > target:
        return "MISSED"
    return "not settled"


def verdict_of(r: dict) -> tuple[str, str]:
    """``(target text, verdict)`` of a row: a ratio target on the gated figure's ratio interval, or an absolute
    target (``abs_target``) on the interval of B's median."""
    if r.get("abs_target"):
        lo, hi = r.get("b_ci", (float("nan"), float("nan")))
        g = r[r.get("gate", "wall")]
        return f"B <= {r['abs_target']:.0f} {r['unit']}", settled(g["b_median"], lo, hi, r["abs_target"])
    g = r.get(r.get("gate", "wall"))
    if not r.get("target") or g is None:
        return "(info)", ""
    lo, hi = g["ratio_ci95"]
    return f"<= {r['target']:.2f}", settled(g["ratio"], lo, hi, r["target"])


def table(rows: list[dict]) -> str:
    head = ("| # | measurement | N | basis | without (A) | with hotfix (B) | B - A | ratio B/A [95% CI] | "
            "other ratio | target | |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "wall" not in r and "cpu" not in r:
            continue
        gate = r.get("gate", "wall")
        g, other = r.get(gate), r.get("cpu" if gate == "wall" else "wall")
        if g is None:
            lines.append(f"| {r['section']} | {r['title']} | - | - | - | - | - | - | - | (info) | |")
            continue
        unit = r["unit"]
        lo, hi = g["ratio_ci95"]
        ci = "" if math.isnan(lo) else f" [{lo:.3f}, {hi:.3f}]"
        if r.get("abs_target"):
            blo, bhi = r["b_ci"]
            ci = "" if math.isnan(blo) else f" (B: [{fmt(blo, unit)}, {fmt(bhi, unit)}])"
        oth = f"{other['ratio']:.3f} ({'CPU' if gate == 'wall' else 'wall'})" if other else "-"
        target, verdict = verdict_of(r)
        sign = "+" if g["delta"] >= 0 else "-"
        lines.append(
            f"| {r['section']} | {r['title']} | {g['n']} | {'CPU' if gate == 'cpu' else 'wall'} | "
            f"{fmt(g['a_median'], unit)} | {fmt(g['b_median'], unit)} | {sign}{fmt(abs(g['delta']), unit)} | "
            f"{g['ratio']:.3f}{ci} | {oth} | {target} | {verdict} |"
        )
    return "\n".join(lines)


def startup_text(rows: list[dict]) -> str:
    rows = [r for r in rows if r.get("importtime_ms")]
    if not rows:
        return ""
    out = ["Start-up detail (`-X importtime -c pass`, median cumulative ms; A's `sitecustomize` is the environment's "
           "own, or the failed lookup where it has none; the bundle's includes chaining to it):", "",
           "| case | hotfix start-up module B | sitecustomize A / B | all of `site` A / B |", "|---|---|---|---|"]
    for r in rows:
        a, b = r["importtime_ms"]["A"], r["importtime_ms"]["B"]
        out.append(f"| {r['title']} | {b['_vllm_minicpm_hotfix_arm']:.2f} | "
                   f"{a['sitecustomize']:.2f} / {b['sitecustomize']:.2f} | {a['site']:.2f} / {b['site']:.2f} |")
    counted = [r for r in rows if (r.get("instructions") or {}).get("A") and r["instructions"].get("B")]
    if counted:
        out += ["", "Start-up instructions (`valgrind --tool=callgrind python -c pass`, `PYTHONHASHSEED=0`: the same "
                "count on every run, whatever else the machine does):", "",
                "| case | A | B | B - A |", "|---|---|---|---|"]
        for r in counted:
            a, b = r["instructions"]["A"], r["instructions"]["B"]
            out.append(f"| {r['title']} | {a / 1e6:.3f} M | {b / 1e6:.3f} M | {(b - a) / 1e3:+.0f} k |")
    return "\n".join(out)


def load_text(rows: list[dict]) -> str:
    raw = next((r["raw"] for r in rows if r.get("key") == "load_raw"), None)
    if not raw or not raw["B"]:
        return ""
    spent = [r.get("hotfix_code_s") or {} for r in raw["B"]]
    attn = median([x.get("attn_load_weights", 0.0) * 1e3 for x in spent])
    copies = median([x.get("weight_loaders", 0.0) * 1e3 for x in spent])
    own = median([(x.get("attn_load_weights", 0.0) - x.get("weight_loaders", 0.0)) * 1e3 for x in spent])
    own_cpu = median([(x.get("attn_load_weights_cpu", 0.0) - x.get("weight_loaders_cpu", 0.0)) * 1e3 for x in spent])
    check = median([x.get("completeness_check", 0.0) * 1e3 for x in spent])
    check_cpu = median([x.get("completeness_check_cpu", 0.0) * 1e3 for x in spent])
    release = median([x.get("release_last_tensor", 0.0) * 1e3 for x in spent])
    a, b = raw["A"][0], raw["B"][0]
    return (
        f"Load detail: {a['n_loaded']} parameters loaded in both. In the patched runs the self-attention's "
        f"`load_weights` took {attn:.1f} ms, of which {copies:.1f} ms in vLLM's own weight loaders (the module's "
        f"tensor copies, made by stock vLLM too); the hotfix's own code: {own:.1f} ms there + {check:.1f} ms "
        f"(completeness check) per load, CPU time of the loading thread {own_cpu:.1f} + {check_cpu:.1f} ms "
        f"(medians; wall time includes waiting for a CPU on a busy machine). Not charged to the hotfix: releasing "
        f"the checkpoint's last tensor, which unmaps the whole file ({release:.0f} ms; stock vLLM does it as well). "
        f"The peak RSS during the load includes the checkpoint's pages "
        f"mapped by safetensors (file-backed peak +{median([r['file_peak_increase_mib'] for r in raw['A']]):.0f} / "
        f"+{median([r['file_peak_increase_mib'] for r in raw['B']]):.0f} MiB, A / B); anonymous memory grows by "
        f"the model's parameters only. Model construction before the load: {median([r['build_s'] for r in raw['A']]):.1f} s / "
        f"{median([r['build_s'] for r in raw['B']]):.1f} s (A / B, includes `import vllm`); both loads checked "
        f"bit-exact (vit_merger qkv_proj == cat(q, k, v)); B patched ({b['verdict']} release, force), A not."
    )


def breakdown_text(bd: dict, import_row: dict | None) -> str:
    if not bd or not bd.get("runs"):
        return ""
    p = bd["pieces_ms"]
    names = [
        ("install_now", "finder fires on `import vllm`: install_now total"),
        ("import_wrapt", "  import wrapt"),
        ("import_hook_modules", "  import hook, decision, record, fixes/*"),
        ("register", "  register the post-import hook"),
        ("wrapt_finder", "wrapt's import finder, asked about every later import ({calls:.0f} calls; timer included)"),
        ("on_import", "module imported: on_import total"),
        ("probe_qkv", "  q/k/v probe (fixes.qkv_loader.probe)"),
        ("patch_qkv", "  q/k/v patch (fixes.qkv_loader.apply)"),
        ("processor_fix", "  processor probe (fixes.processor_downsample_mode.probe)"),
    ]
    fixes = ", ".join(
        f"{k} {v['verdict']}, {'applied' if v['applied'] else 'not applied'}" for k, v in bd["fixes"].items()
    )
    out = [f"Import breakdown (vLLM 0.28.0, pip-installed, median of {bd['runs']} instrumented run(s); "
           f"fixes: {fixes}):", ""]
    out += ["| piece | ms |", "|---|---|"]
    for key, title in names:
        if key in p:
            out.append(f"| {title.format(calls=bd.get('wrapt_finder_calls', 0))} | {p[key]:.1f} |")
    attributed = p.get("install_now", 0.0) + p.get("on_import", 0.0) + p.get("wrapt_finder", 0.0)
    out.append(f"| attributed in all | {attributed:.1f} |")
    if "added_modules_self_ms" in bd:
        top = ", ".join(f"{m} {v:.1f}" for m, v in bd["added_modules_top"])
        out.append(f"| net: `-X importtime` self time of the {len(bd['modules_added'])} modules only the hotfix "
                   f"imports (largest: {top}) | {bd['added_modules_self_ms']:.1f} |")
    if import_row is not None:
        delta = import_row["wall"]["delta"] * 1e3
        out.append(f"| measured B - A (medians of the timed runs above) | {delta:+.0f} |")
    wa = bd["wrapt_alone"]
    out += ["", f"`import wrapt` alone in a fresh interpreter (`-X importtime`, cumulative): {wa['cumulative_ms']:.1f} ms, "
            f"{wa['modules_imported']:.0f} modules. Inside the vLLM import, {bd['wrapt_modules_vllm_imports_anyway']} of "
            f"the {bd['wrapt_modules']} modules wrapt pulls in are ones vLLM imports anyway (their cost only moves "
            f"earlier); imported only because of the hotfix: {len(bd['modules_added'])} modules "
            f"({', '.join(bd['modules_added'][:12])}{', ...' if len(bd['modules_added']) > 12 else ''})."]
    return "\n".join(out)


def facts_text(facts: dict) -> str:
    m = facts["machine"]
    lines = [f"Machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable, {m['cpu_model']}), {m['mem_gib']} GiB, "
             f"Linux {m['kernel']}; load average {m['loadavg_start']} at start, {m.get('loadavg_end')} at end; "
             f"{m['date']}; commit {m.get('commit', '?')}; run took {m.get('elapsed_min', '?')} min."
             + (f" Load average at the start of each new section: "
                + ", ".join(f"{k} {v}" for k, v in m["loadavg_sections"].items()) if m.get("loadavg_sections") else "")]
    for name, e in facts["envs"].items():
        lines.append(f"{name}: Python {e['python']}, torch {e['torch']}, vLLM {e['vllm']}, transformers "
                     f"{e['transformers']}, wrapt {e['wrapt']}, safetensors {e['safetensors']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--py-load", required=True, help="interpreter of the vLLM 0.32.0 environment (load benchmark)")
    ap.add_argument("--py", action="append", default=[], metavar="RELEASE=PYTHON",
                    help="interpreter of another release's environment (hook, request, serve; benchmarks/run sets them)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--hook-releases", default="0.22.1,0.28.0,0.33.0", help="releases of the hook benchmark")
    ap.add_argument("--hook-pairs", type=int, default=10,
                    help="pairs of fresh processes per release, eager and deferred probes (default 10)")
    ap.add_argument("--request-releases", default="0.32.0,0.33.0", help="releases of the per-request benchmark")
    ap.add_argument("--request-rounds", type=int, default=96, help="rounds, per request (default 96)")
    ap.add_argument("--request-reps", type=int, default=5,
                    help="calls per case, state and round, A and B alternating call by call, the min kept (default 5)")
    ap.add_argument("--serve-rounds", type=int, default=2, help="rounds of one stock and one hotfix server (default 2)")
    ap.add_argument("--serve-batches", type=int, default=3, help="batches per server (default 3)")
    ap.add_argument("--serve-requests", type=int, default=12, help="requests per batch (default 12)")
    ap.add_argument("--mixed-seconds", type=float, default=180,
                    help="measured seconds of each phase of the sustained mixed load (default 180)")
    ap.add_argument("--mixed-warmup", type=float, default=45,
                    help="warm-up seconds before each phase's measured part (default 45)")
    ap.add_argument("--mixed-concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--mixed-rounds", type=int, default=2,
                    help="rounds of one stock and one hotfix server, order alternating (default 2)")
    ap.add_argument("--mixed-max-requests", type=int, default=5000,
                    help="at most this many requests per phase (default 5000)")
    ap.add_argument("--startup-pairs", type=int, default=500, help="A/B pairs per start-up comparison (default 500)")
    ap.add_argument("--startup-warmup", type=int, default=5, help="discarded start-up runs of each first (default 5)")
    ap.add_argument("--import-pairs", type=int, default=10, help="A/B pairs of the model-module import (default 10)")
    ap.add_argument("--breakdown-runs", type=int, default=3, help="instrumented import runs (default 3; 0: none)")
    ap.add_argument("--load-pairs", type=int, default=5, help="A/B pairs of the full-size load (default 5)")
    ap.add_argument("--load-warmup", type=int, default=0, help="discarded load pairs first (default 0)")
    ap.add_argument("--inproc-loads", type=int, default=20,
                    help="warm reloads in one process, stock and patched alternating (default 20; 0: skip)")
    ap.add_argument("--json", type=Path, help="also write every figure, raw runs included, to this file")
    ap.add_argument("--remove-checkpoint", action="store_true",
                    help="delete the cached full-size checkpoint (~2.6 GB) at the end")
    ap.add_argument("--keep-work", action="store_true", help="keep the throwaway environments (printed path)")
    args = ap.parse_args(argv)
    if args.json:
        args.json = args.json.resolve()  # the run changes into a work folder
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}")

    t_start = time.perf_counter()
    facts = {"machine": common.machine_facts(), "envs": {}}
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                         capture_output=True, text=True, check=False)
    facts["machine"]["commit"] = git.stdout.strip() or "?"
    facts["envs"]["vLLM 0.28.0 environment (start-up, import)"] = common.env_facts(sys.executable)
    pythons = dict(p.split("=", 1) for p in args.py)
    pythons.setdefault("0.32.0", args.py_load)
    hook_rels = [r for r in args.hook_releases.split(",") if r]
    request_rels = [r for r in args.request_releases.split(",") if r]
    wanted = set()
    if "load" in only or "serve" in only or "mixed" in only:
        wanted.add("0.32.0")
    if "hook" in only:
        wanted.update(hook_rels)
    if "request" in only:
        wanted.update(request_rels)
    missing = sorted(r for r in wanted if r not in pythons and r != "0.28.0")
    if missing:
        ap.error(f"no interpreter for {missing}: pass --py RELEASE=PYTHON (benchmarks/run does)")
    pythons.setdefault("0.28.0", sys.executable)
    for rel in sorted(wanted - {"0.28.0"}):
        facts["envs"][f"vLLM {rel} environment"] = common.env_facts(pythons[rel])
    options = {k: v for k, v in vars(args).items() if k not in ("json",)}
    log(f"options: {options}")

    work = Path(tempfile.mkdtemp(prefix="vllm-minicpm-hotfix-bench."))
    os.chdir(work)  # children start in a neutral folder (a -c child has the cwd on sys.path)
    rows: list[dict] = []
    breakdown: dict = {}
    hook_detail: dict = {}
    mixed_detail: dict = {}
    import_row = None
    ckpt = None
    failed: list[str] = []
    try:
        envs = make_envs(work) if ("startup" in only or "import" in only) else {}
        if "startup" in only:
            try:
                for r in bench_startup(envs, args.startup_pairs, args.startup_warmup):
                    rows.append({**r, "section": 1})
            except Exception as exc:  # noqa: BLE001 - report it, go on with the other sections
                failed.append(f"startup: {type(exc).__name__}: {exc}")
        if "import" in only:
            try:
                import_row, breakdown = bench_import(envs, args.import_pairs, args.breakdown_runs, work)
                rows.append({**import_row, "section": 2})
            except Exception as exc:  # noqa: BLE001
                failed.append(f"import: {type(exc).__name__}: {exc}")
        if "load" in only:
            try:
                ckpt = ensure_checkpoint(args.py_load)
                for r in bench_load(args.py_load, ckpt, args.load_pairs, args.load_warmup, args.inproc_loads, work):
                    rows.append({**r, "section": 3})
            except Exception as exc:  # noqa: BLE001
                failed.append(f"load: {type(exc).__name__}: {exc}")
        facts["machine"]["loadavg_sections"] = loads = {}
        if "hook" in only:
            loads["hook"] = [round(x, 2) for x in os.getloadavg()]
            try:
                hook_rows, hook_detail = bench_hook(pythons, hook_rels, args.hook_pairs, work)
                rows.extend({**r, "section": 4} for r in hook_rows)
            except Exception as exc:  # noqa: BLE001
                failed.append(f"hook: {type(exc).__name__}: {exc}")
        if "request" in only:
            loads["request"] = [round(x, 2) for x in os.getloadavg()]
            try:
                rows.extend({**r, "section": 5} for r in bench_request(pythons, request_rels, args.request_rounds,
                                                                      args.request_reps, work))
            except Exception as exc:  # noqa: BLE001
                failed.append(f"request: {type(exc).__name__}: {exc}")
        if "serve" in only:
            loads["serve"] = [round(x, 2) for x in os.getloadavg()]
            try:
                rows.extend({**r, "section": 6} for r in bench_serve(pythons["0.32.0"], args.serve_rounds,
                                                                    args.serve_batches, args.serve_requests, work))
            except Exception as exc:  # noqa: BLE001
                failed.append(f"serve: {type(exc).__name__}: {exc}")
        if "mixed" in only:
            loads["mixed"] = [round(x, 2) for x in os.getloadavg()]
            try:
                mixed_rows, mixed_detail = bench_mixed(pythons["0.32.0"], args.mixed_seconds, args.mixed_warmup,
                                                       args.mixed_concurrency, args.mixed_rounds,
                                                       args.mixed_max_requests, work)
                rows.extend({**r, "section": 7} for r in mixed_rows)
            except Exception as exc:  # noqa: BLE001
                failed.append(f"mixed: {type(exc).__name__}: {exc}")
    finally:
        if args.keep_work:
            log(f"kept {work}")
        else:
            os.chdir("/")
            shutil.rmtree(work, ignore_errors=True)
        if args.remove_checkpoint and ckpt is not None:
            shutil.rmtree(ckpt, ignore_errors=True)
            log(f"removed {ckpt}")

    facts["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    facts["machine"]["elapsed_min"] = round((time.perf_counter() - t_start) / 60, 1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"facts": facts, "options": options, "rows": rows,
                                         "import_breakdown": breakdown, "hook_detail": hook_detail,
                                         "mixed": mixed_detail}, indent=1,
                                        default=str))
        log(f"wrote {args.json}")
    print()
    print(facts_text(facts))
    print()
    print(table(rows))
    for make in (lambda: startup_text(rows), lambda: breakdown_text(breakdown, import_row), lambda: load_text(rows),
                 lambda: hook_text(hook_detail), lambda: request_text(rows), lambda: mixed_text(mixed_detail)):
        try:
            text = make()
        except Exception as exc:  # noqa: BLE001 - a detail paragraph must not cost the table
            text = f"(detail not printed: {type(exc).__name__}: {exc})"
        if text:
            print()
            print(text)
    verdicts = {r["key"]: verdict_of(r)[1] for r in rows if ("wall" in r or "cpu" in r)}
    missed = [k for k, v in verdicts.items() if v == "MISSED"]
    unsettled = [k for k, v in verdicts.items() if v == "not settled"]
    if missed:
        log(f"targets MISSED: {', '.join(missed)}")
    if unsettled:
        log(f"targets not settled: {', '.join(unsettled)}")
    for f in failed:
        log(f"FAILED {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
