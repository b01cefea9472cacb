"""``doctor --model`` and ``verify --model`` on a quantized checkpoint: the vision layers as stored and as built,
and the disagreement, in fresh processes (two vLLM imports each: placed on 0.28.0 only)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support import quant_checkpoints as qc
from support.paths import REPO, TINY
from support.stop_checkpoints import token_ids
pytestmark = pytest.mark.placed("0.28.0")

AWQ_SKIP = ["model.vision_tower", "model.merger", "lm_head", "linear_attn.in_proj_b", "linear_attn.in_proj_a"]


@pytest.fixture(scope="module")
def awq(tmp_path_factory):
    out = tmp_path_factory.mktemp("awq")
    qc.write_checkpoint(TINY, out, method="awq", quantize=qc.is_lm_quantized,
                        quantization_config=dict(qc.AWQ_CONFIG, modules_to_not_convert=AWQ_SKIP))
    return out


def cli(*args: str, python=sys.executable, cwd=REPO) -> subprocess.CompletedProcess:
    from support.venvs import clean_env

    return subprocess.run([str(python), "-m", "vllm_minicpm_hotfix", *args], cwd=cwd, env=clean_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def test_doctor_model_reports_disagreement(awq):
    """No hotfix active in this environment (nothing installed it): doctor fails, naming the disagreement."""
    proc = cli("doctor", "--model", str(awq))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "quantized checkpoint" in out and "stock vLLM builds 10 quantized" in out, out
    assert "DISAGREE (stock)" in out and "vpm.encoder.layers.0.mlp.fc1" in out, out
    # The same child process says where vLLM stops a chat answer: the AWQ copy keeps the tiny checkpoint's tokenizer
    # and generation config, both naming <|im_end|> (tests/cli/test_stop_tokens.py).
    im_end = token_ids(TINY)["<|im_end|>"]
    assert re.search(rf"stop tokens +OK +vLLM stops on \[{im_end} <\|im_end\|>\]", out), out


def test_verify_model_reports_and_loads_with_hotfix(awq, pip_env, tmp_path):
    """With the package pip-installed, verify's vLLM process has the hotfix: every vision layer as stored, loaded."""
    proc = cli("verify", "--model", str(awq), "--dtype", "bfloat16", python=pip_env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "with the hotfix 0 (0 disagree)" in out, out
    assert "vpm.encoder.layers.0.mlp.fc1: checkpoint float, vLLM builds UnquantizedLinearMethod" in out, out
    assert proc.returncode == 0, out
