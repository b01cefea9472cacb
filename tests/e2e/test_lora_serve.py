"""LoRA through real ``vllm serve --enable-lora`` on a release whose stock model class refuses it (``lora_support``).

vLLM 0.23.0 (stock ``lora_support`` verdict ``broken``, tests/support/expected.py). Stock ``vllm serve`` of the tiny 4.6
checkpoint does not get as far as LoRA there: its API server dies building transformers' processor (``AttributeError:
'MiniCPMV4_6ImageProcessor' object has no attribute 'version'``, the ``hf_processor_version`` fix; see
tests/prompt/test_prompt_engine.py). So the refusal is shown with every fix applied but ``lora_support`` (left out by
``VLLM_MINICPM_HOTFIX_DISABLED_FIXES``): ``vllm serve --enable-lora`` stops at start-up with ``ValueError:
MiniCPMV4_6ForConditionalGeneration does not support LoRA yet.`` (vLLM's ``LoRAModelRunnerMixin.load_lora_model``,
in EngineCore after the weights loaded). With the whole hotfix pip-installed the same server starts with
``--lora-modules tiny=<adapter>``, and the OpenAI client's greedy chat completion with ``model="tiny"`` gives exactly
the tokens of the independent reference: transformers' own model with the adapter applied by peft
(tests/support/lora_adapter.py, run in a fresh interpreter with peft from tests/support/peft_site.py), on the prompt ids of
transformers' processor (asserted equal to the ids the server rendered). The same request with the base model's
name on the same server gives other tokens: the adapter is what changed them.

The same server runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``POST /v1/load_lora_adapter`` of a peft adapter
of the vision tower (tests/support/lora_tower_adapter.py), which vLLM would load and silently ignore (tests/
test_lora_tower.py shows it with vLLM's own LoRA manager on every environment), is refused with
HTTP 400 and ``lora_tower``'s error naming the adapter, the tower modules and the model, in the API server
before the engine (vLLM's API server turns every engine-side error of an adapter load into HTTP 500: measured with
only the worker's check in place), and the language-model adapter still answers with the reference's tokens
afterwards.

The adapter is written by peft (``LoraConfig`` + ``get_peft_model`` + ``save_pretrained``) for the language model's
full-attention projections and MLPs, ``lora_B`` seeded nonzero; tests/support/lora_adapter.py says how the seed is chosen.

Placed on 0.23.0 only (a short session; 0.22.1 and 0.24.0 refuse the same way, tests/fixes/test_lora_support.py shows
vLLM's LoRA start-up on every environment): one server without ``lora_support`` that stops at start-up while the
reference is computed, one hotfix server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support.paths import REPO, TINY
from support.hotfix_log import patched_pids, summaries

from support.venvs import clean_env
from support.peft_site import peft_site
from support.server import FAILS_WITHIN_S, HEALTHY_WITHIN_S, Server, healthy, post, serving
from support.serving import SERVE_ARGS
from vllm_minicpm_hotfix.fixes import lora_support

RELEASES = ("0.23.0",)
pytestmark = pytest.mark.placed(*RELEASES)

PROMPT = "Describe a cat."
MAX_TOKENS = 6
RANK = 8  # tests/support/lora_adapter.py RANK
LORA_ARGS = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "1"]
REFUSAL = "ValueError: MiniCPMV4_6ForConditionalGeneration does not support LoRA yet."


@pytest.fixture(scope="module")
def prepared(pip_env, tmp_path_factory):
    """The refusal and the reference, side by side: ``vllm serve --enable-lora`` without ``lora_support`` starts while
    tests/support/lora_adapter.py writes the adapter and computes transformers + peft's greedy tokens. Returns
    ``{"reference": JSON, "adapters": dir, "without_exit": code, "without_log": text}``."""
    tmp = tmp_path_factory.mktemp("lora-serve")
    site = peft_site()
    started = time.monotonic()
    env = clean_env(VLLM_MINICPM_HOTFIX_DISABLED_FIXES=lora_support.NAME)
    without = Server(pip_env, env, tmp / "without.log", cwd=tmp, args=SERVE_ARGS + LORA_ARGS)
    try:
        proc = subprocess.run(
            [sys.executable, str(REPO / "tests" / "support" / "lora_adapter.py"), str(TINY), str(tmp / "adapters"), PROMPT,
             str(MAX_TOKENS)],
            env=clean_env(PYTHONPATH=str(site)), cwd=tmp, capture_output=True, text=True, timeout=600, check=False,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        reference = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"\nreference (transformers + peft) after {time.monotonic() - started:.0f} s: {reference}")
        tower = subprocess.run(
            [sys.executable, str(REPO / "tests" / "support" / "lora_tower_adapter.py"), str(TINY), str(tmp / "adapters" / "tower")],
            env=clean_env(PYTHONPATH=str(site)), cwd=tmp, capture_output=True, text=True, timeout=600, check=False,
        )
        assert tower.returncode == 0, tower.stdout[-3000:] + tower.stderr[-5000:]
        code = without.wait_exit(FAILS_WITHIN_S)
        print(f"server without lora_support exited {code} after {time.monotonic() - without.started_at:.0f} s")
        return {"reference": reference, "adapters": tmp / "adapters", "without_exit": code, "without_log": without.log()}
    finally:
        without.stop()


@pytest.fixture(scope="module")
def server(pip_env, prepared, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-serve-run")
    adapters = prepared["adapters"]
    args = SERVE_ARGS + LORA_ARGS + ["--lora-modules", f"tiny={adapters / 'lm'}"]
    with serving(pip_env, clean_env(PYTHONPATH="", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True"), tmp, "lora", args) as srv:
        assert srv.wait_healthy(HEALTHY_WITHIN_S), srv.log()[-6000:]
        print(f"\nLoRA server healthy after {time.monotonic() - srv.started_at:.0f} s")
        yield srv


def greedy(server, model: str) -> dict:
    """One greedy text chat completion (the OpenAI chat API, ``return_token_ids``): the reply JSON."""
    body = {"model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    status, reply = post(server, "/v1/chat/completions", body)
    assert status == 200, f"{model}: HTTP {status}: {json.dumps(reply)[:2000]}\nlog tail:\n{server.log()[-6000:]}"
    return reply


def test_refused_at_start_up_without_lora_support(prepared):
    assert prepared["without_exit"] != 0
    log = prepared["without_log"]
    assert summaries(log) and not patched_pids(log, lora_support.NAME), log[-6000:]
    assert REFUSAL in log, log[-6000:]


def test_lora_tokens_equal_transformers_with_peft(server, prepared):
    ref = prepared["reference"]
    assert ref["lora"] != ref["base"]
    lora = greedy(server, "tiny")
    base = greedy(server, server.model)
    assert lora["prompt_token_ids"] == ref["prompt_ids"]
    assert base["prompt_token_ids"] == ref["prompt_ids"]
    got, without = lora["choices"][0]["token_ids"], base["choices"][0]["token_ids"]
    print(f"\nwith the adapter {got} (transformers + peft {ref['lora']}, margins {ref['lora_margin']}); "
          f"base model {without}")
    assert got == ref["lora"]
    assert without != got
    assert healthy(server)
    assert patched_pids(server.log(), lora_support.NAME), server.log()[-6000:]


def test_tower_adapter_loaded_at_run_time_is_refused_and_the_lm_adapter_still_answers(server, prepared):
    tower = prepared["adapters"] / "tower"
    status, reply = post(server, "/v1/load_lora_adapter", {"lora_name": "tower", "lora_path": str(tower)})
    message = json.dumps(reply)
    print(f"\nload_lora_adapter tower: HTTP {status}: {message[:1500]}")
    assert status == 400, message
    assert f"LoRA adapter 'tower' ({tower}) has weights for 12 module(s) of the MiniCPM-V 4.6 vision tower" in message
    assert "vpm.encoder.layers.0.mlp.fc1" in message and "language model of MiniCPM-V 4.6 only" in message
    assert healthy(server)
    assert greedy(server, "tiny")["choices"][0]["token_ids"] == prepared["reference"]["lora"]
    status, reply = post(server, "/v1/chat/completions", {
        "model": "tower", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})
    assert status == 404, reply  # never registered: vLLM's own "model does not exist"
