"""Where vLLM stops a chat answer, as ``verify --model`` and ``doctor --model`` report it
(``vllm_minicpm_hotfix/cli/stop_tokens.py``), on tiny checkpoints whose files differ the way published ones do.

The references are the checkpoints' own files and a real engine, never the check's output:

* :data:`VARIANTS` says per checkpoint which token texts its files name -- the tokenizer's ``eos_token``
  (``tokenizer_config.json``), ``generation_config.json``'s ``eos_token_id`` (without that file, ``config.json``'s,
  which vLLM's ``try_get_generation_config`` falls back to) -- and so which ids (from ``tokenizer.json``) vLLM's rule
  gives: the tokenizer's eos plus the generation config's; and which token the chat template closes a turn with.
* :func:`test_engine_stops_where_the_check_says`: one ``LLM(...)`` engine on the checkpoint whose files leave
  ``<|im_end|>`` out. Each chat request is confined to one token id (``allowed_token_ids``): the engine stops after one
  token exactly on the ids the check names, runs on past ``<|im_end|>`` (stock vLLM: the hotfix does not touch stop
  tokens), and stops there once the request passes the ``stop_token_ids`` the WARN line gives.

Placement: the in-process checks and the CLI runs where the CLI is tested (``FULL_ENVS``, as tests/cli/test_cli.py);
the engine on 0.22.1 only (one engine start; 0.22.1 is the oldest release and one of the shortest jobs, and the vLLM
code that makes the stop ids -- ``SamplingParams.update_from_generation_config``, ``ModelConfig.try_get_generation_config``,
``check_stop`` -- does the same in 0.22.1-0.33.0).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from support import stop_checkpoints as sc
from support.paths import REPO, TINY
from support.placement import FULL_ENVS
from support.programs import run_program
from support.venvs import clean_env
from vllm_minicpm_hotfix.cli import stop_tokens

pytestmark = pytest.mark.placed(*FULL_ENVS)

EOT, EOS = "<|im_end|>", "<|endoftext|>"
#: A template that separates turns with blank lines: no special token ends an assistant's turn.
PLAIN_TEMPLATE = ("{%- for message in messages -%}{{- message['role'] + ': ' + message['content'] + '\\n\\n' -}}"
                  "{%- endfor -%}{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")

#: name -> (edits for support.stop_checkpoints.write (None: the bundled checkpoint itself), the token texts vLLM stops
#: on (tokenizer eos + generation config eos), the status the check must give, why).
VARIANTS = {
    "bundled": (None, {EOT}, "OK", "tokenizer eos <|im_end|>, generation_config.json eos_token_id <|im_end|>"),
    "generation endoftext": (dict(generation_eos=EOS), {EOS, EOT}, "OK",
                             "generation_config.json names only <|endoftext|>, but the tokenizer's eos is <|im_end|>"),
    "both endoftext": (dict(tokenizer_eos=EOS, generation_eos=EOS), {EOS}, "WARN",
                       "neither the tokenizer nor generation_config.json names <|im_end|>: the runaway case"),
    "generation list": (dict(tokenizer_eos=EOS, generation_eos=[EOS, EOT]), {EOS, EOT}, "OK",
                        "the WARN's server-side fix: <|im_end|> listed in generation_config.json"),
    "no generation_config": (dict(tokenizer_eos=EOS, generation_eos=sc.MISSING), {EOS, EOT}, "OK",
                             "vLLM falls back to config.json, whose eos_token_id is <|im_end|>"),
    "no chat template": (dict(tokenizer_eos=EOS, generation_eos=EOS, chat_template=sc.MISSING), {EOS}, "WARN",
                         "vLLM's own ChatML fallback for minicpmv4_6 still closes a turn with <|im_end|>"),
    "plain-text template": (dict(chat_template=PLAIN_TEMPLATE), {EOT}, "-",
                            "no special token closes a turn: cannot be told"),
    "no tokenizer": (dict(tokenizer=False), {EOT}, "-", "no tokenizer files: vLLM cannot load one, cannot be told"),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("stop-tokens")
    out = {}
    for name, (edits, *_rest) in VARIANTS.items():
        out[name] = TINY if edits is None else sc.write(root / name.replace(" ", "-"), **edits)
    return out


IDS = sc.token_ids(TINY)


def test_the_bundled_checkpoint_names_im_end_everywhere():
    """The bundled checkpoint (written by scripts/make_tiny_checkpoint.py) is itself right: its tokenizer's eos and its
    generation config's eos_token_id are both <|im_end|>, the token its ChatML template closes every turn with."""
    tok = json.loads((TINY / "tokenizer_config.json").read_text())
    gen = json.loads((TINY / "generation_config.json").read_text())
    assert tok["eos_token"] == EOT and gen["eos_token_id"] == IDS[EOT]
    assert "'<|im_end|>\\n'" in (TINY / "chat_template.jinja").read_text()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_stop_ids_are_what_the_files_give(written, name):
    """The ids the check says vLLM stops on are those the checkpoint's files name (tokenizer eos + generation config
    eos); the status follows from whether the template's end-of-turn token is among them, and a WARN gives the full
    list to pass."""
    _edits, texts, status, why = VARIANTS[name]
    rep = stop_tokens.report(written[name])
    want = sorted(IDS[t] for t in texts)
    assert rep["vllm"]["stop_ids"] == want, (why, rep)
    assert rep["status"] == status, (why, rep["detail"])
    if status == "WARN":
        fix = sorted({*want, IDS[EOT]})
        assert rep["stop_token_ids"] == fix
        assert rep["detail"].startswith(f"a chat answer can run past the end of its turn: the chat template ends it "
                                        f"with {EOT} ({IDS[EOT]}), but vLLM stops only on ["), rep["detail"]
        assert f'pass "stop_token_ids": {fix} with each request' in rep["detail"]
    elif status == "OK":
        assert rep["stop_token_ids"] is None and rep["turn_end"]["id"] == IDS[EOT]
        assert rep["detail"].endswith(f"the chat template ends the assistant's turn with {EOT} ({IDS[EOT]})")
    else:
        assert rep["detail"].startswith("cannot tell") and rep["stop_token_ids"] is None, rep["detail"]


