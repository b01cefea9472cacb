"""The hotfix's own numbers on vLLM's ``/metrics``: how many requests each fix refused, and why.

A refusal is a fix's :class:`~vllm_minicpm_hotfix.fixes._base.Refusal` (an HTTP 400 with its message); the framework
counts each one once, in the process that refuses it (vLLM's API server for a request's kwargs, its placeholders, a
LoRA adapter's load), as the Prometheus counter :data:`COUNTER` with the labels ``fix`` (the fix's ``NAME``) and
``cause`` (a short fixed word per kind of refusal, never the request's own values: the labels stay few). vLLM's
``/metrics`` serves the ``prometheus_client`` default registry, or with ``PROMETHEUS_MULTIPROC_DIR`` (several API
server processes) the files every process writes, so the counter appears there without anything else to set up.
The counter is created at the first refusal (``prometheus_client`` is imported then, never at start-up); a process
that refuses nothing exports nothing. Counting never raises.
"""

from __future__ import annotations

import threading

#: The counter's name as ``/metrics`` shows it (``prometheus_client`` adds ``_total`` to a counter's name): the
#: number of requests a fix refused, by ``fix`` and ``cause``.
COUNTER = "vllm_minicpm_hotfix_refused_requests_total"
HELP = ("Requests the MiniCPM-V hotfix refused with HTTP 400 before any heavy work, by fix and cause "
        "(vllm-minicpm-hotfix)")

_LOCK = threading.Lock()
_counter = None
#: (fix, cause) -> refusals in this process (also without prometheus_client).
COUNTS: dict[tuple[str, str], int] = {}


def refused(fix: str, cause: str) -> None:
    """Count one refusal by ``fix`` for ``cause`` (in :data:`COUNTS` and the Prometheus counter). Never raises."""
    global _counter
    try:
        with _LOCK:
            COUNTS[(fix, cause)] = COUNTS.get((fix, cause), 0) + 1
            if _counter is None:
                from prometheus_client import Counter

                _counter = Counter(COUNTER[: -len("_total")], HELP, labelnames=("fix", "cause"))
        _counter.labels(fix=fix, cause=cause).inc()
    except Exception:  # noqa: BLE001 - a metric must never change what the request gets
        pass
