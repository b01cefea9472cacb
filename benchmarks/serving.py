"""A serving engine: requests per second and time to first token of real ``vllm serve``, stock (A) against the
hotfix pip-installed (B), on the same default-kwarg image requests. Prints one JSON object (last line).

    python serve_bench.py OUT_DIR ROUNDS BATCHES REQUESTS [CONCURRENCY]

Run with the vLLM 0.32.0 environment's interpreter (where stock vLLM serves default requests). Two throwaway
overlays of that environment (tests/support/venvs.py): A without the package, B with the wheel built from this tree
(its ``.pth`` arms the hotfix in the API server, EngineCore and worker). The checkpoint is the bundled tiny one with
the real processor geometry (benchmarks/request_inproc.py), served as tests/e2e/test_engine_serve.py serves it
(``--max-num-seqs`` = CONCURRENCY). One server at a time: ``ROUNDS`` rounds, the order alternating (AB, BA, ...);
each server answers 2 warm-up requests, then ``BATCHES`` batches of ``REQUESTS`` chat completions (one distinct
image each, 1024x768, no ``mm_processor_kwargs``, 8 tokens, streamed) sent CONCURRENCY at a time through the OpenAI
client. Per batch: seconds per request (wall of the batch / REQUESTS: 1 / throughput), median time to first token,
and the CPU time the server's whole process group (API server, EngineCore, worker: ``/proc/PID/stat``) spent on
the batch, per request, also split by process (``api`` = the group's leader, ``engine`` = the process it spawned,
``worker`` = EngineCore's, ``other`` = multiprocessing's resource trackers). Batch j of A's round i is paired with batch j of B's.

Like for like: A and B send byte-identical requests (the same images, seeds and fields), and every request reports
its usage (``stream_options.include_usage``); the run fails unless every request generated ``MAX_TOKENS`` tokens,
and ``same_prompts`` says whether every server built the same prompt length for each request (where stock builds
another prompt, A and B do different work and the comparison is information only).

The split shows where a difference sits: the hotfix acts per request only in the API server (vLLM's multimodal
processor); EngineCore and the worker run the model as stock does. Their CPU is not idle-free: vLLM's shared-memory
queue polls with ``sched_yield`` while it waits, so a batch that takes longer in wall time (a busier machine) also
books more CPU there.
"""

import re
import concurrent.futures
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path[:0] = [str(HERE), str(REPO / "tests")]

from support.venvs import build_wheel, clean_env, overlay_env, pip_install  # noqa: E402
from support.server import HEALTHY_WITHIN_S, Server, png_data_url  # noqa: E402
from request_inproc import real_geometry  # noqa: E402

IMAGE = (1024, 768)
MAX_TOKENS = 8
#: The hotfix's one summary line of a process that patched something (vllm_minicpm_hotfix.record.summary_line).
PATCHED = re.compile(r"vllm-minicpm-hotfix: MiniCPM-V .*, pid \d+: patched [1-9]\d*/")


def serve_args(concurrency: int) -> list[str]:
    return ["--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--limit-mm-per-prompt", '{"image": 1, "video": 0}', "--max-num-seqs", str(concurrency),
            "--mamba-ssm-cache-dtype", "float32", "--no-enable-prefix-caching"]


def images(n: int, seed: int) -> list[str]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = IMAGE
    return [png_data_url(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for _ in range(n)]


ROLES = ("api", "engine", "worker", "other")


def _role(pid: int, ppid: int, pgid: int) -> str:
    """The role of a process of a ``vllm serve`` group: the leader is the API server; EngineCore and the worker by
    the title vLLM gives them (``VLLM::EngineCore``, ``VLLM::Worker...`` in ``/proc/PID/cmdline``), before that by
    descent (EngineCore is the leader's spawned child, the worker EngineCore's); multiprocessing's resource trackers
    (and a process that vanished) are ``other``."""
    if pid == pgid:
        return "api"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "other"
    if b"VLLM::EngineCore" in cmdline:
        return "engine"
    if b"VLLM::Worker" in cmdline:
        return "worker"
    if b"spawn_main" not in cmdline:
        return "other"
    return "engine" if ppid == pgid else "worker"


def group_cpu_by_role(pgid: int) -> dict[str, float]:
    """User + system CPU seconds of every live process in process group ``pgid``, summed per :data:`ROLES`."""
    tick = os.sysconf("SC_CLK_TCK")
    totals = dict.fromkeys(ROLES, 0)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state ppid pgrp ...; utime stime at 11, 12
            totals[_role(int(d.name), int(fields[1]), pgid)] += int(fields[11]) + int(fields[12])
    return {k: v / tick for k, v in totals.items()}


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    return sum(group_cpu_by_role(pgid).values())


def one(client, model: str, url: str) -> tuple[float, int | None, int | None]:
    """One streamed chat completion of the image at ``url``: ``(time to first token in s, prompt tokens, completion
    tokens)`` (the usage vLLM reports in the stream's last chunk; None where it sent none)."""
    t0 = time.perf_counter()
    ttft = None
    usage = None
    stream = client.chat.completions.create(
        model=model, max_tokens=MAX_TOKENS, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                {"type": "text", "text": "What is in the image?"}]}])
    for chunk in stream:
        if ttft is None and chunk.choices and (chunk.choices[0].delta.content or "") != "":
            ttft = time.perf_counter() - t0
        if getattr(chunk, "usage", None) is not None:
            usage = chunk.usage
    ttft = ttft if ttft is not None else time.perf_counter() - t0
    if usage is None:
        return ttft, None, None
    return ttft, usage.prompt_tokens, usage.completion_tokens