def test_turn_end_is_the_token_after_the_answer():
    """transformers' own rendering of the bundled template closes the assistant's turn with <|im_end|>, and that is
    the end-of-turn token the check finds (with the tokenizer's template, as without vLLM's choice)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                   tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    assert stop_tokens.turn_end(TINY) == {"id": IDS[EOT], "token": EOT, "template": "the tokenizer's"}


def test_generation_config_flags(written):
    """The server-side fixes the docs give, on vLLM's own ``ModelConfig`` (what ``vllm serve`` builds from the flags):
    ``--generation-config DIR`` takes the stop ids from DIR's ``generation_config.json`` (here the one listing
    <|endoftext|> and <|im_end|>); ``--override-generation-config '{"eos_token_id": [...]}'`` leaves them as the
    checkpoint's files give them."""
    from vllm.config import ModelConfig

    folder = written["both endoftext"]
    both = sorted({IDS[EOS], IDS[EOT]})
    from_dir = ModelConfig(model=str(folder), generation_config=str(written["generation list"]))
    assert stop_tokens.vllm_stops(folder, from_dir)["stop_ids"] == both
    override = ModelConfig(model=str(folder), override_generation_config={"eos_token_id": both})
    assert stop_tokens.vllm_stops(folder, override)["stop_ids"] == [IDS[EOS]]


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", *args], cwd=REPO, env=clean_env(**env),
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    print(f"\n$ vllm-minicpm-hotfix {' '.join(args)} -> exit {proc.returncode} in {time.perf_counter() - t0:.1f} s\n"
          f"{proc.stdout}{proc.stderr[-2000:]}")
    return proc


