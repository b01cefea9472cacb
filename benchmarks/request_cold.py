"""What one line of the request path costs where it runs, against what it costs warm.

    python request_cold.py REPO [REQUESTS]

The same request as ``request_profile.py`` (vLLM 0.32+, the post-import hook applied with ``auto``, vLLM's own
processor over the real-geometry tiny checkpoint, image 448x448), with REPO's package. The first line of
``mm_placeholders.get_mm_prompt_updates`` -- the call's three arguments read, the request tuple made, the context
variable set -- runs right after vLLM's pixel work. For REQUESTS requests (default 1000, after 20 warm ones) this
script runs that behaviour with ``time.perf_counter_ns()`` between the line's parts (the behaviour's code object is
swapped for :func:`timed`'s for the run, then put back), and then runs the same parts on the last request's objects in
a tight loop, where everything they touch stays in the CPU's caches. It prints the median nanoseconds of each part in
place and warm (one timer read, ~40 ns, is in each in-place figure).

A count of bytecodes (``request_opcodes.py``) ranks lines by what they do; this shows why a line's time is not its
length: in place each part costs several times its warm time, by what it touches for the first time since the pixel
work.
"""

import statistics
import sys
import time
from pathlib import Path

PARTS = ("read the 3 arguments", "`or {}`", "Request(...)", "REQUEST.set(...)", "REQUEST.reset(token)")


def timed(wrapped, instance, call):
    """``get_mm_prompt_updates`` with a timer read between the parts of its first line (the code swapped in)."""
    t0 = _now()
    items, kwargs, out = call.get("mm_items"), call.get("hf_processor_mm_kwargs"), call.get("out_mm_kwargs")
    t1 = _now()
    kwargs = kwargs or {}
    t2 = _now()
    request = mp.request((items, kwargs, out))
    t3 = _now()
    token = mp.REQUEST.set(request)
    t4 = _now()
    try:
        return wrapped(*call.args, **call.kwargs)
    finally:
        t5 = _now()
        mp.REQUEST.reset(token)
        _TIMES.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, _now() - t5))
        _LAST[:] = [call]


def warm(call, loops: int = 20000) -> list[float]:
    """The same parts on ``call``'s objects, ``loops`` times in a row: ns per part."""
    from vllm_minicpm_hotfix.fixes import _mm_prompt as mp

    now, out = time.perf_counter_ns, [0.0] * len(PARTS)
    items, kwargs, o = call.get("mm_items"), call.get("hf_processor_mm_kwargs"), call.get("out_mm_kwargs")
    request = mp.request((items, kwargs or {}, o))
    steps = (
        lambda: (call.get("mm_items"), call.get("hf_processor_mm_kwargs"), call.get("out_mm_kwargs")),
        lambda: kwargs or {},
        lambda: mp.request((items, kwargs, o)),
        lambda: mp.REQUEST.reset(mp.REQUEST.set(request)),  # set and reset: the reset is then subtracted
        lambda: None,
    )
    for i, step in enumerate(steps):
        start = now()
        for _ in range(loops):
            step()
        out[i] = (now() - start) / loops
    empty = out[4]
    out = [x - empty for x in out]
    set_reset = out[3]
    out[3] = out[4] = set_reset / 2  # ContextVar.set and .reset alike warm (one C call each)
    return out


def main(repo: str, requests: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import request_profile as rp

    with rp.warm_request(repo, "image 448x448", 20) as (call, name):
        from vllm_minicpm_hotfix.fixes import _mm_prompt
        from vllm_minicpm_hotfix.fixes import mm_placeholders as target

        behaviour = target.get_mm_prompt_updates
        own_code, scope = behaviour.__code__, behaviour.__globals__
        times, last = [], []
        scope.update(_now=time.perf_counter_ns, _TIMES=times, _LAST=last, mp=_mm_prompt)
        behaviour.__code__ = timed.__code__
        try:
            for _ in range(requests):
                call()
        finally:
            behaviour.__code__ = own_code
            for key in ("_now", "_TIMES", "_LAST"):
                scope.pop(key, None)
        hot = warm(last[0])
    import vllm

    print(f"{name}, vLLM {vllm.__version__}, {requests} requests: the first line of get_mm_prompt_updates, ns")
    print(f"  {'part':24s} {'in place (median)':>18s} {'warm':>8s} {'ratio':>6s}")
    for i, part in enumerate(PARTS):
        cold = statistics.median(t[i] for t in times)
        print(f"  {part:24s} {cold:18.0f} {hot[i]:8.0f} {cold / max(hot[i], 1):6.1f}")
    total = statistics.median(sum(t) for t in times)
    print(f"  {'the whole line and reset':24s} {total:18.0f} {sum(hot):8.0f} {total / max(sum(hot), 1):6.1f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
