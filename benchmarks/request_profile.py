"""The hotfix's own work in one request, from a profile: what its functions cost inside vLLM's processor ``apply``.

    python request_profile.py REPO [CALLS] [CHUNKS] [CASE] [--cpu]

Runs in a vLLM 0.32+ environment with the package imported from ``REPO``: the post-import hook applied (``auto``),
vLLM's own processor over the real-geometry tiny checkpoint, called as vLLM's renderer calls it (the set-up, cases and
call of ``request_inproc.py``; default case ``image 448x448``), a few warm calls, then ``CHUNKS`` (default 6) chunks
of ``CALLS`` (default 200) calls each under ``cProfile``: its default wall-clock timer, or with ``--cpu`` this thread's
CPU time (a system call per event, so a larger cost per event to subtract; but not inflated by other processes taking
the CPU, which a wall-clock profile on a busy machine is).

The hotfix's own work per call is, from the profile: the internal time of every function defined in the package, plus
the time of every call those functions make into other code (the standard library, torch, vLLM's helpers such as
``ctx.get_hf_processor``), *except* the calls that hand the request on to vLLM's own code -- the function a wrapper
wraps (a patched attribute's name, in vLLM) and vLLM's prompt-replacement callables (``get_*_replacement``), which
stock vLLM runs as well. cProfile's own cost per call event is calibrated in the same process (a loop of two small
functions, profiled and not) and subtracted for the events counted (the hotfix's functions and their direct calls);
the events deeper inside those calls are not subtracted, so the figure errs high. Prints, per chunk, that figure in
ms, their median, and for the last chunk the functions that cost most (per call of ``apply``) and how often each
runs.
"""

import contextlib
import cProfile
import gc
import inspect
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "vllm_minicpm_hotfix"


def profiler(cpu: bool) -> cProfile.Profile:
    """cProfile with its default wall-clock timer, or (``cpu``) this thread's CPU time in ns (a system call per event,
    calibrated away below, but not inflated by other processes taking the CPU: the choice on a busy machine)."""
    return cProfile.Profile(time.thread_time_ns, 1e-9) if cpu else cProfile.Profile()


def profiler_cost_per_event(cpu: bool, n: int = 100_000) -> float:
    """Seconds cProfile adds to the internal time it reports, per call event (calibrated on two small functions)."""

    def leaf(a, b=None):
        return a

    def mid(x):
        return leaf(x) + leaf(x, 1)

    clock = time.thread_time if cpu else time.perf_counter
    t = clock()
    for i in range(n):
        mid(i)
    plain = (clock() - t) / n
    prof = profiler(cpu)
    prof.enable()
    for i in range(n):
        mid(i)
    prof.disable()
    profiled = sum(v[2] for k, v in pstats.Stats(prof).stats.items() if k[2] in ("mid", "leaf")) / n
    return max(0.0, (profiled - plain) / 3)


def own_work(stats: dict, handed_on) -> tuple[float, int, dict]:
    """``(seconds, call events, per-function seconds)`` of the package's own work in a cProfile ``stats`` dict."""
    total, events, per_fn = 0.0, 0, {}
    for key, (_, ncalls, tottime, _, callers) in stats.items():
        if PACKAGE in key[0]:
            total += tottime
            events += ncalls
            per_fn[key] = per_fn.get(key, 0.0) + tottime
            continue
        if handed_on(key):
            continue
        for caller, (_, cnc, _, cct) in callers.items():
            if PACKAGE in caller[0]:
                total += cct
                events += cnc
                per_fn[caller] = per_fn.get(caller, 0.0) + cct
    return total, events, per_fn


def passed_on(module, registry) -> None:
    """Put a pass-through frame (:func:`passing_on`) between the wrappers the hook is about to set and each vLLM
    method they wrap, so that what vLLM's method frees when it returns is not charged to the hotfix.

    cProfile charges the freeing of a function's locals to its *caller*: the return event fires before the frame is
    cleared (a function building a list of 20,000 small lists: 3 us its own, 539 us charged to a caller that only
    calls it). Around vLLM's ``_apply_hf_processor`` or ``process_mm_inputs`` -- whose locals are the request's
    tensors and images -- that freeing would count as the hotfix's work, where stock vLLM pays it in its own caller.
    With this frame it is charged to the frame, which counts as vLLM's (``handed_on``), as the call itself does."""
    import functools

    for fix in registry:
        for target in getattr(fix, "SETS", ()):
            if ":" in target or target.rpartition(".")[2].startswith("__"):
                continue
            owner_name, _, attr = target.rpartition(".")
            owner = getattr(module, owner_name, None)
            original = getattr(owner, attr, None)
            if not isinstance(owner, type) or not inspect.isfunction(original) or getattr(original, "__wrapped__", 0):
                continue

            def passing_on(*args, __original=original, **kwargs):
                return __original(*args, **kwargs)

            setattr(owner, attr, functools.wraps(original)(passing_on))


