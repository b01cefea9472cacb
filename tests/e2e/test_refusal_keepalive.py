"""A refusal costs the client nothing but itself: real ``vllm serve`` of the tiny checkpoint with the hotfix
pip-installed, refused requests alternating with valid ones over ONE keep-alive connection
(:class:`support.server.OneConnection`: ``httpx``, a pool of one connection, no retries).

The refusals are the hotfix's two kinds: ``request_kwargs``'s (an image with ``mm_processor_kwargs:
{"max_slice_nums": 0}``) and ``placeholder_guard``'s (the request whose placeholders disagree with its tensors, found
as tests/e2e/test_engine_serve.py finds it, with ``mm_placeholders`` left out by the product's own switch, so that the
guard has one to refuse). Between them: valid text requests, and vLLM's own 400 for a body its request model rejects
(``max_tokens: "many"``: FastAPI's ``RequestValidationError``, which every release answers through its own handler)
as the control. Not ``max_tokens: -1``: 0.22.1 raises that as a ``VLLMValidationError`` it has no handler for, so
stock vLLM's own refusal there closes the connection too (measured: 5 of 5 with a traceback).

Pass: every refusal is a 400 in vLLM's own error shape (``{"error": {"message", "type": "BadRequestError", "code":
400}}``) whose message names the kwarg, the value and what is allowed (the guard's: the item and both counts); every
valid request 200; 0 transport errors; the whole run on 1 TCP connection; no traceback in the server's log over the
run. Without the hotfix's routing (``request_kwargs.route_refusals``, on vLLM's ``build_app``) 0.22-0.24 answer the
refusal through their catch-all ``Exception`` handler, which Starlette runs in its ``ServerErrorMiddleware`` and then
re-raises: ``Exception in ASGI application`` in the log and the connection closed under the client (measured with
this test: 6, 4 and 4 of the 30 requests failed with ``ReadError`` on 0.22.1, 0.23.0 and 0.24.0, 11 connections, 10
tracebacks).

Placed on 0.22.1, 0.23.0 and 0.24.0 (the releases whose app has no handler of their own for a plain ``ValueError``;
0.26+ register one): one server per release, every check on it.

:func:`test_refusal_answered_by_vllms_own_handler_in_its_real_app` shows the same on vLLM's real app without a server
(its ``build_app`` and Starlette's ``TestClient``, which re-raises what the app re-raises), stock and with the fix
applied, also on 0.28.0, where the app has its own ``ValueError`` handler and the fix adds nothing.
"""

from __future__ import annotations

import time

import pytest
from support.hotfix_log import patched_pids
from support.server import HEALTHY_WITHIN_S, OneConnection, chat_body, serving
from support.serving import KILL_SIZE, LEAVE_OUT, SERVE_ARGS, find_kill_request, guard_server_fixes, image
from support.venvs import clean_env

RELEASES = ("0.22.1", "0.23.0", "0.24.0")
pytestmark = pytest.mark.placed(*RELEASES)
#: Where the app-level test runs: the releases above and one whose app routes a ValueError itself.
APP_RELEASES = (*RELEASES, "0.28.0")

#: Rounds of (refused, valid) pairs per kind of refusal.
ROUNDS = 5
CHAT = "/v1/chat/completions"
#: What the server log must not show over the run: any traceback; uvicorn's line for an exception Starlette re-raised.
TRACEBACK = "Traceback (most recent call last)"
ASGI_ERROR = "Exception in ASGI application"
GUARD_PHRASE = "placeholder tokens in the prompt"


@pytest.fixture(scope="module")
def kill(m46):
    """The request placeholder_guard refuses on this server (its fixes: all but :data:`LEAVE_OUT`)."""
    return find_kill_request(m46, guard_server_fixes())


@pytest.fixture(scope="module")
def server(pip_env, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refusal-keepalive")
    env = clean_env(VLLM_MINICPM_HOTFIX_DISABLED_FIXES=",".join(LEAVE_OUT))
    with serving(pip_env, env, tmp, "hotfix", SERVE_ARGS) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\nhealthy after {time.monotonic() - srv.started_at:.0f} s")
        assert str(srv.proc.pid) in patched_pids(srv.log(), "request_kwargs"), srv.log()[-6000:]
        assert str(srv.proc.pid) in patched_pids(srv.log(), "placeholder_guard"), srv.log()[-6000:]
        yield srv


def text_body(server, **extra) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, **extra}


def message(payload) -> str:
    return payload.get("error", {}).get("message", "") if isinstance(payload, dict) else str(payload)


