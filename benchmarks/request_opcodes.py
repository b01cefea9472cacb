"""The hotfix's own Python work in one request, counted: bytecodes and frames of the package per request.

    python request_opcodes.py REPO [CASE] [REQUESTS] [TOP]

The same request as ``request_profile.py`` and ``request_sample.py`` (vLLM 0.32+, the post-import hook applied with
``auto``, vLLM's own processor over the real-geometry tiny checkpoint; default case ``image 448x448``), with REPO's
package. After 20 warm calls it runs REQUESTS more (default 20) under ``sys.settrace`` with opcode events switched on in
the package's frames only, and prints per request the bytecodes executed in those frames and the frames entered, then
the TOP (default 20) functions by bytecodes.

A count, not a time: the same on every run, whatever else the machine does (as the callgrind counts of start-up in
docs/benchmarks.md). Work the package's lines call in C -- a ``tolist()`` into torch, a hash, a context variable --
counts as one bytecode here, and what a line costs when it runs cold after vLLM's pixel work is not in it: the
sampling profile (``request_sample.py``) measures time. Use it to compare two versions of the request path (two
checkouts as REPO) on a shared machine whose speed changes between runs.
"""

import collections
import sys
from pathlib import Path

PACKAGE = "vllm_minicpm_hotfix"


def count(call, requests: int) -> tuple[collections.Counter, collections.Counter]:
    """``call()`` ``requests`` times under the tracer: ``(bytecodes by function, frames by function)``."""
    ops: collections.Counter = collections.Counter()
    frames: collections.Counter = collections.Counter()

    def tracer(frame, event, arg):
        if PACKAGE not in frame.f_code.co_filename:
            return None
        name = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
        frames[name] += 1
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False

        def local(frame, event, arg):
            if event == "opcode":
                ops[name] += 1
            return local

        return local

    sys.settrace(tracer)
    try:
        for _ in range(requests):
            call()
    finally:
        sys.settrace(None)
    return ops, frames


def main(repo: str, case: str, requests: int, top: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import request_profile as rp

    with rp.warm_request(repo, case, 20) as (call, name):
        ops, frames = count(call, requests)
    import vllm

    print(f"{name}, vLLM {vllm.__version__}, {requests} requests: {sum(ops.values()) / requests:.0f} bytecodes and "
          f"{sum(frames.values()) / requests:.0f} frames of {PACKAGE} per request")
    for where, n in ops.most_common(top):
        print(f"  {n / requests:7.1f}  {frames[where] / requests:4.1f}  {where}")


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1] if len(a) > 1 else "image 448x448", int(a[2]) if len(a) > 2 else 20, int(a[3]) if len(a) > 3 else 20)
