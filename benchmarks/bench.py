#!/usr/bin/env python
"""The hotfix's cost, measured: interpreter start-up, import of vLLM's model module, full-size weight loading, the
post-import hook per vLLM process, vLLM's multimodal processor per request, a serving engine, a sustained mixed load.

Run through ``benchmarks/run`` (it builds or reuses the vLLM environments with scripts/cpu-env and starts this file
with the vLLM 0.28.0 environment's interpreter); docs/benchmarks.md says what each section measures and how to read
the table. Every figure compares A (without the hotfix, or with it reverted) with B (with it), side by side in one
run, A and B alternating, as medians with B - A, the ratio B/A and 95% bootstrap intervals. Two budgets are judged
(issue 52): the hook's CPU per vLLM process (section 4, B at most 50 ms) and the hotfix's own work per 448x448
request (section 5, B - A at most 40 us); every other row is information.

Each section runs in fresh interpreters (the files next to this one): 1-2 ``python -c``, 3 load_one.py (the
checkpoint from make_full_checkpoint.py), 4 hook_child.py, 5 request_inproc.py, 6-7 serving.py. The environments
with the package are throwaway overlays of the shared ones (venvs.py): the wheel built from this tree and installed
with ``uv pip install --no-deps``, and a bundle written by ``vllm-minicpm-hotfix bundle``.
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

import common
import load_mix
import venvs
from common import compare, interleave, log, median, median_ci, spawn

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
M46 = "vllm.model_executor.models.minicpmv4_6"
#: The hotfix's one summary line of a process that patched something (vllm_minicpm_hotfix.record.summary_line).
PATCH_LINE = re.compile(r"vllm-minicpm-hotfix: MiniCPM-V .*, pid \d+: patched [1-9]\d*/")
SECTIONS = ("startup", "import", "load", "hook", "request", "serve", "mixed")
#: The budgets (issue 52): B's hook CPU per process, in ms; B - A of the processor call on a 448x448 image, in ms.
HOOK_BUDGET_MS = 50.0
REQUEST_BUDGET_MS = 0.040
ROLE_TITLES = (("api", "the API server (where the hotfix acts per request)"), ("engine", "EngineCore"),
               ("worker", "the worker (the model)"))


def child_env(**extra: str) -> dict[str, str]:
    """The environment of every measured child: nothing that activates or configures the hotfix, no PYTHONPATH,
    ``PYTHONDONTWRITEBYTECODE=1`` (nothing written into the shared environments; the package's own bytecode is
    compiled beforehand, as ``pip install`` does), ``VLLM_TARGET_DEVICE=cpu``."""
    env = venvs.clean_env(PYTHONDONTWRITEBYTECODE="1", VLLM_TARGET_DEVICE="cpu")
    for k in ("PYTHONSTARTUP", "PYTHONPROFILEIMPORTTIME", "PYTHONINSPECT"):
        env.pop(k, None)
    return {**env, **extra}


def json_child(argv: list[str], what: str, timeout: float, **kw) -> dict:
    """Run a benchmark program to completion; its last line of stdout, as JSON."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


_MADE: dict[str, Path | str] = {}


def overlay(work: Path, name: str, over: str = sys.executable, wheel: bool = True) -> str:
    """An overlay of ``over``'s environment (made once per name), with the wheel built from this tree installed and
    compiled (as ``pip install`` leaves it) unless ``wheel`` is false."""
    if name in _MADE:
        return str(_MADE[name])
    if wheel and "wheel" not in _MADE:
        _MADE["wheel"] = venvs.build_wheel(work / "wheel")
    py = _MADE[name] = venvs.overlay_env(work / name, over=over)
    if wheel:
        venvs.pip_install(py, str(_MADE["wheel"]))
        site = venvs.site_packages(py)
        if not (site / "vllm-minicpm-hotfix.pth").is_file():
            raise RuntimeError(f"the wheel did not install the package and its .pth into {site}")
        for path in (site / "vllm_minicpm_hotfix", site / "_vllm_minicpm_hotfix_arm.py"):
            subprocess.run([str(py), "-m", "compileall", "-q", str(path)], check=True, timeout=300,
                           stdout=subprocess.DEVNULL)
    return str(py)