def handing_on(registry):
    """The test ``handed_on(key)`` for a profile's ``(file, line, function)``: is it vLLM's own code that a wrapper
    passes the request to (stock vLLM runs it too) -- a pass-through frame, a patched attribute's function in vLLM, or
    one of vLLM's ``get_*_replacement`` callables."""
    patched = {target.rpartition(".")[2] for fix in registry for target in getattr(fix, "SETS", ())}

    def handed_on(key) -> bool:
        if key[0] == __file__ and key[2] == "passing_on":
            return True
        in_vllm = f"{os.sep}vllm{os.sep}" in key[0] and not key[0].endswith("context.py")
        return in_vllm and (key[2] in patched or (key[2].startswith("get_") and key[2].endswith("_replacement")))

    return handed_on


@contextlib.contextmanager
def warm_request(repo: str, case: str, warm: int):
    """Yields ``(call, name)``: ``call()`` runs ``case`` once through vLLM's own processor (``request_inproc``'s
    real-geometry tiny checkpoint, in a temporary folder removed afterwards), with the post-import hook applied
    (``auto``) over the pass-through frames (:func:`passed_on`), after ``warm`` calls, ``gc.collect()`` and
    ``gc.freeze()``. torch on one thread; ``repo``'s package and benchmarks first on ``sys.path``."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, repo)
    sys.path.insert(0, str(Path(repo) / "benchmarks"))
    import torch

    torch.set_num_threads(1)
    import request_inproc as ri
    import vllm.model_executor.models.minicpmv4_6 as m46

    from vllm_minicpm_hotfix import hook
    from vllm_minicpm_hotfix.fixes import REGISTRY

    passed_on(m46, REGISTRY)
    hook.on_import(m46)
    work = Path(tempfile.mkdtemp(prefix="vmh-request-profile."))
    try:
        proc = ri.make_processor(ri.real_geometry(Path(repo), work / "ckpt"))
        name, modality, items, kwargs = next(c for c in ri.cases() if c[0] == case)
        for _ in range(warm):
            ri.call(proc, modality, items, kwargs)
        gc.collect()
        gc.freeze()
        yield (lambda: ri.call(proc, modality, items, kwargs)), name
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(repo: str, calls: int, chunks: int, case: str, cpu: bool) -> None:
    with warm_request(repo, case, 5) as (call, name):
        import vllm

        from vllm_minicpm_hotfix.fixes import REGISTRY

        handed_on = handing_on(REGISTRY)
        per_event = profiler_cost_per_event(cpu)
        figures = []
        for _ in range(chunks):
            prof = profiler(cpu)
            t = time.perf_counter()
            prof.enable()
            for _ in range(calls):
                call()
            prof.disable()
            apply_ms = (time.perf_counter() - t) / calls * 1e3
            stats = pstats.Stats(prof).stats
            seconds, events, per_fn = own_work(stats, handed_on)
            figures.append(((seconds - events * per_event) / calls * 1e3, seconds / calls * 1e3, events / calls))
            control = [(v[2], v[1]) for k, v in stats.items() if k[0] == __file__ and k[2] == "passing_on"]
        print(f"{name}, vLLM {vllm.__version__}, timer {'thread CPU' if cpu else 'wall'}, {chunks} chunks of {calls} "
              f"profiled calls; apply per call (wall) under the "
              f"profiler {apply_ms:.2f} ms; profiler cost per event {per_event * 1e6:.3f} us")
        print("hotfix's own work per call, ms (profiled time minus the profiler's cost per counted event), per chunk: "
              + " ".join(f"{f[0]:.4f}" for f in figures)
              + f"; median {statistics.median(f[0] for f in figures):.4f}, lowest {min(f[0] for f in figures):.4f} (uncorrected median "
              f"{statistics.median(f[1] for f in figures):.4f}); call events counted per call {figures[-1][2]:.0f}")
        shim_us, shim_calls = sum(c[0] for c in control) / calls * 1e6, sum(c[1] for c in control) / calls
        print(f"control, last chunk: the pass-through frames (passing_on: they do nothing, at the boundaries where the "
              f"hotfix hands on to vLLM) are charged {shim_us:.1f} us per call of apply over {shim_calls:.0f} frames "
              f"({shim_us / max(shim_calls, 1):.1f} us per frame; vLLM's own work, not counted above)")
        print("last chunk, per call of apply: us  calls  function")
        for key, sec in sorted(per_fn.items(), key=lambda kv: -kv[1])[:int(os.environ.get("TOP", 15))]:
            print(f"  {sec / calls * 1e6:7.1f}  {stats[key][1] / calls:5.1f}  {Path(key[0]).name}:{key[1]} {key[2]}")


if __name__ == "__main__":
    a = [x for x in sys.argv[1:] if x != "--cpu"]
    main(a[0], int(a[1]) if len(a) > 1 else 200, int(a[2]) if len(a) > 2 else 6, a[3] if len(a) > 3 else "image 448x448",
         "--cpu" in sys.argv)
