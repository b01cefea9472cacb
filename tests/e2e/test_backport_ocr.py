"""MiniCPM-OCR on a vLLM release without it (the backport, ``vllm_minicpm_hotfix/backports/minicpm_ocr.py``), through
a real engine: ``LLM(...)`` of the tiny OCR checkpoint transformers writes (``scripts/make_tiny_checkpoint.py
--member ocr``: ``"4x"``, ``small_image_upsize`` ``"always"``, the real geometry: patch 14, ``scale_resolution``
448), activated by vLLM's plugin entry point alone (the wheel on ``PYTHONPATH``), EngineCore in its own process,
bf16 (vLLM's CPU GDN attention requires it).

* The engine starts, and the driver's status says "MiniCPM-OCR: registered by the hotfix".
* For a text prompt and images from tiny (upsized to ``scale_resolution``) to sliced, and per-request kwargs: the
  prompt ids equal transformers' ``MiniCPMOcrProcessor``'s; the first step's top-5 log-probabilities agree with
  transformers' float32 ``MiniCPMOcrForConditionalGeneration`` within :data:`TOLERANCE`; each image request's
  sensitivity -- how far another noise image of the same size moves transformers' top-5 -- is larger than the
  tolerance (else the comparison could not see a wrong image); the greedy token equals transformers' where its
  top-2 margin is clear.

Measured 2026-12-04 on 0.28.0 (transformers 5.24.0): vLLM differs from transformers by 0.013-0.018 (text 0.014);
another image moves transformers by 0.073-0.091 (448x448, 50x40, 640x480).

Placed on 0.28.0 only (an engine costs minutes of CI); the light tests of the backport
(tests/backports/test_minicpm_ocr.py) run on 0.22.1 and 0.28.0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from support.backport47 import PROMPT, Reference, judge_first_step, noise_image, write_checkpoint
from support.programs import run_program
from support.venvs import clean_env, run_uv

pytestmark = pytest.mark.placed("0.28.0")

#: Largest |vLLM bf16 - transformers float32| over vLLM's first-step top 5; below every image request's sensitivity.
TOLERANCE = 0.035
#: name -> ((width, height) or None, per-request mm_processor_kwargs, image seed).
REQUESTS: dict[str, tuple[tuple[int, int] | None, dict, int]] = {
    "text": (None, {}, 0),
    "448x448": ((448, 448), {}, 1),
    "449x448 (4x grid)": ((449, 448), {}, 2),
    "50x40 (upsized)": ((50, 40), {}, 3),
    "640x480 (sliced)": ((640, 480), {}, 4),
    "1000x300 max_slice_nums 2": ((1000, 300), {"max_slice_nums": 2}, 5),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("backport-ocr-e2e") / "ocr", member="ocr")


@pytest.fixture(scope="module")
def engine(ckpt, wheel, tmp_path_factory) -> tuple[dict, str]:
    """One ``LLM(...)`` of the OCR checkpoint answering :data:`REQUESTS` (tests/programs/backport_engine.py), the
    hotfix activated by vLLM's plugin entry point only (``pip install --target`` of the wheel on ``PYTHONPATH``)."""
    tmp = tmp_path_factory.mktemp("ocr-engine")
    target = tmp / "target"
    run_uv("pip", "install", "--no-deps", "--python", sys.executable, "--target", str(target), str(wheel))
    requests = [{"name": name, "modality": "image" if size else "text", "size": list(size or ()), "seed": seed,
                 "kwargs": kwargs} for name, (size, kwargs, seed) in REQUESTS.items()]
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"engines": [{"name": "ocr", "checkpoint": str(ckpt), "limits": {"image": 1, "video": 0},
                                             "requests": requests}]}))
    t0 = time.monotonic()
    proc = run_program("backport_engine", spec, python=sys.executable, cwd=tmp, timeout=1500, new_session=True,
                       check=False, env=clean_env(PYTHONPATH=str(target), VLLM_CACHE_ROOT=str(tmp / "vllm-cache")))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"backport_engine exited {proc.returncode}:\n{log[-6000:]}"
    print(f"\nOCR LLM program: {time.monotonic() - t0:.0f} s")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**result["engines"]["ocr"], "status": result["status"]}, log


def test_llm_engine_starts_through_the_plugin_route(engine):
    out, log = engine
    assert "startup_error" not in out, out.get("startup_error")
    row = out["status"]["backports"]["minicpm_ocr"]
    assert (row["verdict"], row["registered"]) == ("missing", True), row
    errors = {name: r["error"] for name, r in out["results"].items() if "error" in r}
    assert not errors, errors


def test_first_step_logprobs_agree_with_transformers(engine, ckpt):
    import torch

    torch.set_num_threads(1)
    out, _ = engine
    ref = Reference(ckpt, "MiniCPMOcrForConditionalGeneration")
    rows, problems = [], []
    for name, (size, kwargs, seed) in REQUESTS.items():
        got = out["results"][name]
        img = noise_image(*size, seed) if size else None
        text = PROMPT.format(mm="<|image_pad|>" if size else "")
        assert got["prompt_token_ids"] == ref.ids(text, img, kwargs), name
        row, found = judge_first_step(ref, name, text, img, kwargs, {int(t): lp for t, lp in got["logprobs"].items()},
                                      got["token_ids"][0], TOLERANCE)
        rows.append(row)
        problems += found
    print("\nOCR: " + "; ".join(rows))
    assert not problems, problems
