"""Issue 11, prompt side, through a real engine: ``LLM.generate``'s ``RequestOutput.prompt_token_ids`` for MiniCPM-V
4.6 images and videos equal transformers' ``MiniCPMV4_6Processor`` input ids, and every request is answered.

One engine per release (tests/prompt_engine_run.py in a fresh interpreter, hotfix installed as the package's
post-import hook, ``auto``), with the real processor geometry (patch 14, ``scale_resolution`` 448), for the sizes and
kwargs that show each family's defects (:data:`REQUESTS`). Stock vLLM is shown failing these same items by
tests/test_prompt_conformance.py (its processor, no engine): the pad counts that differ there are what kills the
engine (``_merge_multimodal_embeddings``), as serving-defects.md recorded on 0.22.1 and 0.32.0.

Engines cost 60-80 s each on the CI machine: this module runs only on :data:`ENGINE_RELEASES` (one per family,
chosen for what only an engine shows: 0.23.0 starts at all only with ``hf_processor_version``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, vllm_release
import expected as table
from test_prompt_conformance import MINE, PROMPT, image, real_geometry_copy, video

#: One release per family (A B C D). Tell scripts/test / .ci/run to run this module there.
ENGINE_RELEASES = ("0.23.0", "0.24.0", "0.28.0", "0.32.0")

pytestmark = pytest.mark.placed(*ENGINE_RELEASES)

#: name -> (modality, sizes (w, h), frames, mm_processor_kwargs)
REQUESTS = {
    "365x211": ("image", [(365, 211)], 0, {}),
    "449x449": ("image", [(449, 449)], 0, {}),
    "449x448": ("image", [(449, 448)], 0, {}),
    "300x900": ("image", [(300, 900)], 0, {}),
    "max_slice_nums 1": ("image", [(449, 448)], 0, {"max_slice_nums": 1}),
    "slice_mode false": ("image", [(449, 448)], 0, {"slice_mode": False}),
    "scale_resolution 224": ("image", [(448, 448)], 0, {"scale_resolution": 224}),
    "use_image_id false": ("image", [(449, 448)], 0, {"use_image_id": False}),
    "downsample 4x": ("image", [(640, 360)], 0, {"downsample_mode": "4x"}),
    "two images": ("image", [(365, 211), (900, 300)], 0, {}),
    "video 2x56": ("video", [(56, 56)], 2, {}),
    "video 700x400 slice_mode false": ("video", [(700, 400)], 2, {"slice_mode": False}),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return real_geometry_copy(tmp_path_factory.mktemp("engine") / "ckpt")


@pytest.fixture(scope="module")
def engine_run(checkpoint, tmp_path_factory) -> dict:
    """The one engine of this module: every request of :data:`REQUESTS`, in a fresh interpreter."""
    spec = tmp_path_factory.mktemp("engine-spec") / "spec.json"
    spec.write_text(json.dumps({
        "checkpoint": str(checkpoint),
        "requests": [
            {"name": name, "modality": m, "sizes": sizes, "frames": frames, "kwargs": kwargs}
            for name, (m, sizes, frames, kwargs) in REQUESTS.items()
        ],
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MINICPM_HOTFIX")}
    # The repository as a PYTHONPATH bundle (its sitecustomize.py): every process vLLM spawns (0.22's CPU worker)
    # runs the post-import hook too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "prompt_engine_run.py"), str(spec)],
        capture_output=True, text=True, timeout=900, env=env, start_new_session=True,
    )
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    print(f"\nvLLM {vllm_release()}: engine run (import, start, {len(REQUESTS)} requests) {wall:.0f} s")
    return json.loads(lines[-1][len("RESULT "):])


def transformers_ids(checkpoint: Path, name: str) -> list[int]:
    from transformers import AutoProcessor

    hf = AutoProcessor.from_pretrained(str(checkpoint))
    modality, sizes, frames, kwargs = REQUESTS[name]
    if modality == "image":
        items = [image(w, h) for w, h in sizes]
        out = hf(text=[PROMPT.format(mm=hf.image_token * len(items))], images=items, **kwargs)
    else:
        items = [video(w, h, frames) for w, h in sizes]
        out = hf(text=[PROMPT.format(mm=hf.video_token * len(items))], videos=items, do_sample_frames=False, **kwargs)
    return out["input_ids"][0].tolist()


def test_engine_fixes_applied(engine_run, environment):
    """In the engine's process the hook applied exactly the prompt fixes whose probes find vLLM broken here."""
    status = engine_run["status"]
    for name in MINE:
        verdict = table.verdict(name, environment)
        assert status[name]["verdict"] == verdict, status[name]
        assert status[name]["applied"] is (verdict == "broken"), status[name]
        assert status[name]["error"] is None, status[name]


@pytest.mark.parametrize("name", list(REQUESTS))
def test_engine_prompt_equals_transformers(engine_run, checkpoint, name):
    """The request was answered and the prompt vLLM built is transformers' own, token for token."""
    got = engine_run["results"][name]
    assert "error" not in got, got
    assert got["prompt_token_ids"] == transformers_ids(checkpoint, name)
