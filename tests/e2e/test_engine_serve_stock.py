"""Stock vLLM dies on the request the hotfix refuses (tests/e2e/test_engine_serve.py): one stock ``vllm serve`` of the
tiny checkpoint, on the release of the run where stock vLLM starts here at all (0.32.0; 0.22-0.30 stop at start-up on
the q/k/v load or the ``downsample_mode`` TypeError). The request whose placeholder disagrees with its tensors on
stock vLLM (``{"slice_mode": false}`` on 0.32, found and measured with vLLM's real processor and model in this process)
kills EngineCore with ``Attempted to assign N = N multimodal tokens to M placeholders``; the next request fails."""

from __future__ import annotations

import sys
import time

import pytest

from support.venvs import clean_env
from support.server import HEALTHY_WITHIN_S, chat, chat_kwargs, healthy, outcome, serving
from support.serving import KILL_SIZE, SERVE_ARGS, find_kill_request, image

#: Where stock vLLM starts here (deselected elsewhere).
RELEASES = ("0.32.0",)
pytestmark = pytest.mark.placed(*RELEASES)


def test_stock_server_dies_on_the_same_request(m46, tmp_path):
    mm_kwargs, pads, rows = find_kill_request(m46, ())
    with serving(sys.executable, clean_env(PYTHONPATH=""), tmp_path, "stock", SERVE_ARGS) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        assert "vllm-minicpm-hotfix:" not in srv.log()
        status = outcome(lambda: chat(srv, **chat_kwargs(srv, image(*KILL_SIZE), mm_processor_kwargs=mm_kwargs)))
        print(f"\nstock {mm_kwargs}: {status}")
        time.sleep(2)
        status2 = outcome(lambda: chat(srv, **chat_kwargs(srv, image(64, 64))))
        alive = healthy(srv)
        print(f"next request: {status2}; /health: {alive}")
        log = srv.log()
    assert status != 200 and status2 != 200 and not alive
    assert f"Attempted to assign {rows} = {rows} multimodal tokens to {pads} placeholders" in log, log[-6000:]
