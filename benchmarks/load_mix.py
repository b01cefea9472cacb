"""A seeded, sustained, mixed load against a running ``vllm serve`` on 127.0.0.1, and what it measured: shared by the
suite's short run (tests/e2e/test_video_serve.py, ``test_sustained_mixed_load``, as ``benchmarks.load_mix``) and the
benchmark (benchmarks/serving.py, sections 6 and 7). It imports nothing from tests/ or from benchmarks/.

The mix (:class:`Mix`) is a function of its seed and the request's index only (:meth:`Mix.request`), so two servers
sent the same mix get byte-identical requests in the same order, whatever their speed. Each request is one of:

* ``image``: a fresh image (its own bytes: a cache miss) of one of :attr:`Mix.sizes`, with one of
  :attr:`Mix.valid_kwargs` as its ``mm_processor_kwargs`` (``None``: none sent); must be answered 200 with
  ``max_tokens`` tokens;
* ``repeat``: an earlier ``image`` request of the last :attr:`Mix.repeat_window` indices again, the same bytes and
  kwargs (vLLM's processor cache holds it: the same item hash); answered 200;
* ``video``: a fresh mp4 (OpenCV, ``mp4v``) of one of :attr:`Mix.videos` (frames, width, height); answered 200;
* ``refused``: an image with one of :attr:`Mix.refused` (kwargs, cause): a client's mistake the hotfix refuses before
  any pixel work; must be answered 400 with a message naming ``cause``.

:func:`run` sends the mix ``concurrency`` requests at a time through the OpenAI client (every request with a timeout;
the run bounded in time and in count), samples the resident memory (``VmRSS``) and CPU time of the API server,
EngineCore and the worker, checks ``/health`` after every answer >= 500 or none (a dead engine ends the run), and
returns a :class:`Report`. Nothing here imports vLLM. :func:`engine_alive` and :func:`rss_bytes` serve the hostile run
(tests/support/hostile_driver.py) as well.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import math
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KINDS = ("image", "repeat", "video", "refused")
ROLES = ("api", "engine", "worker")
MIB = 2**20
#: How long a ``/health`` that does not answer at all is waited for while the server process still runs: on the
#: 2-core CI machine a busy API server once took over 10 s to answer (the CI run of 2026-12-01, 0.22.1).
HEALTH_WAIT_S = 60


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    kind: str  #: one of KINDS
    size: tuple[int, int] | None = None  #: an image's (width, height)
    video: tuple[int, int, int] | None = None  #: a video's (frames, width, height)
    seed: int = 0  #: the pixels' seed (a repeat has its original's)
    kwargs: dict | None = None  #: mm_processor_kwargs (None: none sent)
    cause: str = ""  #: refused: what the 400's message must name
    of: int | None = None  #: repeat: the index of the request it repeats

    @property
    def expect(self) -> int:
        return 400 if self.kind == "refused" else 200

    def describe(self) -> str:
        what = (f"image {self.size[0]}x{self.size[1]}" if self.size else
                f"video {self.video[0]} frames {self.video[1]}x{self.video[2]}")
        rep = f" (repeat of #{self.of})" if self.of is not None else ""
        return f"#{self.index} {self.kind}: {what}{rep}, mm_processor_kwargs {self.kwargs}"


@dataclasses.dataclass(frozen=True)
class Mix:
    """The seeded mix: what each index is (:meth:`request`)."""

    seed: int
    sizes: tuple[tuple[int, int], ...]
    valid_kwargs: tuple[dict | None, ...]
    refused: tuple[tuple[dict, str], ...]
    videos: tuple[tuple[int, int, int], ...]
    #: kind -> relative weight (a kind of weight 0 never occurs)
    weights: tuple[tuple[str, float], ...] = (("image", 0.5), ("repeat", 0.15), ("video", 0.15), ("refused", 0.2))
    repeat_window: int = 8

    def without_refused(self) -> Mix:
        """The same mix with no refused requests (the valid part), under another seed (its own sequence)."""
        return dataclasses.replace(self, seed=self.seed + 1,
                                   weights=tuple((k, 0.0 if k == "refused" else w) for k, w in self.weights))

    @property
    def has_refused(self) -> bool:
        return dict(self.weights).get("refused", 0) > 0

    def _rng(self, index: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + index)

    def _kind(self, index: int) -> str:
        kinds, weights = zip(*self.weights)
        return self._rng(index).choices(kinds, weights)[0]

    def request(self, index: int) -> Request:
        rng = self._rng(index)
        kinds, weights = zip(*self.weights)
        kind = rng.choices(kinds, weights)[0]
        pixels = self.seed * 1_000_003 + index
        if kind == "repeat":
            for j in range(index - 1, max(-1, index - 1 - self.repeat_window), -1):
                if self._kind(j) == "image":
                    orig = self.request(j)
                    return dataclasses.replace(orig, index=index, kind="repeat", of=j)
            kind = "image"  # nothing to repeat yet
        if kind == "video":
            return Request(index, "video", video=rng.choice(self.videos), seed=pixels,
                           kwargs=None)
        size = rng.choice(self.sizes)
        if kind == "refused":
            kwargs, cause = rng.choice(self.refused)
            return Request(index, "refused", size=size, seed=pixels, kwargs=dict(kwargs), cause=cause)
        kwargs = rng.choice(self.valid_kwargs)
        return Request(index, "image", size=size, seed=pixels, kwargs=None if kwargs is None else dict(kwargs))


# --------------------------------------------------------------------------------------------------------------------
# The requests' bytes
# --------------------------------------------------------------------------------------------------------------------


def _field(width: int, height: int, rng) -> Any:
    """A smooth ``height x width x 3`` uint8 picture from a coarse seeded grid (compresses like a photo, cheap to
    encode), distinct for every seed."""
    import numpy as np
    from PIL import Image

    coarse = rng.integers(0, 256, (max(2, height // 24), max(2, width // 24), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))


def image_url(width: int, height: int, seed: int) -> str:
    """A JPEG (quality 90) of a seeded picture as a ``data:image/jpeg;base64`` URL: the same bytes for the same
    arguments."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_field(width, height, np.random.default_rng(seed))).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def video_url(frames: int, width: int, height: int, seed: int, fps: int = 4) -> str:
    """An mp4 (OpenCV ``VideoWriter``, ``mp4v``) of ``frames`` seeded pictures as a ``data:video/mp4;base64`` URL."""
    import cv2
    import numpy as np

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="load-mix-") as d:
        path = Path(d) / "clip.mp4"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
        assert writer.isOpened(), f"OpenCV cannot write {path}"
        for _ in range(frames):
            writer.write(_field(width, height, rng))
        writer.release()
        data = path.read_bytes()
    assert data, "OpenCV wrote an empty video"
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def chat_kwargs(model: str, req: Request, max_tokens: int) -> dict:
    """Arguments of ``client.chat.completions.create`` for ``req``: greedy, exactly ``max_tokens`` tokens, vLLM's
    own fields (``ignore_eos``, ``mm_processor_kwargs``) in ``extra_body``."""
    if req.video is not None:
        part = {"type": "video_url", "video_url": {"url": video_url(*req.video, seed=req.seed)}}
    else:
        part = {"type": "image_url", "image_url": {"url": image_url(*req.size, seed=req.seed)}}
    extra: dict = {"ignore_eos": True}
    if req.kwargs is not None:
        extra["mm_processor_kwargs"] = req.kwargs
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "extra_body": extra,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]}


