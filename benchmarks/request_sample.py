"""The hotfix's own work in one request, from a sampling profile: py-spy's samples of vLLM's processor ``apply``.

    python request_sample.py REPO [SECONDS] [RATE] [CASE]

The same request as ``request_profile.py`` (vLLM 0.32+, the post-import hook applied with ``auto``, vLLM's own processor
over the real-geometry tiny checkpoint, called as vLLM's renderer calls it; default case ``image 448x448``; the same
pass-through frames where a wrapper hands on to vLLM), measured without a deterministic profiler. This script starts
itself again as the driver under ``py-spy record --rate RATE`` (default 97 Hz); the driver calls ``apply`` in a loop for
``SECONDS`` (default 120) after 20 warm calls and reports the CPU time of its thread per call. py-spy reads the stack
from outside, so nothing runs in the driver per call event: cProfile's figure for small functions that run right after
vLLM's heavy ones is inflated by what it does per event (docs/benchmarks.md).

Why py-spy's defaults are not used:

- ``--nonblocking`` reads the stack while the driver runs, and a read that overlaps a call or a return keeps frames
  already popped. Such torn stacks put a wrapper's ``return behaviour(...)`` line under frames it never calls. That
  line then showed as a third of the hotfix's samples, and the figure was biased toward the hotfix.
- So the driver is stopped for each sample, which is py-spy's blocking default. That costs the driver about 90 us of
  CPU per sample and leaves its caches cold. At py-spy's 100 Hz scale (97 Hz, not a divisor of a request's length)
  that is about 1% of its time. At 997 Hz a call took 15.7 ms of CPU instead of 6-7 ms, and small Python functions
  suffer more from cold caches than torch's loops.

A sample counts as the hotfix's own work when the innermost of its frames inside the loop that is either the package's
(``vllm_minicpm_hotfix``) or vLLM's code a wrapper hands the request on to (``request_profile.handing_on``) is the
package's. That is the package's own lines and what they call in other code (the standard library, torch, vLLM's
helpers), as ``request_profile.py`` counts it. Prints the share of the loop's samples that are the hotfix's own work,
with its 95% interval (Wilson; the samples taken as independent), that share times the CPU time per call, and the
package lines most often at that innermost place. ``KEEP_RAW=PATH`` keeps py-spy's raw samples.

Needs py-spy (``pip install py-spy``), next to this Python or on ``PATH``.
"""

import collections
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

PACKAGE = "vllm_minicpm_hotfix"
LOOP = "sampled_calls"
FRAME = re.compile(r"^(?P<name>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def sampled_calls(call, seconds: float) -> tuple[int, float, float]:
    """``call()`` for ``seconds``; ``(calls, wall seconds, this thread's CPU seconds)``. The frame py-spy's samples
    are counted inside."""
    calls, start, cpu = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - start < seconds:
        call()
        calls += 1
    return calls, time.perf_counter() - start, time.thread_time() - cpu


def drive(repo: str, seconds: float, case: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import request_profile as rp

    with rp.warm_request(repo, case, 20) as (call, name):
        calls, wall, cpu = sampled_calls(call, seconds)
    import vllm

    print(json.dumps({"case": name, "vllm": vllm.__version__, "calls": calls, "wall_s": wall, "cpu_s": cpu}))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's 95% interval for the share ``k / n`` (``(0, 1)`` for ``n == 0``)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def classify(raw: str, handed_on, profile_file: str) -> tuple[int, int, collections.Counter, int]:
    """``(loop samples, own samples, own samples by package line, samples outside every wrapper)`` of py-spy's raw
    output (``name (file:line);... count`` per line, outermost frame first); ``profile_file`` is where
    ``request_profile.py``'s pass-through frames are defined, as ``handed_on`` knows it."""
    loop = own = outside = 0
    by_line: collections.Counter = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = []
        for text in stack.split(";"):
            m = FRAME.match(text)
            frames.append((m["file"], int(m["line"]), m["name"]) if m else ("", 0, text))
        inside = next((i for i, f in enumerate(frames) if f[2] == LOOP), None)
        if inside is None:
            continue
        n = int(count)
        loop += n
        for file, lineno, name in reversed(frames[inside + 1:]):
            if PACKAGE in file:
                own += n
                by_line[f"{Path(file).name}:{lineno} {name.rpartition('.')[2]}"] += n
                break
            key = (profile_file if Path(file).name == "request_profile.py" else file, lineno, name.rpartition(".")[2])
            if handed_on(key):
                break
        else:
            outside += n
    return loop, own, by_line, outside


def main(repo: str, seconds: float, rate: int, case: str) -> None:
    here = Path(__file__).resolve()
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if spy is None:
        sys.exit("request_sample.py needs py-spy: pip install py-spy")
    sys.path.insert(0, repo)
    sys.path.insert(0, str(here.parent))
    import request_profile as rp

    from vllm_minicpm_hotfix.fixes import REGISTRY

    with tempfile.TemporaryDirectory(prefix="vmh-request-sample.") as tmp:
        out = Path(tmp) / "raw.txt"
        done = subprocess.run(
            [spy, "record", "--rate", str(rate), "--full-filenames", "--format", "raw", "--output", str(out), "--",
             sys.executable, str(here), "--drive", repo, str(seconds), case], capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            sys.exit(f"py-spy or the driver failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        result = json.loads([x for x in done.stdout.splitlines() if x.startswith("{")][-1])
        if os.environ.get("KEEP_RAW"):  # the samples, for a reader's own look (py-spy's raw format)
            shutil.copy(out, os.environ["KEEP_RAW"])
        loop, own, by_line, outside = classify(out.read_text(), rp.handing_on(REGISTRY), rp.__file__)
    per_call_ms = result["cpu_s"] / result["calls"] * 1e3
    share, (low, high) = own / max(loop, 1), wilson(own, loop)
    print(f"{result['case']}, vLLM {result['vllm']}, py-spy at {rate} Hz for {seconds:g} s: {result['calls']} calls, "
          f"{per_call_ms:.3f} ms CPU per call ({result['wall_s'] / result['calls'] * 1e3:.3f} ms wall), {loop} "
          f"samples in the loop, {outside} of them outside every wrapper")
    print(f"hotfix's own work: {own} of {loop} samples = {share:.2%} [{low:.2%}, {high:.2%}] -> {share * per_call_ms:.4f} "
          f"ms CPU per call [{low * per_call_ms:.4f}, {high * per_call_ms:.4f}]")
    print("innermost package line, samples (share of the hotfix's own):")
    for where, n in by_line.most_common(int(os.environ.get("TOP", 12))):
        print(f"  {n:6d}  {n / max(own, 1):6.1%}  {where}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--drive"]:
        drive(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    else:
        a = sys.argv[1:]
        main(a[0], float(a[1]) if len(a) > 1 else 120.0, int(a[2]) if len(a) > 2 else 97,
             a[3] if len(a) > 3 else "image 448x448")
