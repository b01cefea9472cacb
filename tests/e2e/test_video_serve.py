"""A ``video_url`` chat request through real ``vllm serve`` with default flags (no ``--media-io-kwargs``): the
``video_loader`` fix, end to end, on the two releases the notes name (0.24.0, family B; 0.28.0, family C -- 0.26.0
and 0.30.0 share 0.28.0's code and verdict).

The video is an mp4 written here by OpenCV (tests/fixes/test_video_loader.py's ``write_video``; OpenCV is the library of
vLLM's default video loader), sent as a base64 data URL. Two servers, one after the other, the hotfix pip-installed
in both (stock vLLM does not start on these releases with transformers 5.24: tests/support/expected.py):

* ``video_loader`` left out (``tests/programs/leave_out_site``; every other fix applied): the request fails with
  ``TypeError: unhashable type: 'dict'`` (HTTP 400), stock vLLM's failure; the same request with the operator's
  workaround (the request's own ``media_io_kwargs`` naming ``video_backend``, which skips the failing look-up) is
  answered -- the reference answer, computed without the fix's code path;
* the whole hotfix: the default request is answered ``200`` with the reference answer (greedy tokens and prompt
  token count), and the API server's summary line names the fix, where the request is parsed.

On 0.28.0 the hotfix server also shows tests/e2e/test_serve.py's pip-installed route (``test_pip_installed_serves_images``:
an image chat answered, the q/k/v patch logged by the process that loaded the weights), so that release's run starts
one server fewer.
"""

from __future__ import annotations

import json
import time

import pytest
from support.hotfix_log import patched_pids, summaries
from support.video import WORKAROUND, data_url, write_video

from support.venvs import LEAVE_OUT_SITE, clean_env
from support.server import HEALTHY_WITHIN_S, post, serving
from support.serving import SERVE_ARGS as SHARED_SERVE_ARGS
from support.serving import assert_patched_where_weights_loaded, chat_with_image, with_limits
from vllm_minicpm_hotfix.fixes import video_loader

pytestmark = pytest.mark.placed("0.24.0", "0.28.0")

#: The shared serve arguments (tests/support/serving.py), with one image and one video per prompt.
SERVE_ARGS = with_limits(SHARED_SERVE_ARGS, image=1, video=1)
MAX_TOKENS = 6


def video_body(server, url: str, media_io_kwargs: dict | None = None) -> dict:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "What happens in the video?"},
        ]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
    }
    if media_io_kwargs is not None:
        body["media_io_kwargs"] = media_io_kwargs
    return body


def answered(server, body: dict) -> tuple[int, list[str]]:
    """``(prompt tokens, greedy tokens)`` of a request that must be answered 200."""
    status, reply = post(server, "/v1/chat/completions", body, timeout=300)
    assert status == 200, f"HTTP {status}: {json.dumps(reply)[:2000]}\nlog tail:\n{server.log()[-6000:]}"
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    return reply["usage"]["prompt_tokens"], [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    return data_url(write_video(tmp_path_factory.mktemp("video") / "clip.mp4"))


#: The reference answer the left-out server gave (``test_without_the_fix_...``), for the hotfix server's test.
REFERENCE: dict[str, tuple[int, list[str]]] = {}


def test_without_the_fix_default_flags_fail_with_the_type_error(pip_env, tmp_path, url):
    env = clean_env(PYTHONPATH=str(LEAVE_OUT_SITE), VLLM_MINICPM_HOTFIX_TEST_LEAVE_OUT=video_loader.NAME)
    with serving(pip_env, env, tmp_path, "left-out", SERVE_ARGS) as server:
        assert server.wait_healthy(HEALTHY_WITHIN_S), server.log()[-6000:]
        print(f"\nhealthy after {time.monotonic() - server.started_at:.0f} s")
        status, reply = post(server, "/v1/chat/completions", video_body(server, url), timeout=300)
        message = json.dumps(reply)
        print(f"default flags: HTTP {status}: {message[:400]}")
        assert status == 400, message
        assert "unhashable type: 'dict'" in message, message
        REFERENCE["workaround"] = answered(server, video_body(server, url, WORKAROUND))
        print(f"with the workaround: {REFERENCE['workaround']}")
        log = server.log()
        assert summaries(log) and not patched_pids(log, video_loader.NAME), log[-6000:]


@pytest.fixture(scope="module")
def hotfix_server(pip_env, tmp_path_factory):
    """The whole hotfix pip-installed (armed by its ``.pth``, no PYTHONPATH), healthy."""
    with serving(pip_env, clean_env(), tmp_path_factory.mktemp("video-hotfix"), "hotfix", SERVE_ARGS) as server:
        assert server.wait_healthy(HEALTHY_WITHIN_S), server.log()[-6000:]
        print(f"\nhealthy after {time.monotonic() - server.started_at:.0f} s")
        yield server


def test_with_the_hotfix_default_flags_are_answered_as_with_the_workaround(hotfix_server, url):
    server = hotfix_server
    default = answered(server, video_body(server, url))
    workaround = answered(server, video_body(server, url, WORKAROUND))
    print(f"default flags: {default}\nwith the workaround: {workaround}\nleft-out server's: {REFERENCE}")
    assert default == workaround
    if "workaround" in REFERENCE:  # the other server, the same weights, greedy: the same answer
        assert default == REFERENCE["workaround"]
    patched = {int(p) for p in patched_pids(server.log(), video_loader.NAME)}
    assert server.proc.pid in patched, f"{video_loader.NAME} patched in {patched}, API server {server.proc.pid}"


@pytest.mark.placed("0.28.0")  # tests/e2e/test_serve.py's release (its routes' other servers run there)
def test_pip_installed_serves_images(hotfix_server):
    """The wheel pip-installed serves an image chat (8 greedy tokens, the image's placeholders in the prompt), and the
    q/k/v patch is logged by the process that loaded the weights -- vLLM's worker, not the API server."""
    reply = chat_with_image(hotfix_server)
    evidence = assert_patched_where_weights_loaded(hotfix_server)
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 20  # the image's placeholder tokens are in the prompt
    print(f"reply {reply.choices[0].message.content!r}; {evidence}")