# --------------------------------------------------------------------------------------------------------------------
# The server's processes
# --------------------------------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """``(ppid, pgid)`` of ``pid`` from ``/proc/PID/stat``, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def server_processes(api_pid: int) -> dict[str, int]:
    """The pids of a ``vllm serve`` started as its own process group leader ``api_pid``: ``api`` (the leader),
    ``engine`` (EngineCore: the leader's child titled ``VLLM::EngineCore``, else its spawned child) and ``worker``
    (EngineCore's child titled ``VLLM::Worker...``, else its spawned child); multiprocessing's resource trackers are
    neither. A role not found (yet) is absent."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and st[1] == api_pid:
                children.setdefault(st[0], []).append(int(d.name))
    out = {"api": api_pid}

    def pick(parent: int, title: bytes) -> int | None:
        kids = children.get(parent, [])
        titled = [p for p in kids if title in _cmdline(p)]
        spawned = [p for p in kids if b"spawn_main" in _cmdline(p) and b"resource_tracker" not in _cmdline(p)]
        found = titled or spawned
        return found[0] if found else None

    engine = pick(api_pid, b"VLLM::EngineCore")
    if engine is not None:
        out["engine"] = engine
        worker = pick(engine, b"VLLM::Worker")
        if worker is not None:
            out["worker"] = worker
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (``/proc/PID/stat``), 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_rss_bytes(pgid: int) -> int:
    """The sum of ``VmRSS`` over every live process of process group ``pgid``."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and st[1] == pgid:
                total += rss_bytes(int(d.name))
    return total


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    req: Request
    status: int  #: HTTP status; 0: no answer (timeout, connection refused or reset)
    t0: float  #: seconds from the run's start when the request was sent (its bytes were built before)
    t1: float
    message: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def latency(self) -> float:
        return self.t1 - self.t0

    def ok(self, max_tokens: int) -> bool:
        """What a robust server answers: 200 with ``max_tokens`` tokens for a valid request, 400 naming the cause
        for a refused one."""
        if self.req.kind == "refused":
            return self.status == 400 and self.req.cause in self.message
        return self.status == 200 and self.completion_tokens == max_tokens


