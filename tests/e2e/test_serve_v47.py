"""MiniCPM-V 4.7 through real ``vllm serve``: the request stock vLLM's server dies on, and with the hotfix
pip-installed the requests stock vLLM kills answered ``200`` with transformers' own prompt.

First one stock ``vllm serve`` of the same checkpoint (the shared environment, no hotfix): the ``{"slice_mode":
false}`` request on 449x448 gets no 200 (a 500, or no answer), EngineCore dies with ``Attempted to assign N = N
multimodal tokens to M placeholders``, and ``/health`` and the next request fail. It is stopped before the hotfix's
server starts (one engine at a time).

One server of the tiny 4.7 checkpoint transformers writes (``scripts/make_tiny_checkpoint.py --member 4.7``: patch
14, ``scale_resolution`` 448), on 0.32.0 (the release of the run where vLLM has 4.7 and an engine starts on CPU;
0.33.0's environment is the CUDA wheel). Requests go through the OpenAI chat API with ``return_token_ids``; the
reference is ``AutoProcessor`` (``MiniCPMV4_7Processor``) of the same folder on the prompt text the checkpoint's chat
template renders, with the same image and kwargs:

* ``{"slice_mode": false}`` on 449x448: stock vLLM's engine dies on it (``Attempted to assign N = N multimodal tokens
  to M placeholders``: tests/prompt/test_prompt_engine.py's stock 4.7 engine);
* ``{"scale_resolution": 224}`` on 448x448: stock served it with 64 placeholders for 80 embeddings (surplus dropped);
* ``{"use_image_id": false}``: stock keeps ``<image_id>0</image_id>``;
* then a plain request, and ``/health``: the server is alive.

Placed on 0.32.0 only (0.33.0 has 4.7 but its environment is the CUDA wheel: no engine on CPU): two servers.
"""

from __future__ import annotations

import json
import re
import sys
import time

import pytest
from support.hotfix_log import summaries

from support.venvs import clean_env
from support.server import HEALTHY_WITHIN_S, chat_body, healthy, post, serving
from support.serving import SERVE_ARGS
from support.prompt import image, write_v47

RELEASES = ("0.32.0",)
pytestmark = pytest.mark.placed(*RELEASES)

#: name -> ((width, height), mm_processor_kwargs)
REQUESTS = {
    "slice_mode false": ((449, 448), {"slice_mode": False}),
    "scale_resolution 224": ((448, 448), {"scale_resolution": 224}),
    "use_image_id false": ((300, 200), {"use_image_id": False}),
    "plain": ((640, 480), {}),
}


@pytest.fixture(scope="module")
def v47(tmp_path_factory):
    return write_v47(tmp_path_factory.mktemp("serve47") / "ckpt")


#: vLLM's error when a prompt's placeholders and the item's embeddings disagree (the engine dies on it).
DEATH = re.compile(r"Attempted to assign (\d+) = \1 multimodal tokens to (\d+) placeholders")


def test_v47_stock_server_dies_on_the_request_the_hotfix_answers(v47, tmp_path):
    """Stock ``vllm serve`` (before the hotfix's server of :func:`server` starts: pytest runs this module's tests in
    order)."""
    (w, h), kwargs = REQUESTS["slice_mode false"]
    with serving(sys.executable, clean_env(PYTHONPATH=""), tmp_path, "stock47", SERVE_ARGS, model=v47) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\nstock 4.7 server healthy after {time.monotonic() - srv.started_at:.0f} s")
        assert "vllm-minicpm-hotfix:" not in srv.log()
        status, reply = post(srv, "/v1/chat/completions", chat_body(srv, image(w, h), mm_processor_kwargs=kwargs))
        deadline = time.monotonic() + 20
        while healthy(srv, timeout=5) and time.monotonic() < deadline:  # EngineCore's death reaches /health
            time.sleep(1)
        alive = healthy(srv, timeout=5)
        after, _ = post(srv, "/v1/chat/completions", chat_body(srv, image(*REQUESTS["plain"][0])), timeout=60)
        log = srv.log()
    print(f"stock {kwargs}: HTTP {status} {json.dumps(reply)[:300]}; /health {alive}; next request HTTP {after}")
    assert status in (500, 0), (status, reply)
    assert not alive and after != 200, log[-6000:]
    assert DEATH.search(log), log[-6000:]


@pytest.fixture(scope="module")
def server(pip_env, v47, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve47-run")
    with serving(pip_env, clean_env(PYTHONPATH=""), tmp, "hotfix47", SERVE_ARGS, model=v47) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\n4.7 server healthy after {time.monotonic() - srv.started_at:.0f} s")
        yield srv


def transformers_ids(checkpoint, img, kwargs: dict, text: str) -> list[int]:
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(str(checkpoint))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = hf.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf(text=[prompt], images=[img], **kwargs)["input_ids"][0].tolist()


@pytest.mark.parametrize("name", list(REQUESTS))
def test_v47_request_answered_with_transformers_prompt(server, v47, name):
    (w, h), kwargs = REQUESTS[name]
    img = image(w, h)
    body = chat_body(server, img, mm_processor_kwargs=kwargs or None)
    body["return_token_ids"] = True
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 200, f"HTTP {status}: {json.dumps(reply)[:2000]}\nlog tail:\n{server.log()[-6000:]}"
    text = body["messages"][0]["content"][1]["text"]
    assert reply["prompt_token_ids"] == transformers_ids(v47, img, kwargs, text)
    assert healthy(server)
    print(f"\n4.7 {name}: HTTP 200, {reply['usage']}")


def test_v47_log_names_the_model(server):
    log = server.log()
    lines = summaries(log)
    assert lines and all(s["models"] == ["MiniCPM-V 4.6", "MiniCPM-V 4.7"] for s in lines), log[-4000:]
    # vLLM registers 4.7 itself here: the backport registers nothing, and every process's line says so
    assert all(s["backports"] == {"MiniCPM-V 4.7": "vLLM's own"} for s in lines), [s["line"] for s in lines]
    assert any("mm_placeholders" in s["applied"] for s in lines), [s["line"] for s in lines]
