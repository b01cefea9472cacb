"""Bad model-level ``--mm-processor-kwargs`` stop a real ``vllm serve`` at start-up with one clear error.

One configuration (tests/support/hostile_cases.py's :data:`~hostile_cases.MODEL_LEVEL_BAD`: ``max_slice_nums: -1``, a
degenerate value; ``patch_size: 7``, geometry the checkpoint was built with; ``slice_mode: "false"``, a wrong type),
two servers of the tiny checkpoint on 127.0.0.1, one after the other:

* **hotfix** (pip-installed): the server exits before it serves anything; its log holds the hotfix's error -- the
  model, each of the three keys with its value and what is allowed -- exactly once, as the one exception of the one
  traceback in the log (vLLM's own, of the process that failed), and no hotfix log line reports a failure of its own;
* **without the check**: the same server with every fix but ``request_kwargs`` (stock 0.30.0 does not load the
  checkpoint at all: the load fixes are needed first), ``request_kwargs`` left out by
  ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES``: vLLM also fails at start-up, inside its token counting,
  with an error naming none of the keys (``ValueError: math domain error`` from transformers' ``get_sliced_grid``
  on 0.30.0).

Placed on 0.30.0 (a short session): two failed start-ups, ~20-40 s each on an idle machine.
"""

from __future__ import annotations

import json
import re

import pytest
from support.hotfix_log import summaries

from support import hostile_cases
from support.venvs import clean_env
from support.server import FAILS_WITHIN_S, serving
from support.serving import CPU_ARGS

pytestmark = pytest.mark.placed("0.30.0")

SERVE_ARGS = [
    *CPU_ARGS,
    "--no-enable-prefix-caching",
    "--mm-processor-kwargs", json.dumps(hostile_cases.model_level_bad()),
]
TRACEBACK = "Traceback (most recent call last)"
#: The last line of a Python traceback: ``ExceptionType: message`` (after vLLM's ``(APIServer pid=N)`` prefix).
EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?([\w.]+(?:Error|Exception)): (.*)$", re.MULTILINE)


def start_and_fail(python, env, tmp_path, name: str) -> str:
    """Start ``vllm serve`` with :data:`SERVE_ARGS`; it must exit (non-zero) before it is healthy. Its log."""
    with serving(python, env, tmp_path, name, SERVE_ARGS) as srv:
        healthy = srv.wait_healthy(FAILS_WITHIN_S)
        log = srv.log()
        assert not healthy, f"the server started with {SERVE_ARGS[-1]}:\n{log[-4000:]}"
        assert srv.proc.returncode != 0, log[-4000:]
    print(f"\n{name}: exited {srv.proc.returncode}; {[m.group(0)[:400] for m in EXCEPTION_LINE.finditer(log)]}")
    return log


def test_hotfix_refuses_them_at_start_up_with_one_error(pip_env, tmp_path):
    log = start_and_fail(pip_env, clean_env(), tmp_path, "hotfix")
    assert summaries(log), "the hotfix is not active in the server:\n" + log[-4000:]
    refused = [line for line in log.splitlines() if "of --mm-processor-kwargs are refused" in line]
    assert len(refused) == 1, refused or log[-6000:]
    (line,) = refused
    assert "MiniCPM-V 4.6: 3 of --mm-processor-kwargs are refused: " in line
    for key, (value, allowed) in hostile_cases.MODEL_LEVEL_BAD.items():
        assert f"--mm-processor-kwargs.{key} = {value!r}" in line, key
        assert allowed in line, key
    # the one traceback is vLLM's, of the one process that failed, and it ends in the hotfix's error
    assert log.count(TRACEBACK) == 1, log[-6000:]
    exceptions = EXCEPTION_LINE.findall(log)
    assert exceptions and exceptions[-1][0].endswith("RequestKwargsError"), exceptions
    # the hotfix's own lines above INFO are its summary lines: nothing of its own failed
    own = [s for s in log.splitlines() if "vllm-minicpm-hotfix:" in s and re.search(r" (WARNING|ERROR|CRITICAL) ", s)]
    assert own and all(re.search(r"pid \d+: patched \d+/\d+", s) for s in own), own


def test_without_the_check_vllm_fails_naming_none_of_them(pip_env, tmp_path):
    env = clean_env(VLLM_MINICPM_HOTFIX_DISABLED_FIXES="request_kwargs")
    log = start_and_fail(pip_env, env, tmp_path, "without-check")
    lines = summaries(log)
    assert lines and all("request_kwargs" not in s["applied"] for s in lines), [s["line"] for s in lines]
    exceptions = EXCEPTION_LINE.findall(log)
    assert exceptions, log[-6000:]
    kind, message = exceptions[-1]
    assert "RequestKwargsError" not in kind
    assert not any(key in message for key in hostile_cases.MODEL_LEVEL_BAD), (kind, message)