def test_refusals_keep_the_connection(server, kill, release):
    kill_kwargs, pads, rows = kill
    refused = {
        "request_kwargs": chat_body(server, image(64, 64), mm_processor_kwargs={"max_slice_nums": 0}),
        "placeholder_guard": chat_body(server, image(*KILL_SIZE), mm_processor_kwargs=kill_kwargs),
        "vLLM's own": text_body(server, max_tokens="many"),
    }
    conn = OneConnection(server)
    log_from = len(server.log())
    started = time.monotonic()
    sent: list[tuple[str, int | str]] = []
    try:
        for _ in range(ROUNDS):
            for kind, body in refused.items():
                sent.append((kind, conn.post(CHAT, body)))
                sent.append(("valid", conn.post(CHAT, text_body(server))))
    finally:
        conn.close()
    took = time.monotonic() - started
    log = server.log()[log_from:]
    tracebacks, reraised = log.count(TRACEBACK), log.count(ASGI_ERROR)
    errors = conn.errors()
    figures = (f"vLLM {release}: {len(sent)} requests over one keep-alive connection in {took:.0f} s: "
               f"{len(errors)} transport errors, {conn.connections} TCP connection(s), {tracebacks} tracebacks "
               f"in the log ({reraised} '{ASGI_ERROR}'); statuses {[s for _, s in sent]}")
    print("\n" + figures)
    assert not errors and conn.connections == 1 and not tracebacks and not reraised, f"{figures}\n{errors[:3]}\nlog:\n{log[-6000:]}"

    by_kind: dict[str, list] = {}
    for (kind, _), result in zip(sent, conn.results):
        by_kind.setdefault(kind, []).append(result)
    assert all(status == 200 for _, status, _ in by_kind["valid"]), by_kind["valid"]
    for kind in refused:
        for _, status, payload in by_kind[kind]:
            assert status == 400 and payload["error"]["code"] == 400, (kind, status, payload)
    for kind in ("request_kwargs", "placeholder_guard"):
        for _, _, payload in by_kind[kind]:
            # vLLM's own error response: the type its create_error_response gives a ValueError.
            assert payload["error"]["type"] == "BadRequestError", (kind, payload)
    for _, _, payload in by_kind["request_kwargs"]:
        text = message(payload)
        assert "mm_processor_kwargs.max_slice_nums" in text and "= 0" in text and "an integer from 1 to" in text, text
    for _, _, payload in by_kind["placeholder_guard"]:
        text = message(payload)
        assert GUARD_PHRASE in text and str(pads) in text and str(rows) in text, text
    assert not any("MiniCPM-V" in message(p) for _, _, p in by_kind["vLLM's own"]), by_kind["vLLM's own"]


def _app():
    """vLLM's API server app as ``vllm serve`` builds it (default arguments), with one more route that refuses."""
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm_minicpm_hotfix.fixes.request_kwargs import RequestKwargsError

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # pragma: no cover - older module layout
        from vllm.utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    app = api_server.build_app(args, ("generate",))
    app.state.args = args  # what vLLM's handlers read (init_app_state sets it in a server)

    @app.post("/refuse")
    async def refuse():
        raise RequestKwargsError("MiniCPM-V 4.6: mm_processor_kwargs.max_slice_nums = 0 is refused: it must be an "
                                 "integer from 1 to 9", kwarg="mm_processor_kwargs.max_slice_nums", value=0)

    return app


def _answer(app):
    """``(status, JSON)`` of a POST to the refusing route; what the app re-raises propagates (the ``TestClient``
    re-raises what Starlette's ServerErrorMiddleware re-raises after answering, as uvicorn logs it)."""
    from starlette.testclient import TestClient

    reply = TestClient(app, raise_server_exceptions=True).post("/refuse")  # no lifespan: no engine needed
    return reply.status_code, reply.json()


@pytest.mark.placed(*APP_RELEASES)
def test_refusal_answered_by_vllms_own_handler_in_its_real_app(m46, release):
    from vllm_minicpm_hotfix.fixes import request_kwargs
    from vllm_minicpm_hotfix.fixes._base import Refusal
    from support.hotfix import hotfix

    stock = _app()
    own = [k for k in stock.exception_handlers if isinstance(k, type) and k is not Exception and issubclass(Refusal, k)]
    if own:  # the release routes a ValueError itself: stock answers cleanly, the fix adds nothing
        assert _answer(stock)[0] == 400
    else:  # only the catch-all: answered, then re-raised (the traceback and the closed connection of a server)
        with pytest.raises(request_kwargs.RequestKwargsError):
            _answer(stock)
    with hotfix(m46, "auto", fixes=("request_kwargs",)) as status:
        assert status.applied, status
        app = _app()  # built through the fix's wrapper of build_app
    added = Refusal in app.exception_handlers
    assert added == (not own), (release, own, list(app.exception_handlers))
    if added:  # vLLM's own catch-all function, now run where Starlette does not re-raise
        assert app.exception_handlers[Refusal] is app.exception_handlers[Exception]
    status_code, payload = _answer(app)
    assert status_code == 400 and payload["error"]["type"] == "BadRequestError", payload
    assert "mm_processor_kwargs.max_slice_nums = 0" in payload["error"]["message"], payload