# --------------------------------------------------------------------------------------------------------------------
# 1-2. Start-up and the model module's import (vLLM 0.28.0, where the hotfix patches)
# --------------------------------------------------------------------------------------------------------------------


def bench_startup(work: Path, pairs: int, warmup: int) -> list[dict]:
    base, pip = overlay(work, "base", wheel=False), overlay(work, "pip")
    bundle = venvs.make_bundle(work / "bundle")  # `vllm-minicpm-hotfix bundle` writes the .pyc for this Python
    plain = child_env()
    rows = []
    for key, title, b_py, b_env in (("startup_pip", "start-up `python -c pass`, pip-installed (.pth)", pip, plain),
                                    ("startup_bundle", "start-up `python -c pass`, bundle on PYTHONPATH", base,
                                     child_env(PYTHONPATH=str(bundle)))):
        def run(py, env):
            r = spawn([py, "-c", "pass"], env, timeout=30)
            if r.rc != 0:
                raise RuntimeError(f"{py} -c pass exited {r.rc}")
            return r

        log(f"{title}: {pairs} pairs")
        a, b = interleave(pairs, lambda: run(base, plain), lambda py=b_py, env=b_env: run(py, env), label=key,
                          warmup=warmup, progress_every=max(pairs // 4, 1) if pairs >= 40 else 0)
        rows.append({"key": key, "section": 1, "title": title, "unit": "ms",
                     "wall": compare([r.wall_s * 1e3 for r in a], [r.wall_s * 1e3 for r in b]),
                     "cpu": compare([r.cpu_s * 1e3 for r in a], [r.cpu_s * 1e3 for r in b])})
    return rows


def bench_import(work: Path, pairs: int) -> list[dict]:
    base, pip = overlay(work, "base", wheel=False), overlay(work, "pip")
    env, code = child_env(), f"import {M46}"

    def run(py, out, patched):
        r = spawn([py, "-c", code], env, timeout=900, stdout_path=out, stderr_path=out)
        if r.rc != 0 or bool(PATCH_LINE.search(r.stderr)) is not patched:
            raise RuntimeError(f"{py} -c {code!r}: exit {r.rc}, expected patched={patched}:\n{r.stderr[-3000:]}")
        return r

    log(f"import {M46}: {pairs} pairs (about {pairs * 2 * 35 // 60 + 1} min on a quiet 2-core machine)")
    a, b = interleave(pairs, lambda: run(base, str(work / "import-a.out"), False),
                      lambda: run(pip, str(work / "import-b.out"), True), label="import", progress_every=1)
    return [{"key": "import", "section": 2, "unit": "s",
             "title": f"`import {M46}`, pip-installed, vLLM 0.28.0 (patches)",
             "wall": compare([r.wall_s for r in a], [r.wall_s for r in b]),
             "cpu": compare([r.cpu_s for r in a], [r.cpu_s for r in b])}]


# --------------------------------------------------------------------------------------------------------------------
# 3. Full-size load (vLLM 0.32.0, whose own loading is correct: stock and patched load the same checkpoint)
# --------------------------------------------------------------------------------------------------------------------

LOAD_METRICS = (  # (key, title, unit, key of the CPU-time figure)
    ("load_s", "full-size load time (`load_weights`), vLLM 0.32.0", "s", "load_cpu_s"),
    ("ru_maxrss_mib", "peak RSS of the process (ru_maxrss)", "MiB", None),
    ("load_peak_increase_mib", "peak RSS increase during the load (VmHWM - RSS before)", "MiB", None),
    ("rss_increase_mib", "RSS kept after the load (increase)", "MiB", None),
)


def bench_load(py_load: str, pairs: int, warmup: int, work: Path) -> tuple[list[dict], Path]:
    log("full-size checkpoint: reusing the cached one or writing it (~1-2 min, ~2.6 GB)")
    made = subprocess.run([py_load, str(HERE / "make_full_checkpoint.py")], env=child_env(), capture_output=True,
                          text=True, timeout=1800, check=False)
    if made.returncode != 0:
        raise RuntimeError(f"make_full_checkpoint.py failed:\n{made.stdout[-2000:]}\n{made.stderr[-4000:]}")
    ckpt = Path(made.stdout.strip().splitlines()[-1])
    for f in sorted(ckpt.glob("*.safetensors")):  # warm the page cache: neither side pays the first read
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass

    def run(mode, side):
        out, err = str(work / f"load-{side}.out"), str(work / f"load-{side}.err")
        r = spawn([py_load, str(HERE / "load_one.py"), str(ckpt)], child_env(VLLM_MINICPM_HOTFIX=mode),
                  timeout=1200, stdout_path=out, stderr_path=err)
        if r.rc != 0:
            raise RuntimeError(f"load_one.py ({mode}) exited {r.rc}:\n{r.stderr[-4000:]}")
        res = json.loads(Path(out).read_text().strip().splitlines()[-1])
        if res["patched"] is not (mode == "force") or not res["exact"]:
            raise RuntimeError(f"load_one.py ({mode}): patched={res['patched']} exact={res['exact']}")
        return res

    log(f"full-size load on vLLM 0.32.0: {pairs} pairs (about {pairs * 2 * 50 // 60 + 1} min on a quiet machine)")
    a, b = interleave(pairs, lambda: run("auto", "A"), lambda: run("force", "B"), label="load", warmup=warmup,
                      progress_every=1)
    rows = []
    for key, title, unit, cpu_key in LOAD_METRICS:
        xs, ys = [r.get(key) for r in a], [r.get(key) for r in b]
        if None not in xs + ys:
            rows.append({"key": f"load_{key}", "section": 3, "title": title, "unit": unit, "wall": compare(xs, ys),
                         "cpu": compare([r[cpu_key] for r in a], [r[cpu_key] for r in b]) if cpu_key else None})
    return rows, ckpt


# --------------------------------------------------------------------------------------------------------------------
# 4. The post-import hook, per vLLM process
# --------------------------------------------------------------------------------------------------------------------


def bench_hook(pythons: dict[str, str], releases: list[str], pairs: int, work: Path) -> tuple[list[dict], dict]:
    """Fresh processes of each release, every probe at import (A, ``eager``) and as shipped (B) alternating; each
    child (hook_child.py) times the hook inside its model-module import, the fix modules' first import included."""
    rows, detail = [], {}
    for rel in releases:
        py = overlay(work, f"hook-{rel}", over=pythons[rel])
        out = str(work / f"hook-{rel}.out")

        def run(probes, py=py, out=out, rel=rel):
            r = spawn([py, str(HERE / "hook_child.py"), "-", probes], child_env(), timeout=900, stdout_path=out,
                      stderr_path=out + ".err")
            if r.rc != 0:
                raise RuntimeError(f"hook_child.py ({rel}, {probes}) exited {r.rc}:\n{r.stderr[-3000:]}")
            res = json.loads(Path(out).read_text().strip().splitlines()[-1])
            if "site-packages" not in res["package_file"]:
                raise RuntimeError(f"hook_child.py ({rel}) used {res['package_file']}, not the installed wheel")
            return res

        log(f"hook on vLLM {rel}: {pairs} pairs of fresh processes (eager / as shipped)")
        a, b = interleave(pairs, lambda: run("eager"), lambda: run("lazy"), label=f"hook {rel}")
        cb = [x["hook"]["cpu_ms"] for x in b]
        later = ", ".join(b[0]["first_use"]["fixes"]) or "none"
        rows.append({"key": f"hook_{rel}", "section": 4, "unit": "ms", "gate": "cpu", "budget": ("B", HOOK_BUDGET_MS),
                     "b_ci": median_ci(cb),
                     "title": f"post-import hook, CPU per vLLM process, vLLM {rel} (A: every probe at import; "
                              f"B: as shipped, probed at first use: {later})",
                     "cpu": compare([x["hook"]["cpu_ms"] for x in a], cb),
                     "wall": compare([x["hook"]["wall_ms"] for x in a], [x["hook"]["wall_ms"] for x in b])})
        detail[rel] = {"install_ms": median([x["install"]["cpu_ms"] for x in b]),
                       "import_fixes_ms": median([x["import_fixes"]["cpu_ms"] for x in b]),
                       "fixes_ms": {n: (median([x["fixes"][n]["cpu_ms"] for x in b]),
                                        median([x["fixes"][n]["cpu_ms"] for x in a])) for n in b[0]["fixes"]},
                       "first_use_ms": median([x["first_use"]["cpu_ms"] for x in b])}
    return rows, detail


def hook_text(detail: dict) -> str:
    if not detail:
        return ""
    rels = list(detail)
    out = ["Hook detail (CPU ms per vLLM process, medians, B / A; `install`: importing the package and registering "
           "the hook at `import vllm`, before the hook):", "",
           "| piece | " + " | ".join(f"vLLM {r}" for r in rels) + " |", "|---|" + "---|" * len(rels),
           "| install (import package, register) | " + " | ".join(f"{detail[r]['install_ms']:.1f}" for r in rels)
           + " |",
           "| import of the fix modules | " + " | ".join(f"{detail[r]['import_fixes_ms']:.1f}" for r in rels) + " |"]
    for n in detail[rels[0]]["fixes_ms"]:
        cells = ["{:.1f} / {:.1f}".format(*detail[r]["fixes_ms"][n]) if n in detail[r]["fixes_ms"] else "-"
                 for r in rels]
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out.append("| B: paid at first use instead | " + " | ".join(f"{detail[r]['first_use_ms']:.1f}" for r in rels)
               + " |")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------------
# 5. Per request: vLLM's multimodal processor
# --------------------------------------------------------------------------------------------------------------------


def bench_request(pythons: dict[str, str], releases: list[str], rounds: int, reps: int, work: Path) -> list[dict]:
    rows = []
    for rel in releases:
        log(f"per request on vLLM {rel}: {rounds} alternating rounds, min of {reps} calls per case")
        res = json_child([pythons[rel], str(HERE / "request_inproc.py"), str(REPO), str(rounds), str(reps)],
                         f"request_inproc.py ({rel})", 3600, env=child_env(), cwd=work)
        for name, c in res["cases"].items():
            row = {"key": f"request_{rel}_{name}", "section": 5, "unit": "ms", "gate": "cpu"}
            if c["error"]:
                rows.append({**row, "title": f"vLLM {rel}: {name}: not timed ({c['error']})", "cpu": None})
                continue
            toks = c["tokens"]
            # where stock ignores the kwarg it builds another prompt (other work): information only
            note = "" if toks.get("A") == toks.get("B") else \
                f" (stock ignores it: prompt {toks.get('A')} / {toks.get('B')} tokens, A / B)"
            budget = ("B-A", REQUEST_BUDGET_MS) if name == "image 448x448" else None
            rows.append({**row, "title": f"processor `apply` CPU, vLLM {rel}: {name}{note}", "budget": budget,
                         "cpu": compare(c["A"], c["B"]), "wall": compare(c["A_wall"], c["B_wall"])})
        rows[-1]["applied"] = f"vLLM {rel}: {', '.join(res['applied'])}"
    return rows


# --------------------------------------------------------------------------------------------------------------------
# 6-7. A serving engine; a sustained mixed load through it (serving.py, vLLM 0.32.0)
# --------------------------------------------------------------------------------------------------------------------


def qcompare(a: list[float], b: list[float], q: float) -> dict:
    """:func:`common.compare`'s fields for the ``q`` quantile of two unpaired samples (the interval resamples each)."""
    qa, qb = load_mix.quantile(a, q), load_mix.quantile(b, q)
    return {"n": min(len(a), len(b)), "a_median": qa, "b_median": qb, "delta": qb - qa,
            "ratio": qb / qa if qa else float("nan"), "ratio_ci95": list(common.quantile_ratio_ci(a, b, q))}


def bench_serving(py32: str, cfg: dict, work: Path) -> tuple[list[dict], list[str]]:
    log(f"vllm serve on 0.32.0: {cfg}")
    (work / "serving").mkdir()
    res = json_child([py32, str(HERE / "serving.py"), str(work / "serving"), json.dumps(cfg)], "serving.py",
                     cfg["rounds"] * 2 * (2 * (cfg["warmup"] + cfg["seconds"]) + 1500) + 1200, env=child_env(),
                     cwd=work)
    rows: list[dict] = []
    same = res["same_prompts"]
    lines = [f"Serving (sections 6-7): `vllm serve {' '.join(res['serve_args'])}`; prompts built alike by stock and "
             f"hotfix, request by request: {same}; start to healthy, s: "
             + ", ".join(f"{s} {[round(r['started_s']) for r in res[s]]}" for s in "AB") + "."]

    def pooled(side, get):
        return [v for r in res[side] for v in get(r)]

    def pair(get, key, title, unit_scale=1e3, gate="wall", **extra):
        a, b = pooled("A", get), pooled("B", get)
        n = min(len(a), len(b))
        rows.append({"key": key, "unit": "ms", "gate": gate, "title": title, **extra,
                     gate: compare([x * unit_scale for x in a[:n]], [x * unit_scale for x in b[:n]])})

    if cfg["batches"]:
        note = "" if same["plain"] else " (NOT like for like: different prompts)"
        pair(lambda r: [x["s_per_request"] for x in r["plain"]], "serve_s_per_request", f"`vllm serve` 0.32.0: wall "
             f"per request (1 / throughput), batches of {cfg['requests']} default-kwarg 1024x768 images, concurrency "
             f"4{note}", section=6)
        for role, name in ROLE_TITLES:
            pair(lambda r, role=role: [x["cpu"][role] for x in r["plain"]], f"serve_cpu_{role}",
                 f"  CPU per request of {name}", gate="cpu", section=6)
    if cfg["seconds"]:
        complete = all(r.get("valid", {}).get("complete") for s in "AB" for r in res[s])
        note = ("" if same["valid"] else " (NOT like for like)") + ("" if complete else " (a server did not finish)")
        pair(lambda r: r["valid"]["windows_s"], "mixed_s_per_request", f"`vllm serve` 0.32.0, sustained mixed load, "
             f"valid part (fresh images of 7 sizes with per-request kwargs, repeats, videos), {cfg['warmup']:.0f} s "
             f"warm-up + {cfg['seconds']:.0f} s, concurrency {cfg['concurrency']}: wall per request per window{note}",
             section=7)
        a, b = pooled("A", lambda r: r["valid"]["lat_valid"]), pooled("B", lambda r: r["valid"]["lat_valid"])
        for q in (0.5, 0.99):
            rows.append({"key": f"mixed_p{q * 100:.0f}", "section": 7, "unit": "ms", "gate": "wall",
                         "title": f"  latency of a valid request, p{q * 100:.0f}",
                         "wall": qcompare([x * 1e3 for x in a], [x * 1e3 for x in b], q)})
        for role, name in ROLE_TITLES:
            pair(lambda r, role=role: [r["valid"]["cpu"][role]], f"mixed_cpu_{role}",
                 f"  CPU per request of {name} (one figure per server)", gate="cpu", section=7)
        lines += [f"- {s} {p}: {r[p]['line']}; MM cache hit rate {r[p]['cache_hit']}"
                  for s in "AB" for r in res[s] for p in ("valid", "full") if p in r]
    return rows, lines


# --------------------------------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------------------------------


def fmt(v: float, unit: str) -> str:
    return f"{v:.3f} ms" if unit == "ms" and abs(v) < 1 else f"{v:.1f} ms" if unit == "ms" else \
        f"{v:.2f} s" if unit == "s" else f"{v:.0f} {unit}"


def verdict(r: dict) -> tuple[str, str]:
    """``(budget text, verdict)``: "met" when the whole 95% interval of the budgeted figure (B's median, or B - A) is
    at or below the budget, "MISSED" when all of it is above, "not settled" when it straddles the budget or there is
    no interval (fewer than 3 pairs); rows without a budget are information."""
    if not r.get("budget") or r.get(r.get("gate", "wall")) is None:
        return "(info)", ""
    on, limit = r["budget"]
    lo, hi = r["b_ci"] if on == "B" else r[r["gate"]]["delta_ci95"]
    text = f"{on} <= {fmt(limit, r['unit'])}"
    if math.isnan(lo) or math.isnan(hi):
        return text, "not settled"
    return text, "met" if hi <= limit else "MISSED" if lo > limit else "not settled"


def table(rows: list[dict]) -> str:
    lines = ["| # | measurement | N | basis | without (A) | with hotfix (B) | B - A | ratio B/A [95% CI] | "
             "other ratio | budget | |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gate = r.get("gate", "wall")
        g, other = r.get(gate), r.get("cpu" if gate == "wall" else "wall")
        if g is None:
            lines.append(f"| {r['section']} | {r['title']} | - | - | - | - | - | - | - | (info) | |")
            continue
        unit = r["unit"]
        lo, hi = g["ratio_ci95"]
        ci = "" if math.isnan(lo) else f" [{lo:.3f}, {hi:.3f}]"
        delta = f"{'+' if g['delta'] >= 0 else '-'}{fmt(abs(g['delta']), unit)}"
        if (r.get("budget") or ("",))[0] == "B-A" and not math.isnan(g["delta_ci95"][0]):
            delta += f" [{fmt(g['delta_ci95'][0], unit)}, {fmt(g['delta_ci95'][1], unit)}]"
        b = fmt(g["b_median"], unit)
        if r.get("b_ci") and not math.isnan(r["b_ci"][0]):
            b += f" [{fmt(r['b_ci'][0], unit)}, {fmt(r['b_ci'][1], unit)}]"
        oth = f"{other['ratio']:.3f} ({'CPU' if gate == 'wall' else 'wall'})" if other else "-"
        lines.append(f"| {r['section']} | {r['title']} | {g['n']} | {'CPU' if gate == 'cpu' else 'wall'} | "
                     f"{fmt(g['a_median'], unit)} | {b} | {delta} | {g['ratio']:.3f}{ci} | {oth} | "
                     + " | ".join(verdict(r)) + " |")
    return "\n".join(lines)


def facts_text(facts: dict) -> str:
    m = facts["machine"]
    lines = [f"Machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable, {m['cpu_model']}), {m['mem_gib']} GiB, "
             f"Linux {m['kernel']}; load average {m['loadavg_start']} at start, {m.get('loadavg_end')} at end, per "
             f"section {m.get('loadavg_sections')}; {m['date']}; commit {m.get('commit', '?')}; run took "
             f"{m.get('elapsed_min', '?')} min."]
    lines += [f"{name}: Python {e['python']}, torch {e['torch']}, vLLM {e['vllm']}, transformers {e['transformers']}, "
              f"wrapt {e['wrapt']}, safetensors {e['safetensors']}" for name, e in facts["envs"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--py-load", required=True, help="interpreter of the vLLM 0.32.0 environment (load, serving)")
    ap.add_argument("--py", action="append", default=[], metavar="RELEASE=PYTHON",
                    help="interpreter of another release's environment (hook, request; benchmarks/run sets them)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    add = ap.add_argument
    add("--startup-pairs", type=int, default=500, help="A/B pairs per start-up comparison (default 500)")
    add("--startup-warmup", type=int, default=5, help="discarded start-up runs of each first (default 5)")
    add("--import-pairs", type=int, default=10, help="A/B pairs of the model-module import (default 10)")
    add("--load-pairs", type=int, default=5, help="A/B pairs of the full-size load (default 5)")
    add("--load-warmup", type=int, default=0, help="discarded load pairs first (default 0)")
    add("--hook-releases", default="0.22.1,0.28.0,0.33.0", help="releases of the hook benchmark")
    add("--hook-pairs", type=int, default=10, help="pairs of fresh processes per release (default 10)")
    add("--request-releases", default="0.32.0,0.33.0", help="releases of the per-request benchmark")
    add("--request-rounds", type=int, default=96, help="rounds, per request (default 96)")
    add("--request-reps", type=int, default=5, help="calls per case, state and round, the min kept (default 5)")
    add("--serve-rounds", type=int, default=2, help="rounds of one stock and one hotfix server (default 2)")
    add("--serve-batches", type=int, default=3, help="section 6: batches per server (default 3)")
    add("--serve-requests", type=int, default=12, help="section 6: requests per batch (default 12)")
    add("--mixed-seconds", type=float, default=180, help="section 7: measured seconds per phase (default 180)")
    add("--mixed-warmup", type=float, default=45, help="section 7: warm-up seconds per phase (default 45)")
    add("--mixed-concurrency", type=int, default=8, help="section 7: requests in flight (default 8)")
    add("--mixed-max-requests", type=int, default=5000, help="section 7: at most this many per phase (default 5000)")
    add("--json", type=Path, help="also write every figure to this file")
    add("--remove-checkpoint", action="store_true", help="delete the cached full-size checkpoint (~2.6 GB) at the end")
    add("--keep-work", action="store_true", help="keep the throwaway environments (printed path)")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if set(only) - set(SECTIONS):
        ap.error(f"unknown section(s) {sorted(set(only) - set(SECTIONS))}; choose from {','.join(SECTIONS)}")
    json_path = args.json.resolve() if args.json else None  # the run changes into a work folder

    t_start = time.perf_counter()
    facts: dict = {"machine": common.machine_facts(), "envs": {}}
    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
                         capture_output=True, text=True, check=False)
    facts["machine"]["commit"] = git.stdout.strip() or "?"
    pythons = {"0.28.0": sys.executable, "0.32.0": args.py_load, **dict(p.split("=", 1) for p in args.py)}
    hook_rels = [r for r in args.hook_releases.split(",") if r] if "hook" in only else []
    request_rels = [r for r in args.request_releases.split(",") if r] if "request" in only else []
    missing = sorted(set(hook_rels + request_rels) - set(pythons))
    if missing:
        ap.error(f"no interpreter for {missing}: pass --py RELEASE=PYTHON (benchmarks/run does)")
    for rel in sorted({"0.28.0", "0.32.0", *hook_rels, *request_rels}):
        facts["envs"][f"vLLM {rel} environment"] = common.env_facts(pythons[rel])
    log(f"options: {vars(args)}")

    work = Path(tempfile.mkdtemp(prefix="vllm-minicpm-hotfix-bench."))
    os.chdir(work)  # children start in a neutral folder (a -c child has the cwd on sys.path)
    rows: list[dict] = []
    texts: list[str] = []
    ckpts: list[Path] = []
    failed: list[str] = []
    serving = {"rounds": args.serve_rounds, "batches": args.serve_batches * ("serve" in only),
               "requests": args.serve_requests, "seconds": args.mixed_seconds * ("mixed" in only),
               "warmup": args.mixed_warmup, "concurrency": args.mixed_concurrency,
               "max_requests": args.mixed_max_requests}
    steps = {
        "startup": lambda: rows.extend(bench_startup(work, args.startup_pairs, args.startup_warmup)),
        "import": lambda: rows.extend(bench_import(work, args.import_pairs)),
        "load": lambda: (lambda r, c: (rows.extend(r), ckpts.append(c)))(
            *bench_load(args.py_load, args.load_pairs, args.load_warmup, work)),
        "hook": lambda: (lambda r, d: (rows.extend(r), texts.append(hook_text(d))))(
            *bench_hook(pythons, hook_rels, args.hook_pairs, work)),
        "request": lambda: rows.extend(bench_request(pythons, request_rels, args.request_rounds, args.request_reps,
                                                     work)),
        "serve": lambda: (lambda r, t: (rows.extend(r), texts.append("\n".join(t))))(
            *bench_serving(args.py_load, serving, work)),
    }
    facts["machine"]["loadavg_sections"] = loads = {}
    try:
        for name, step in steps.items():
            if name in only or (name == "serve" and "mixed" in only):
                loads[name] = [round(x, 2) for x in os.getloadavg()]
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - report it, go on with the other sections
                    failed.append(f"{name}: {type(exc).__name__}: {exc}")
    finally:
        os.chdir("/")
        if args.keep_work:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        for ckpt in ckpts if args.remove_checkpoint else ():
            shutil.rmtree(ckpt, ignore_errors=True)
            log(f"removed {ckpt}")

    facts["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    facts["machine"]["elapsed_min"] = round((time.perf_counter() - t_start) / 60, 1)
    applied = [r["applied"] for r in rows if r.get("applied")]
    if applied:
        texts.append("Per request, B's fixes in place (checked by request_inproc.py before any call is timed): "
                     + "; ".join(applied) + ".")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"facts": facts, "options": vars(args), "rows": rows, "texts": texts},
                                        indent=1, default=str))
        log(f"wrote {json_path}")
    print(f"\n{facts_text(facts)}\n\n{table(rows)}")
    for text in texts:
        if text:
            print(f"\n{text}")
    verdicts = {r["key"]: verdict(r)[1] for r in rows}
    for what in ("MISSED", "not settled"):
        if what in verdicts.values():
            log(f"budgets {what}: {', '.join(k for k, v in verdicts.items() if v == what)}")
    for f in failed:
        log(f"FAILED {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
