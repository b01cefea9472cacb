"""No request can kill the engine: real ``vllm serve`` of the tiny checkpoint on 127.0.0.1, one server per release
with the hotfix pip-installed (the ``pip_env`` session overlay), serving every check of the release:

* the guard (``placeholder_guard``) answers a request whose placeholder count disagrees with its tensors ``400``,
  naming the item and both counts -- checked against the prompt's pads and the rows of vLLM's real vision tower
  computed here -- twice (the second time through the processor cache's path), and the same server then answers a
  normal image request ``200``. With every fix applied no such request is known any more (``mm_placeholders`` builds
  the placeholder transformers builds for the tensors vLLM computes: tests/prompt/test_prompt_engine.py shows those requests
  answered by a real engine), so this server runs with ``mm_placeholders`` *left out* by the product's own switch,
  ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` (:data:`LEAVE_OUT`; every process of the server reads it, and every
  summary line says ``left out``): the stock-killing request of the notes (``{"max_slice_nums": 1}`` on 0.22-0.31, ``{"slice_mode":
  false}`` on 0.32, found by running vLLM's real processor and model in this process with the same fixes) then
  reaches the guard, the last line of defence against a mismatch no fix foresaw;
* two concurrent requests with different ``downsample_mode`` are both answered and each equals its own solo answer
  (greedy, text and tokens). They are made to share one scheduler step -- so one encoder batch -- with vLLM's own
  ``/pause?mode=keep`` / ``/resume`` (``VLLM_SERVER_DEV_MODE=1``): queued while paused, scheduled together on resume;
  the solo answers are asked afterwards with an equivalent kwarg (``max_slice_nums`` at its default) so they get
  their own cache keys and are encoded again, alone;
* the fixes are logged where they act: the guard in the API server, the encoder fix in the process that loads the
  weights;
* on 0.28.0 (:data:`CACHE_RELEASES`), refusals leave vLLM's processor cache as it was: the cache cases of the hostile
  run (tests/support/hostile_cases.py), sent to this server.

How stock vLLM fails on the same requests: ``tests/engine/test_engine_fixes.py`` shows it on every release through vLLM's
processor, model and ``_merge_multimodal_embeddings`` (the call that kills EngineCore); on 0.32.0, where stock vLLM
starts at all here (0.22-0.30 need the load fixes first), ``tests/e2e/test_engine_serve_stock.py`` runs one stock
server: the engine dies on the request and the next request fails.

Placed on one release per family (``RELEASES``; deselected elsewhere): one server per release, every check on it.
That 0.23.0 starts (it cannot stock) is shown by tests/prompt/test_prompt_engine.py's engine there, not by a
fifth server here.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from support.hotfix_log import patched_pids, summaries
from support.venvs import clean_env
from support.server import HEALTHY_WITHIN_S, chat, chat_kwargs, dev_post, healthy, serving
from support.serving import find_kill_request, guard_server_fixes
from support.serving import SERVE_ARGS, SERVER_EXTRA_ENV, WEIGHTS_LOADED, LEAVE_OUT, KILL_SIZE, image

#: release -> family (notes: A = 0.22.x-0.23.0, B = 0.24.0, C = 0.25-0.31, D = 0.32-0.33): one release per family.
RELEASES = {"0.22.1": "A", "0.24.0": "B", "0.28.0": "C", "0.32.0": "D"}
pytestmark = pytest.mark.placed(*RELEASES)
#: Where stock vLLM starts here, so one stock server can show the engine dying.
STOCK_SERVER_RELEASES = ("0.32.0",)

# --------------------------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(release) -> str:
    return RELEASES[release]



@pytest.fixture(scope="module")
def kill(m46):
    """The engine-killing request on this release with the fixes the guard server applies, as it applies them."""
    return find_kill_request(m46, guard_server_fixes())


@pytest.fixture(scope="module")
def server(pip_env, tmp_path_factory):
    """The hotfix pip-installed (armed by its ``.pth``), :data:`LEAVE_OUT` left out, healthy."""
    tmp = tmp_path_factory.mktemp("engine-serve")
    env = clean_env(VLLM_MINICPM_HOTFIX_DISABLED_FIXES=",".join(LEAVE_OUT), **SERVER_EXTRA_ENV)
    with serving(pip_env, env, tmp, "hotfix", SERVE_ARGS) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\nhealthy after {time.monotonic() - srv.started_at:.0f} s")
        yield srv


def ok(server, kwargs: dict, timeout: float = 180):
    """The request answered 200 (the ``openai`` client's ``ChatCompletion``) with exactly ``max_tokens`` tokens."""
    try:
        reply = chat(server, timeout=timeout, **kwargs)
    except openai.APIError as exc:
        raise AssertionError(f"{exc!r}: {getattr(exc, 'body', None)}\nlog tail:\n{server.log()[-6000:]}") from exc
    assert reply.usage.completion_tokens == kwargs["max_tokens"]
    return reply


def answer(reply) -> tuple[str, list[str] | None]:
    choice = reply.choices[0]
    tokens = None
    if choice.logprobs and choice.logprobs.content:
        tokens = [t.token for t in choice.logprobs.content]
    return choice.message.content, tokens


# --------------------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------------------


def test_starts_and_answers_an_image_request(server, release):
    """The release starts with the hotfix (0.22-0.30 cannot stock) and answers an image request."""
    reply = ok(server, chat_kwargs(server, image(64, 64)))
    assert reply.usage.prompt_tokens > 10
    print(f"\nvLLM {release}: {reply.usage} {answer(reply)[0]!r}")


def test_engine_killing_request_is_refused_and_the_server_keeps_serving(server, kill):
    mm_kwargs, pads, rows = kill
    kwargs = chat_kwargs(server, image(*KILL_SIZE), mm_processor_kwargs=mm_kwargs)
    for attempt in ("first", "again (processor cache)"):
        with pytest.raises(openai.BadRequestError) as refused:
            chat(server, **kwargs)
        message = json.dumps(refused.value.body)
        print(f"\n{mm_kwargs} {attempt}: HTTP {refused.value.status_code}: {message[:600]}")
        assert refused.value.status_code == 400, message
        assert f"image item 0 of this request has {pads} <|image_pad|> placeholder tokens" in message
        assert f"give {rows} vision embeddings" in message
    assert healthy(server)
    reply = ok(server, chat_kwargs(server, image(*KILL_SIZE)))
    print(f"normal request after it: {reply.usage}")
    assert healthy(server)


def test_concurrent_modes_each_equal_to_its_own_solo_answer(server):
    img = image(*KILL_SIZE)
    modes = {"16x": {"downsample_mode": "16x"}, "4x": {"downsample_mode": "4x"}}
    replies: dict[str, object] = {}  # name -> ChatCompletion, or the openai.APIError the request got

    def ask(name: str, kwargs: dict) -> None:
        try:
            replies[name] = chat(server, timeout=300, logprobs=True, top_logprobs=1,
                                 **chat_kwargs(server, img, mm_processor_kwargs=kwargs))
        except openai.APIError as exc:
            replies[name] = exc

    assert dev_post(server, "/pause", mode="keep") == 200
    threads = [threading.Thread(target=ask, args=(n, k)) for n, k in modes.items()]
    try:
        for t in threads:
            t.start()
        time.sleep(5)  # both requests processed by the API server and queued in the paused scheduler
        assert not replies, f"answered while paused: {replies}"
    finally:
        assert dev_post(server, "/resume") == 200
        for t in threads:
            t.join(300)
    together = {}
    for name, reply in replies.items():
        assert not isinstance(reply, openai.APIError), (
            f"{name}: {reply!r}: {getattr(reply, 'body', None)}\nlog:\n{server.log()[-6000:]}")
        together[name] = (reply.usage.prompt_tokens, answer(reply))
    assert healthy(server)

    solo = {}
    for name, kwargs in modes.items():
        request = chat_kwargs(server, img, mm_processor_kwargs={**kwargs, "max_slice_nums": 9})  # same output, own key
        reply = ok(server, {**request, "logprobs": True, "top_logprobs": 1})
        solo[name] = (reply.usage.prompt_tokens, answer(reply))
    print(f"\ntogether: {together}\nsolo:     {solo}")
    assert together["4x"][0] - together["16x"][0] == 60  # 80 vs 20 image pads: each request's own mode
    assert together == solo


def test_fixes_logged_where_they_act(server, release, environment):
    """The guard is patched in the API server (where requests are processed), the encoder fix in the process that
    loaded the weights (where the encoder runs) -- where this release needs it."""
    from support import expected as table

    log = server.log()
    lines = summaries(log)
    assert lines, log[-6000:]
    for name in LEAVE_OUT:  # left out as the module docstring says, in every process that logged its line
        assert all(name not in s["applied"] and name in s["left_out"] for s in lines), (name, [s["line"] for s in lines])
    guard = {int(p) for p in patched_pids(log, "placeholder_guard")}
    assert server.proc.pid in guard, f"guard patched in {guard}, API server is {server.proc.pid}"
    ((_, loader),) = {(n, int(p)) for n, p in WEIGHTS_LOADED.findall(log)}
    encoder = {int(p) for p in patched_pids(log, "encoder_modes")}
    assert (loader in encoder) is (table.verdict("encoder_modes", environment) == "broken"), (loader, encoder)


#: Where this server also shows that refusals leave vLLM's processor cache as it was (0.22.1 and 0.32.0: the same
#: cases in tests/e2e/test_hostile.py's run; 0.28.0 has no hostile server of its own, its session being the longest).
CACHE_RELEASES = ("0.28.0",)


@pytest.mark.placed(*CACHE_RELEASES)
def test_refusals_leave_the_processor_cache(server):
    """The cache cases of tests/support/hostile_cases.py, sent as the hostile run sends them (tests/support/hostile_driver.py):

    * the hotfix's refusal of a request for an image the processor cache already holds (``scale_resolution: 13``)
      leaves the cache as it was: the same image, valid next, is answered 200;
    * vLLM's own refusal *after* processing (``max_tokens: 0``) is a 4xx; the next request with the same image fails
      once with vLLM's ``P0/P1 cache drift`` (a 500; docs/what-can-go-wrong.md: vLLM's generic request path, out of
      a probe-gated fix's reach; 0.28 has vLLM's drift recovery), and the one after it is answered 200."""
    from support import hostile_cases
    from support import hostile_driver

    cases = {c.name: c for c in hostile_cases.FIXED_CASES if c.kind == "cache"}

    def send(name: str) -> hostile_driver.Outcome:
        statuses, messages = hostile_driver.send(server, cases[name])
        out = hostile_driver.Outcome(cases[name], statuses, messages, healthy(server))
        print(f"\n{name}: {statuses} {messages[0][:300]!r}")
        return out

    for name in ("an image to cache", "bad kwarg on a cached image", "same image after the bad kwarg"):
        o = send(name)
        assert o.ok and o.alive, (name, o.statuses, o.messages, server.log()[-6000:])

    mark = len(server.log())
    refused = send("max_tokens 0")
    assert [400 <= s < 500 for s in refused.statuses] == [True], (refused.statuses, refused.messages)
    after = send("same image after max_tokens 0")
    drift = "P0/P1 cache drift" in server.log()[mark:]
    print(f"after max_tokens 0: {after.statuses}, vLLM's cache drift logged: {drift}")
    assert after.statuses == [500] and drift, (after.statuses, after.messages, server.log()[mark:][-6000:])
    again = send("same image after max_tokens 0")
    assert again.statuses == [200] and again.alive, (again.statuses, again.messages)