def measure(python: Path, name: str, work: Path, ckpt: Path, batches: list[list[str]], concurrency: int) -> dict:
    from openai import OpenAI

    server = Server(python, clean_env(), work / f"{name}.log", cwd=work, args=serve_args(concurrency), model=ckpt)
    try:
        if not server.wait_healthy(HEALTHY_WITHIN_S):
            raise RuntimeError(f"{name} server exited:\n{server.log()[-4000:]}")
        started = time.monotonic() - server.started_at
        client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
        for url in images(2, seed=1):
            one(client, server.model, url)
        out = {"started_s": started, "s_per_request": [], "ttft_s": [], "cpu_per_request_s": [],
               "cpu_per_request_by_role_s": {k: [] for k in ROLES}, "prompt_tokens": [], "load": []}
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for batch in batches:
                c0, t0 = group_cpu_by_role(server.proc.pid), time.perf_counter()
                answers = list(pool.map(lambda u: one(client, server.model, u), batch))
                wall, c1 = time.perf_counter() - t0, group_cpu_by_role(server.proc.pid)
                bad = [a for a in answers if a[2] != MAX_TOKENS]
                if bad:
                    raise RuntimeError(f"{name}: {len(bad)} requests did not generate {MAX_TOKENS} tokens: {bad[:3]}")
                out["s_per_request"].append(wall / len(batch))
                out["ttft_s"].append(statistics.median(a[0] for a in answers))
                out["cpu_per_request_s"].append(sum(c1[k] - c0[k] for k in ROLES) / len(batch))
                for k in ROLES:
                    out["cpu_per_request_by_role_s"][k].append((c1[k] - c0[k]) / len(batch))
                out["prompt_tokens"].append([a[1] for a in answers])
                out["load"].append(os.getloadavg()[0])
        out["patched"] = bool(PATCHED.search(server.log()))
        return out
    finally:
        server.stop()


def stock_and_hotfix(work: Path, label: str) -> tuple[Path, Path, Path]:
    """The two sides of a serving benchmark under ``work``: a stock overlay of this interpreter's vLLM, the same with
    the wheel pip-installed (the ``.pth`` route), and the real-geometry tiny checkpoint. Returns the stock and hotfix
    interpreters and the checkpoint folder."""
    t0 = time.perf_counter()
    wheel = build_wheel(work / "wheel")
    stock = overlay_env(work / "stock", wrapt=True)
    hotfix = overlay_env(work / "hotfix", wrapt=True)
    pip_install(hotfix, str(wheel))
    ckpt = real_geometry(REPO, work / "ckpt")
    print(f"[{label}] environments ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return stock, hotfix, ckpt


def main(out_dir: str, rounds: int, n_batches: int, n_requests: int, concurrency: int = 4) -> dict:
    work = Path(out_dir)
    stock, hotfix, ckpt = stock_and_hotfix(work, "serve bench")
    batches = [images(n_requests, seed=100 + j) for j in range(n_batches)]
    res = {"A": [], "B": []}
    for i in range(rounds):
        for which in (("A", "B") if i % 2 == 0 else ("B", "A")):
            py = stock if which == "A" else hotfix
            r = measure(py, f"{which}{i}", work, ckpt, batches, concurrency)
            if r["patched"] is not (which == "B"):
                raise RuntimeError(f"server {which}: patched={r['patched']}, expected {which == 'B'}")
            res[which].append(r)
            print(f"[serve bench] round {i + 1}/{rounds} {which}: {r['s_per_request']} s/request",
                  file=sys.stderr, flush=True)
    prompts = [r["prompt_tokens"] for which in ("A", "B") for r in res[which]]
    same = all(p == prompts[0] for p in prompts) and all(None not in b for b in prompts[0])
    return {"rounds": rounds, "batches": n_batches, "requests": n_requests, "concurrency": concurrency,
            "same_prompts": same, **res}


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], int(args[1]), int(args[2]), int(args[3]), *(int(a) for a in args[4:5]))),
          flush=True)