@dataclasses.dataclass
class Sample:
    t: float  #: seconds from the run's start
    done: int  #: requests answered (any status) by then
    rss: dict[str, int]  #: role -> VmRSS bytes
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)  #: role -> user + system CPU seconds so far


@dataclasses.dataclass
class Report:
    label: str
    mix_seed: int
    concurrency: int
    warmup_s: float
    max_tokens: int
    outcomes: list[Outcome]
    samples: list[Sample]
    seconds: float  #: the whole run, warm-up included
    deaths: int = 0
    death: str = ""  #: what the liveness check saw, and after which request
    guard: str = ""  #: set when the memory guard stopped the server
    pids: dict[str, int] = dataclasses.field(default_factory=dict)

    # ---- selections --------------------------------------------------------------------------------------------
    def measured(self) -> list[Outcome]:
        """The outcomes of requests sent after the warm-up."""
        return [o for o in self.outcomes if o.t0 >= self.warmup_s]

    def problems(self) -> list[Outcome]:
        """Every outcome (warm-up included) that is not what a robust server answers."""
        return [o for o in self.outcomes if not o.ok(self.max_tokens)]

    def server_errors(self) -> list[Outcome]:
        """Answers >= 500, or none."""
        return [o for o in self.outcomes if o.status >= 500 or o.status == 0]

    def count(self, kind: str | None = None) -> int:
        return sum(1 for o in self.outcomes if kind is None or o.req.kind == kind)

    # ---- figures -----------------------------------------------------------------------------------------------
    def window(self) -> tuple[float, float]:
        """The measured window: from the warm-up's end to the last answer."""
        end = max((o.t1 for o in self.outcomes), default=self.warmup_s)
        return self.warmup_s, max(end, self.warmup_s)

    def throughput(self, kinds: Sequence[str] = KINDS) -> float:
        """Requests of ``kinds`` sent after the warm-up and answered, per second of the measured window."""
        lo, hi = self.window()
        n = sum(1 for o in self.measured() if o.req.kind in kinds)
        return n / (hi - lo) if hi > lo else float("nan")

    def windows_s_per_request(self, width_s: float) -> list[float]:
        """Wall per request (1 / throughput) in consecutive windows of ``width_s`` after the warm-up: each
        window's length over the requests answered in it (those that began after the warm-up)."""
        lo, hi = self.window()
        out = []
        t = lo
        while t + width_s <= hi + 1e-9:
            n = sum(1 for o in self.measured() if t <= o.t1 < t + width_s)
            if n:
                out.append(width_s / n)
            t += width_s
        return out

    def latencies(self, refused: bool) -> list[float]:
        return [o.latency for o in self.measured() if (o.req.kind == "refused") == refused]

    def rss_after_warmup(self, role: str) -> list[tuple[int, int]]:
        """``(requests answered, VmRSS bytes)`` of ``role`` at each sample after the warm-up."""
        return [(s.done, s.rss[role]) for s in self.samples if s.t >= self.warmup_s and s.rss.get(role)]

    def rss_slope(self, role: str) -> float:
        """Least-squares slope of ``role``'s RSS over the requests answered, after the warm-up: MiB per 1,000
        requests (nan with fewer than 3 samples or no requests answered in between)."""
        return slope([(d, r / MIB) for d, r in self.rss_after_warmup(role)]) * 1000

    def cpu_per_request(self, role: str) -> float:
        """CPU seconds ``role`` spent per request answered between the first and the last sample after the warm-up
        (nan without two such samples or requests in between)."""
        after = [x for x in self.samples if x.t >= self.warmup_s and x.cpu.get(role)]
        if len(after) < 2 or after[-1].done == after[0].done:
            return float("nan")
        return (after[-1].cpu[role] - after[0].cpu[role]) / (after[-1].done - after[0].done)

    def line(self) -> str:
        n = len(self.outcomes)
        by = ", ".join(f"{k} {self.count(k)}" for k in KINDS if self.count(k))
        statuses: dict[int, int] = {}
        for o in self.outcomes:
            statuses[o.status] = statuses.get(o.status, 0) + 1
        st = ", ".join(f"{s or 'no answer'}: {c}" for s, c in sorted(statuses.items()))
        rss = "; ".join(f"{r} {self.rss_slope(r):+.1f} MiB/1000 req" for r in ROLES if self.rss_after_warmup(r))
        cpu = ", ".join(f"{r} {self.cpu_per_request(r) * 1e3:.0f}" for r in ROLES if self.rss_after_warmup(r))
        return (f"{self.label}: {n} requests ({by}) in {self.seconds:.0f} s at concurrency {self.concurrency}, "
                f"{self.throughput():.2f} req/s after {self.warmup_s:.0f} s warm-up; answers {st}; "
                f"not as expected {len(self.problems())}; engine deaths {self.deaths}"
                f"{'; memory guard: ' + self.guard if self.guard else ''}; RSS slope {rss}; CPU ms per request "
                f"{cpu}")


