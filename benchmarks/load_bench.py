"""A sustained mixed load through real ``vllm serve``: stock (A) against the hotfix pip-installed (B), the same seeded
requests, one server at a time. Prints one JSON object (last line).

    python load_bench.py OUT_DIR SECONDS WARMUP_S CONCURRENCY ROUNDS MAX_REQUESTS

Run with the vLLM 0.32.0 environment's interpreter: the release where stock vLLM serves the valid part of the mix
(checked: every valid request of :data:`MIX` answered 200 by stock there, with the same prompt as the hotfix's) and
where per-request ``mm_processor_kwargs`` need ``--trust-request-mm-kwargs``. Two throwaway overlays of that
environment (tests/support/venvs.py): A without the package, B with the wheel built from this tree. The checkpoint
is the bundled tiny one with MiniCPM-V 4.6's real processor geometry (benchmarks/request_inproc.py: patch 14,
``scale_resolution`` 448, ``max_slice_nums`` 9).

Each server answers two phases, one after the other, each ``WARMUP_S + SECONDS`` long (or ``MAX_REQUESTS``
requests), CONCURRENCY requests at a time (tests/support/load_mix.py):

1. ``valid``: the mix without refused requests -- fresh images of seven sizes with per-request kwargs stock
   survives on 0.32.0 (``max_slice_nums``, ``downsample_mode``), repeats of recent images (vLLM's processor cache),
   videos. The comparison: A and B get byte-identical requests.
2. ``full``: the same kinds plus requests the hotfix refuses with HTTP 400 before any pixel work. Stock gets them too;
   what it does with them is the finding. A server that dies (or stalls) here has already given its valid phase.

Per phase: every request's kind, status, send and answer time, prompt and completion tokens; every 0.5 s, with the
number of requests answered by then, the RSS (``VmRSS``) and CPU time (``/proc/PID/stat``) of the API server,
EngineCore (the API server's child) and the worker (EngineCore's child); engine deaths (``/health`` checked after
every answer >= 500 or none); and vLLM's ``MM cache hit rate`` log lines. A memory guard kills a server whose
process group grows more than :data:`GUARD_ABOVE_IDLE` above its idle RSS or when the machine's ``MemAvailable``
falls under :data:`GUARD_MIN_AVAILABLE` (on this shared machine a runaway stock server must not take other work
down); the guard's reason is reported.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from support import load_mix  # noqa: E402
from support.venvs import clean_env  # noqa: E402
from support.server import HEALTHY_WITHIN_S, Server  # noqa: E402
from serve_bench import stock_and_hotfix  # noqa: E402

MAX_TOKENS = 8
GUARD_ABOVE_IDLE = 8 * 2**30
GUARD_MIN_AVAILABLE = 3 * 2**30
#: The hotfix's one summary line of a process that patched something (vllm_minicpm_hotfix.record.summary_line).
PATCHED = re.compile(r"vllm-minicpm-hotfix: MiniCPM-V .*, pid \d+: patched [1-9]\d*/")
CACHE_HIT = re.compile(r"MM cache hit rate: ([\d.]+)%")

#: The seeded mix (tests/support/load_mix.py). Valid kwargs: only what stock 0.32.0 survives and builds the same
#: prompt for (checked one by one on both servers: 1024x768 with max_slice_nums 4 -> 349 prompt tokens,
#: 1920x1080 4x with 1 slice -> 289, 640x480 4x with 2 -> 841, ...); every combination here fits max_model_len 1024.
#: Refused: what the hotfix answers 400 naming the kwarg. Stock 0.32.0 answers the three type/geometry errors 500,
#: ``max_slice_nums: 0`` 200 (as if 1), and ``scale_resolution`` 13 or 4000 reach its engine (13: the placeholder
#: disagrees with the tensors; 4000: a 224x224 image upscaled to ~16 M pixels for the vision tower). 4000 rather than
#: the hostile run's 12000: one 12000 request grew stock's server by 6.8 GiB and did not finish in 120 s (seen), and
#: concurrent ones would exhaust a shared machine; 4000 is still over twice the most the hotfix allows here (1792).
MIX = load_mix.Mix(
    seed=20261202,
    sizes=((64, 64), (224, 224), (448, 448), (640, 480), (1024, 768), (1280, 720), (1920, 1080)),
    valid_kwargs=(None, None, {"max_slice_nums": 1}, {"max_slice_nums": 2}, {"max_slice_nums": 4},
                  {"max_slice_nums": 9}, {"downsample_mode": "16x"}, {"downsample_mode": "4x", "max_slice_nums": 1}),
    refused=(({"slice_mode": "false"}, "slice_mode"), ({"use_image_id": "no"}, "use_image_id"),
             ({"patch_size": 7}, "patch_size"), ({"max_slice_nums": 0}, "max_slice_nums"),
             ({"scale_resolution": 13}, "scale_resolution"), ({"scale_resolution": 4000}, "scale_resolution")),
    videos=((4, 64, 48), (8, 160, 120), (8, 320, 240)),
)


def serve_args(concurrency: int) -> list[str]:
    return ["--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--limit-mm-per-prompt", '{"image": 1, "video": 1}', "--max-num-seqs", str(concurrency),
            "--mamba-ssm-cache-dtype", "float32", "--no-enable-prefix-caching", "--trust-request-mm-kwargs",
            # a processor cache that fills during the warm-up (EngineCore grew by 10-20 MB per new item here, seen),
            # so that what RSS does after it is not the cache filling up to vLLM's default 4 GiB
            "--mm-processor-cache-gb", "0.2"]


def guard(idle: int):
    def check(group: int, available: int) -> str:
        if group - idle > GUARD_ABOVE_IDLE:
            return (f"the server's processes grew to {group / 2**30:.1f} GiB, {(group - idle) / 2**30:.1f} GiB above "
                    f"idle (limit {GUARD_ABOVE_IDLE / 2**30:.0f} GiB); killed")
        if available < GUARD_MIN_AVAILABLE:
            return (f"the machine's MemAvailable fell to {available / 2**30:.1f} GiB (server group "
                    f"{group / 2**30:.1f} GiB); killed")
        return ""
    return check


def as_json(rep: load_mix.Report, phase: str, log: str) -> dict:
    outcomes = [[o.req.index, o.req.kind, o.status, round(o.t0, 4), round(o.t1, 4), o.prompt_tokens,
                 o.completion_tokens, o.ok(rep.max_tokens),
                 (o.message[:200] if (o.req.kind == "refused" or not o.ok(rep.max_tokens)) else ""),
                 json.dumps(o.req.kwargs) if o.req.kwargs is not None else None]
                for o in rep.outcomes]
    samples = [[round(s.t, 3), s.done, *(s.rss.get(r, 0) for r in load_mix.ROLES),
                *(round(s.cpu.get(r, 0.0), 3) for r in load_mix.ROLES)] for s in rep.samples]
    return {"phase": phase, "label": rep.label, "seed": rep.mix_seed, "seconds": rep.seconds,
            "warmup_s": rep.warmup_s, "concurrency": rep.concurrency, "deaths": rep.deaths, "death": rep.death,
            "guard": rep.guard, "pids": rep.pids, "outcomes": outcomes, "samples": samples, "line": rep.line(),
            "cache_hit_rates": [float(x) for x in CACHE_HIT.findall(log)]}


def measure(python: Path, name: str, work: Path, ckpt: Path, seconds: float, warmup: float, concurrency: int,
            max_requests: int) -> dict:
    server = Server(python, clean_env(), work / f"{name}.log", cwd=work, args=serve_args(concurrency), model=ckpt)
    out: dict = {"phases": []}
    try:
        if not server.wait_healthy(HEALTHY_WITHIN_S):
            raise RuntimeError(f"{name} server exited:\n{server.log()[-4000:]}")
        out["started_s"] = time.monotonic() - server.started_at
        time.sleep(1)
        idle = load_mix.group_rss_bytes(server.proc.pid)
        out["idle_group_rss"] = idle
        for phase, mix in (("valid", MIX.without_refused()), ("full", MIX)):
            seen = len(server.log())
            rep = load_mix.run(server, mix, seconds=seconds, warmup_s=warmup, concurrency=concurrency,
                               max_requests=max_requests, max_tokens=MAX_TOKENS, label=f"{name} {phase}",
                               memory_guard=guard(idle),
                               progress=lambda m: print(f"[load bench] {m}", file=sys.stderr, flush=True))
            print(f"[load bench] {rep.line()}", file=sys.stderr, flush=True)
            out["phases"].append(as_json(rep, phase, server.log()[seen:]))
            if rep.deaths or rep.guard:
                break  # nothing left to ask this server
        out["patched"] = bool(PATCHED.search(server.log()))
        return out
    finally:
        server.stop()


def main(out_dir: str, seconds: float, warmup: float, concurrency: int, rounds: int, max_requests: int) -> dict:
    work = Path(out_dir)
    stock, hotfix, ckpt = stock_and_hotfix(work, "load bench")
    res: dict = {"A": [], "B": []}
    for i in range(rounds):
        for which in (("A", "B") if i % 2 == 0 else ("B", "A")):
            r = measure(stock if which == "A" else hotfix, f"{which}{i}", work, ckpt, seconds, warmup, concurrency,
                        max_requests)
            if r["patched"] is not (which == "B"):
                raise RuntimeError(f"server {which}: patched={r['patched']}, expected {which == 'B'}")
            res[which].append(r)
    return {"seconds": seconds, "warmup_s": warmup, "concurrency": concurrency, "rounds": rounds,
            "max_requests": max_requests, "max_tokens": MAX_TOKENS, "mix": {
                "seed": MIX.seed, "sizes": MIX.sizes, "valid_kwargs": MIX.valid_kwargs, "refused": MIX.refused,
                "videos": MIX.videos, "weights": MIX.weights, "repeat_window": MIX.repeat_window},
            "serve_args": serve_args(concurrency), **res}


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], float(a[1]), float(a[2]), int(a[3]), int(a[4]), int(a[5]))), flush=True)
