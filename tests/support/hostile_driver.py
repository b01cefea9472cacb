"""The driver of the hostile-request run (tests/e2e/test_hostile.py): sends each case of :mod:`hostile_cases` to a
running ``vllm serve`` on 127.0.0.1, checks the server is alive after each, and samples the API server's resident
memory throughout.

Bounded: every request has a timeout (:data:`REQUEST_TIMEOUT_S`), the run stops at :data:`RUN_BUDGET_S` or at the
first engine death when asked to. Requests go through ``urllib`` (tests/support/server.py's ``post``), one server at a
time, never anything but 127.0.0.1.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from support.server import Server, png_data_url, post
from support.hostile_cases import Case, broken_media, make_image
from benchmarks.load_mix import HEALTH_WAIT_S, engine_alive, rss_bytes  # noqa: F401 - one copy, shared with the load mix

REQUEST_TIMEOUT_S = 120
RUN_BUDGET_S = 900
#: A known-good request is sent after every this many cases (and at the end): is the engine still answering?
ALIVE_EVERY = 6
RSS_PERIOD_S = 0.1
class RssSampler:
    """Samples ``rss_bytes(pid)`` every :data:`RSS_PERIOD_S` in a thread; ``peak`` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(RSS_PERIOD_S)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def body(server: Server, case: Case) -> dict:
    """The OpenAI chat completion of ``case``: its images as PNG data URLs, greedy, 2 tokens unless it says."""
    if case.media:
        content = [{"type": "image_url", "image_url": {"url": broken_media(case.media)}}]
    else:
        content = [{"type": "image_url", "image_url": {"url": png_data_url(make_image(w, h, mode, seed=i))}}
                   for i, (w, h, mode) in enumerate(case.images)]
    content.append({"type": "text", "text": "What is in the image?"})
    out = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
           "temperature": 0}
    if case.kwargs is not None:
        out["mm_processor_kwargs"] = case.kwargs
    out.update(case.extra)
    return out


GOOD = Case("known-good", "alive", "200", None, images=((64, 64, "RGB"),))


@dataclasses.dataclass
class Outcome:
    case: Case
    statuses: list[int]
    messages: list[str]
    alive: bool
    #: What the liveness checks after the case saw (``/health``'s answer, the known-good request's status).
    health: str = ""

    @property
    def ok(self) -> bool:
        """Whether the answers are what a robust server gives (see :mod:`hostile_cases`)."""
        if any(s == 0 or s >= 500 for s in self.statuses):
            return False
        if self.case.expect == "200":
            return all(s == 200 for s in self.statuses)
        if self.case.expect == "400":
            return all(400 <= s < 500 and self.case.cause in m for s, m in zip(self.statuses, self.messages))
        return True


@dataclasses.dataclass
class Report:
    label: str
    outcomes: list[Outcome]
    deaths: int
    idle_rss: int
    peak_rss: int
    seconds: float

    def count(self, lo: int, hi: int) -> int:
        return sum(1 for o in self.outcomes for s in o.statuses if lo <= s < hi)

    @property
    def server_errors(self) -> int:
        """Answers >= 500 or none at all."""
        return sum(1 for o in self.outcomes for s in o.statuses if s == 0 or s >= 500)

    def line(self) -> str:
        return (f"{self.label}: cases {len(self.outcomes)}, requests {sum(len(o.statuses) for o in self.outcomes)}, "
                f"2xx {self.count(200, 300)}, 4xx {self.count(400, 500)}, 5xx or no answer {self.server_errors}, "
                f"engine deaths {self.deaths}, peak RSS above idle {(self.peak_rss - self.idle_rss) / 2**20:.0f} MiB "
                f"(idle {self.idle_rss / 2**30:.2f} GiB), {self.seconds:.0f} s")


def _message(reply: dict) -> str:
    err = reply.get("error")
    if isinstance(err, dict):
        return str(err.get("message", ""))
    return json.dumps(reply)[:2000]


def send(server: Server, case: Case) -> tuple[list[int], list[str]]:
    payload = body(server, case)
    if case.concurrent == 1:
        results = [post(server, "/v1/chat/completions", payload, timeout=REQUEST_TIMEOUT_S)]
    else:
        with ThreadPoolExecutor(case.concurrent) as pool:
            results = list(pool.map(lambda _: post(server, "/v1/chat/completions", payload,
                                                   timeout=REQUEST_TIMEOUT_S), range(case.concurrent)))
    return [s for s, _ in results], [_message(r) for _, r in results]


def run(server: Server, label: str, cases: list[Case], *, stop_on_death: bool = False) -> Report:
    """Send every case (then a known-good request every :data:`ALIVE_EVERY` cases), sampling the API server's RSS.
    An engine death is a case after which ``/health`` fails or the known-good request is not answered 200."""
    start = time.monotonic()
    status, reply = post(server, "/v1/chat/completions", body(server, GOOD), timeout=REQUEST_TIMEOUT_S)
    assert status == 200, f"the server does not answer a known-good request: {status} {reply}"
    time.sleep(1)
    idle = rss_bytes(server.proc.pid)
    outcomes: list[Outcome] = []
    deaths = 0
    with RssSampler(server.proc.pid) as rss:
        for i, case in enumerate(cases):
            if time.monotonic() - start > RUN_BUDGET_S:
                break
            statuses, messages = send(server, case)
            alive, health = engine_alive(server)
            if alive and ((i + 1) % ALIVE_EVERY == 0 or i + 1 == len(cases)):
                good = post(server, "/v1/chat/completions", body(server, GOOD), timeout=REQUEST_TIMEOUT_S)[0]
                alive, health = good == 200, f"{health}; known-good request {good}"
            outcomes.append(Outcome(case, statuses, messages, alive, health))
            if not alive:
                deaths += 1
                if stop_on_death:
                    break
                if not engine_alive(server)[0]:
                    break  # nothing left to ask
    return Report(label, outcomes, deaths, idle, max(rss.peak, idle), time.monotonic() - start)