def slope(points: Sequence[tuple[float, float]]) -> float:
    """Ordinary least-squares slope of ``y`` over ``x`` (nan with fewer than 3 points or no spread in ``x``)."""
    if len(points) < 3:
        return float("nan")
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in points) / sxx


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear interpolation between order statistics; nan if empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def engine_alive(server) -> tuple[bool, str]:
    """Whether ``server``'s engine is alive, and what ``/health`` said. vLLM answers ``/health`` with 500 once its
    engine is dead (``EngineDeadError``) and the process exits when the API server dies, so an answer other than 200,
    or an exited process, is a death at once; a health check that gets no answer while the process runs (a busy
    machine) is repeated for up to :data:`HEALTH_WAIT_S`, and is a death after that."""
    import httpx

    deadline = time.monotonic() + HEALTH_WAIT_S
    while True:
        try:
            status = httpx.get(f"{server.url}/health", timeout=10).status_code
            return status == 200, f"/health {status}"
        except httpx.HTTPError as exc:
            detail = f"/health no answer: {type(exc).__name__}: {exc}"
        if server.proc.poll() is not None:
            return False, f"{detail}; the server exited ({server.proc.returncode})"
        if time.monotonic() > deadline:
            return False, f"{detail} for {HEALTH_WAIT_S} s"
        time.sleep(2)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS`` of ``/proc/PID/status``), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def run(server, mix: Mix, *, seconds: float, warmup_s: float, concurrency: int, max_requests: int,
        max_tokens: int = 8, timeout_s: float = 120, rss_period_s: float = 0.5, label: str = "",
        memory_guard: Callable[[int, int], str] | None = None,
        progress: Callable[[str], None] | None = None) -> Report:
    """Send ``mix`` to ``server`` (healthy; anything with ``proc``, ``url``, ``model`` and ``api_key``: tests/support/server.py's ``Server``, benchmarks/serving.py's) ``concurrency`` at a time for ``warmup_s +
    seconds`` (or ``max_requests`` requests, whichever comes first), each request with a ``timeout_s`` timeout,
    sampling the RSS of the server's API server, EngineCore and worker every ``rss_period_s``.

    An answer >= 500 or none makes a worker check ``/health`` (:func:`engine_alive`); a dead engine
    or a vanished server counts one death and ends the run. ``memory_guard(group RSS bytes, MemAvailable bytes)``,
    if given, is asked at every sample: a non-empty reason kills the server's whole process group (SIGKILL; on a
    shared machine a runaway server must not take the others down) and ends the run."""
    start = time.monotonic()
    deadline = start + warmup_s + seconds
    lock = threading.Lock()
    state = {"next": 0, "done": 0}
    stop = threading.Event()
    report = Report(label, mix.seed, concurrency, warmup_s, max_tokens, [], [], 0.0)

    def sampler() -> None:
        pids: dict[str, int] = {}
        while not stop.is_set():
            if any(rss_bytes(p) == 0 for p in pids.values()) or len(pids) < len(ROLES):
                pids = server_processes(server.proc.pid)
                report.pids = dict(pids)
            rss = {r: rss_bytes(p) for r, p in pids.items()}
            cpu = {r: cpu_seconds(p) for r, p in pids.items()}
            with lock:
                done = state["done"]
            report.samples.append(Sample(time.monotonic() - start, done, rss, cpu))
            if memory_guard is not None and not report.guard:
                why = memory_guard(group_rss_bytes(server.proc.pid), mem_available_bytes())
                if why:
                    report.guard = why
                    with_suppress_kill(server.proc.pid)
                    stop.set()
            stop.wait(rss_period_s)

    def worker() -> None:
        import httpx
        import openai

        # A new connection for every request: vLLM 0.24 closes the connection after a 400 it answers through its
        # catch-all exception handler (Starlette re-raises it: "Exception in ASGI application"), and a client that
        # reuses it without retrying gets a connection error on its next request (seen: 11 of 697 requests).
        cl = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY", timeout=timeout_s,
                           max_retries=0, http_client=httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)))

        while not stop.is_set():
            with lock:
                i = state["next"]
                if i >= max_requests or time.monotonic() >= deadline:
                    return
                state["next"] = i + 1
            req = mix.request(i)
            kw = chat_kwargs(server.model, req, max_tokens)
            t0 = time.monotonic() - start
            out = Outcome(req, 0, t0, t0)
            try:
                reply = cl.chat.completions.create(**kw)
                out.status = 200
                if reply.usage is not None:
                    out.prompt_tokens, out.completion_tokens = reply.usage.prompt_tokens, reply.usage.completion_tokens
            except openai.APIStatusError as exc:
                out.status, out.message = exc.status_code, _message(exc)
            except openai.APIConnectionError as exc:  # includes APITimeoutError
                out.status, out.message = 0, f"{type(exc).__name__}: {exc}"
            out.t1 = time.monotonic() - start
            with lock:
                report.outcomes.append(out)
                state["done"] += 1
            if progress and (state["done"] % 100 == 0):
                progress(f"{label}: {state['done']} answered, {out.t1:.0f} s")
            if (out.status == 0 or out.status >= 500) and not stop.is_set():
                alive, health = engine_alive(server)
                if not alive:
                    with lock:
                        if not stop.is_set():
                            report.deaths += 1
                            report.death = (f"{health}; after {req.describe()} answered "
                                            f"{out.status or 'nothing'}: {out.message[:300]}")
                            stop.set()

    threads = [threading.Thread(target=sampler, daemon=True)]
    threads += [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(timeout=warmup_s + seconds + timeout_s + 120)
    stop.set()
    threads[0].join(timeout=10)
    report.seconds = time.monotonic() - start
    report.outcomes.sort(key=lambda o: o.req.index)
    if not report.deaths and not report.guard:
        alive, health = engine_alive(server)
        if not alive:
            report.deaths, report.death = 1, f"{health} at the end of the run"
    return report


def with_suppress_kill(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _message(exc) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        return str(body)
    return str(getattr(exc, "message", exc))