def test_verify_warns_and_still_passes(written):
    """``verify --model`` on the checkpoint whose files leave <|im_end|> out, the hotfix active (the repository's
    sitecustomize on PYTHONPATH): the WARN line with the ids to pass, and exit 0 with PASS -- the weights load
    bit-exact; the stop ids are a request parameter, not a load failure."""
    proc = _cli("verify", "--model", str(written["both endoftext"]), PYTHONPATH=str(REPO))
    lines = proc.stdout.splitlines()
    warn = [ln for ln in lines if ln.startswith("  stop ids    ")]
    fix = sorted({IDS[EOS], IDS[EOT]})
    assert len(warn) == 1, proc.stdout
    assert warn[0].startswith("  stop ids    WARN a chat answer can run past the end of its turn: the chat template "
                              f"ends it with {EOT} ({IDS[EOT]}), but vLLM stops only on [{IDS[EOS]} {EOS}]"), warn[0]
    assert f'pass "stop_token_ids": {fix} with each request' in warn[0]
    assert proc.returncode == 0 and lines[-1].startswith("PASS: all 4 "), proc.stdout + proc.stderr[-3000:]


@pytest.mark.placed("0.28.0")
def test_doctor_model_adds_a_warn_row_and_keeps_its_verdict(written):
    """``doctor --model``'s model report (one fresh vLLM process, as doctor runs it) adds a ``stop tokens`` WARN row and
    the facts to the JSON report; the verdict stays what the fixes make it (a WARN row never fails doctor)."""
    from vllm_minicpm_hotfix.cli import doctor

    report = {"ok": True, "summary": "OK: unchanged", "checks": []}
    old = os.environ.pop("PYTHONPATH", None)
    try:
        doctor._add_model_report(report, str(written["both endoftext"]), 900)
    finally:
        if old is not None:
            os.environ["PYTHONPATH"] = old
    assert report["ok"] is True and report["summary"] == "OK: unchanged"
    assert [r["check"] for r in report["checks"]] == ["quantized checkpoint", "stop tokens"]
    row = report["checks"][1]
    assert row["status"] == "WARN" and f"ends it with {EOT} ({IDS[EOT]})" in row["detail"], row
    assert report["stop_tokens"]["stop_token_ids"] == sorted({IDS[EOS], IDS[EOT]})
    assert report["stop_tokens"]["vllm"]["stop_ids"] == [IDS[EOS]]


@pytest.mark.placed("0.22.1")
def test_engine_stops_where_the_check_says(written, tmp_path):
    """A real engine (``LLM.chat``, one engine start) on the checkpoint whose files leave <|im_end|> out: a request
    confined to one token id stops after that token exactly for the ids the check says vLLM stops on; for
    <|im_end|>, the end of the assistant's turn, it runs on to ``max_tokens`` -- the runaway, on stock vLLM -- and it
    stops there once the request passes the WARN's ``stop_token_ids``."""
    folder = written["both endoftext"]
    rep = stop_tokens.report(folder)
    assert rep["status"] == "WARN"
    candidates = sorted({IDS[EOS], IDS["<|im_start|>"], IDS[EOT]})
    n = 4
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"checkpoint": str(folder), "candidates": candidates, "max_tokens": n,
                                "with_stop_token_ids": [[IDS[EOT], rep["stop_token_ids"]]]}))
    env = clean_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = run_program("stop_engine_run", spec, env=env, cwd=tmp_path, timeout=900, new_session=True)
    print(f"\nstop_engine_run: {time.perf_counter() - t0:.0f} s")
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    got = result["candidates"]
    stopped = {c for c in candidates if got[str(c)]["finish_reason"] == "stop" and got[str(c)]["token_ids"] == [c]}
    assert stopped == set(rep["vllm"]["stop_ids"]) & set(candidates) == {IDS[EOS]}, got
    runaway = got[str(IDS[EOT])]
    assert runaway["finish_reason"] == "length" and runaway["token_ids"] == [IDS[EOT]] * n, runaway
    (fixed,) = result["with_stop_token_ids"]
    assert fixed["finish_reason"] == "stop" and fixed["token_ids"] == [IDS[EOT]], fixed
    assert fixed["stop_reason"] == IDS[EOT], fixed
