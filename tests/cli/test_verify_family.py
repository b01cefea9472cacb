"""``verify --model DIR`` on MiniCPM-V 4.7 checkpoints, dense and MoE (the 35B-A3B layout), written by transformers
(``scripts/make_tiny_checkpoint.py --member 4.7 [--moe]``), through the real CLI in a fresh interpreter.

* It names the member and the text tower it read from ``config.json`` (``MiniCPM-V 4.7``, ``dense`` / ``MoE: 4
  experts, top-2``), then loads the vision side through the class vLLM resolves and compares it bit for bit.
* 0.28.0 (no 4.7 of its own): stock -- no activation path (``python -m`` from the repository: its folder joins
  ``sys.path`` after start-up, so its ``sitecustomize`` does not run) -- fails with vLLM's own "not supported" error and says
  the hotfix registers the architecture; with the hotfix (the repository's ``sitecustomize`` on ``PYTHONPATH``), the
  backport's class loads both checkpoints exactly; with ``qkv_loader`` left out, 0.28's own q/k/v loader fails on
  the 4.7 class as on 4.6 (``k_proj``), so the PASS is the fix's and not a comparison that cannot fail.
* 0.32.0 (vLLM's own 4.7 classes): the MoE checkpoint loads exactly.
* MiniCPM-OCR. 0.28.0 (transformers 5.24.0 has ``minicpm_ocr``; vLLM has no OCR class): an OCR checkpoint written
  by transformers (``--member ocr``) fails on stock with vLLM's "not supported" error, verify adding that the hotfix
  registers the architecture; with the hotfix the backport's class loads it exactly. 0.33.0 registers
  ``MiniCPMOcrForConditionalGeneration`` but requires a transformers (< 5.21) without ``minicpm_ocr``, so vLLM cannot
  read an OCR ``config.json`` at all; that environment's transformers cannot write an OCR checkpoint either, so the
  test's checkpoint is a 4.6 one written by it whose ``config.json`` names ``minicpm_ocr`` (vLLM stops at the config,
  before any weight is read); doctor's ``backport minicpm_ocr`` row says it is not served and why.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.backport47 import write_checkpoint
from support import tiny_checkpoints
from support.paths import REPO
from support.venvs import clean_env

pytestmark = pytest.mark.placed("0.28.0", "0.32.0", "0.33.0")

PARAMS = [f"vit_merger.self_attn.{m}.{s}" for m in ("qkv_proj", "out_proj") for s in ("weight", "bias")]
TOWER = {"dense": "text tower dense", "moe": "text tower MoE: 4 experts, top-2"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:  # 4.7: transformers >= 5.19 (0.28.0, 0.32.0)
    root = tmp_path_factory.mktemp("verify47")
    return {"dense": write_checkpoint(root / "dense"), "moe": write_checkpoint(root / "moe", "--moe")}


def verify(folder: Path, *, hotfix: bool, **env: str) -> subprocess.CompletedProcess:
    if hotfix:
        env["PYTHONPATH"] = str(REPO)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", "verify", "--model", str(folder)],
                          cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    print(f"\n$ verify --model {folder.name} (hotfix {hotfix}, {env}) -> exit {proc.returncode} in "
          f"{time.perf_counter() - t0:.1f} s\n{proc.stdout}{proc.stderr[-2000:]}")
    assert "Traceback" not in proc.stdout + proc.stderr
    return proc


def assert_exact(proc: subprocess.CompletedProcess, kind: str) -> None:
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert f"MiniCPM-V 4.7 (MiniCPMV4_7ForConditionalGeneration), {TOWER[kind]}" in out, out
    assert out.strip().splitlines()[-1].startswith("PASS: all 4 vit_merger qkv_proj/out_proj tensors equal"), out
    rows = {p.split(None, 1)[0]: p for p in out.splitlines() if p.split(None, 1)[:1] and p.split()[0] in PARAMS}
    assert list(rows) == PARAMS and all(" OK == " in r for r in rows.values()), rows


#: 0.32.0 runs the MoE checkpoint only (vLLM's own classes; the dense one costs a start there and shows no more).
@pytest.mark.parametrize("kind", [pytest.param("dense", marks=pytest.mark.placed("0.28.0")), "moe"])
@pytest.mark.placed("0.28.0", "0.32.0")
def test_verify_loads_4_7_exactly(ckpts, kind):
    assert_exact(verify(ckpts[kind], hotfix=True), kind)


@pytest.mark.placed("0.28.0")
def test_stock_verify_says_not_supported_and_names_the_hotfix(ckpts):
    proc = verify(ckpts["dense"], hotfix=False)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout
    assert "hotfix      not active" in proc.stdout
    assert last.startswith("FAIL: vLLM 0.28.0"), last
    assert ("could not build MiniCPM-V 4.7 (MiniCPMV4_7ForConditionalGeneration; hotfix not active: it registers "
            "this architecture where vLLM lacks it)") in last, last
    assert "are not supported for now" in last, last


@pytest.mark.placed("0.28.0")
def test_verify_fails_on_0_28_loader_without_qkv_loader(ckpts):
    proc = verify(ckpts["moe"], hotfix=True, VLLM_MINICPM_HOTFIX_DISABLED_FIXES="qkv_loader")
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout
    assert "own load_weights raised (hotfix active)" in last and "k_proj" in last, last


OCR_ARCH = "MiniCPMOcrForConditionalGeneration"


@pytest.fixture(scope="module")
def ocr(tmp_path_factory) -> Path:  # transformers >= 5.24 (0.28.0)
    return write_checkpoint(tmp_path_factory.mktemp("verify-ocr") / "ocr", member="ocr")


@pytest.mark.placed("0.28.0")
def test_verify_loads_ocr_exactly_with_the_backport(ocr):
    assert '"model_type": "minicpm_ocr"' in (ocr / "config.json").read_text()
    proc = verify(ocr, hotfix=True)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert f"MiniCPM-OCR ({OCR_ARCH}), text tower dense" in out, out
    assert out.strip().splitlines()[-1].startswith("PASS: all 4 vit_merger qkv_proj/out_proj tensors equal"), out


@pytest.mark.placed("0.28.0")
def test_stock_verify_says_ocr_is_not_supported_and_names_the_hotfix(ocr):
    proc = verify(ocr, hotfix=False)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout
    assert last.startswith(f"FAIL: vLLM 0.28.0 could not build MiniCPM-OCR ({OCR_ARCH}; hotfix not active: it "
                           "registers this architecture where vLLM lacks it): "), last
    assert "are not supported for now" in last, last


@pytest.mark.placed("0.33.0")
def test_ocr_on_0_33_needs_a_transformers_it_does_not_allow(tmp_path):
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert "minicpm_ocr" not in CONFIG_MAPPING_NAMES  # the transformers vLLM 0.33 requires
    ckpt = tmp_path / "ocr"
    tiny_checkpoints.write(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(model_type="minicpm_ocr", architectures=[OCR_ARCH], downsample_mode="4x")
    (ckpt / "config.json").write_text(json.dumps(config))
    proc = verify(ckpt, hotfix=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stdout
    assert last.startswith(f"FAIL: vLLM 0.33.0 could not build MiniCPM-OCR ({OCR_ARCH}; registered by vLLM; "
                           f"transformers {transformers.__version__} has no minicpm_ocr): "), last
    assert "does not recognize this architecture" in last, last

    doctor = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", "doctor", "--json"], cwd=REPO,
                            env=clean_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900,
                            stdin=subprocess.DEVNULL)
    rows = {r["check"]: r for r in json.loads(doctor.stdout)["checks"]}
    row = rows["backport minicpm_ocr"]
    assert row["status"] == "-", row
    assert row["detail"].startswith(f"MiniCPM-OCR: not served here (transformers {transformers.__version__} has no "
                                    f"MiniCPMOcrConfig, which vLLM's own {OCR_ARCH} "), row
