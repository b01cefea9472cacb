"""The prompt side through a real engine: ``LLM.generate``'s ``RequestOutput.prompt_token_ids`` for MiniCPM-V
4.6 images and videos equal transformers' ``MiniCPMV4_6Processor`` input ids, and every request is answered.

One engine per release (tests/programs/prompt_engine_run.py in a fresh interpreter, hotfix installed as the package's
post-import hook, ``auto``), with the real processor geometry (patch 14, ``scale_resolution`` 448), for the sizes and
kwargs that show each family's defects (:data:`REQUESTS`). Stock vLLM is shown failing these same items by
tests/prompt/test_prompt_conformance.py (its processor, no engine): the pad counts that differ there are what kills the
engine (``_merge_multimodal_embeddings``), as serving-defects.md recorded on 0.22.1 and 0.32.0.

Engines cost 60-80 s each on the CI machine: this module runs only on :data:`ENGINE_RELEASES` (one per family,
chosen for what only an engine shows: 0.23.0 starts at all only with ``hf_processor_version``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from support.paths import REPO

from support.placement import vllm_release
from support.programs import run_program
from support import expected as table
from support.prompt import MINE, PROMPT, V47_ENVS, image, real_geometry_copy, video, write_v47
from vllm_minicpm_hotfix.fixes import REGISTRY

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


#: MiniCPM-V 4.7's engine runs only where vLLM can start one on CPU with 4.7 (0.33.0's environment is the CUDA wheel).
V47_ENGINE = tuple(r for r in V47_ENVS if r == "0.32.0")


@pytest.fixture(scope="module", params=["4.6", pytest.param("4.7", marks=pytest.mark.placed(*V47_ENGINE))])
def checkpoint(request, tmp_path_factory) -> Path:
    """The real-geometry 4.6 checkpoint, or the 4.7 one transformers writes (``MiniCPMV4_7ForConditionalGeneration``)."""
    if request.param == "4.7":
        return write_v47(tmp_path_factory.mktemp("engine47") / "ckpt")
    return real_geometry_copy(tmp_path_factory.mktemp("engine") / "ckpt")


@pytest.fixture(scope="module")
def v47(tmp_path_factory) -> Path:
    return write_v47(tmp_path_factory.mktemp("engine47-extra") / "ckpt")


def run_engine(checkpoint: Path, tmp_path_factory, names, **extra) -> dict:
    """One engine in a fresh interpreter (tests/programs/prompt_engine_run.py) serving the requests ``names`` of
    :data:`REQUESTS`; ``extra``: ``revert`` / ``limits`` of its spec."""
    spec = tmp_path_factory.mktemp("engine-spec") / "spec.json"
    spec.write_text(json.dumps({
        "checkpoint": str(checkpoint),
        "requests": [
            {"name": name, "modality": m, "sizes": sizes, "frames": frames, "kwargs": kwargs}
            for name, (m, sizes, frames, kwargs) in ((n, REQUESTS[n]) for n in names)
        ],
        **extra,
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MINICPM_HOTFIX")}
    # The repository as a PYTHONPATH bundle (its sitecustomize.py): every process vLLM spawns (0.22's CPU worker)
    # runs the post-import hook too.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    start = time.perf_counter()
    proc = run_program("prompt_engine_run", spec, env=env, timeout=900, check=False, new_session=True)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"engine run failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    print(f"\nvLLM {vllm_release()}: engine run of {checkpoint.parent.name} (import, start, {len(names)} requests, "
          f"{extra or 'hotfix'}) {wall:.0f} s")
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def engine_run(checkpoint, tmp_path_factory) -> dict:
    """The one engine of this module per model: every request of :data:`REQUESTS`, in a fresh interpreter."""
    return run_engine(checkpoint, tmp_path_factory, list(REQUESTS))


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
    """In the engine's process the hook applied exactly the prompt fixes whose probes find vLLM broken here, and
    (where vLLM has 4.7) for 4.7 exactly where the fix declares 4.7 and its probe on 4.7's classes finds them broken."""
    status = engine_run["status"]
    for name in MINE:
        verdict = table.verdict(name, environment)
        assert status[name]["verdict"] == verdict, status[name]
        assert status[name]["applied"] is (verdict == "broken"), status[name]
        assert status[name]["error"] is None, status[name]
        row = status[name]["models"].get("MiniCPM-V 4.7")
        if row is not None:
            assert row["applied"] is (row["declared"] and row["verdict"] == "broken"), row


@pytest.mark.parametrize("name", list(REQUESTS))
def test_engine_prompt_equals_transformers(engine_run, checkpoint, name):
    """The request was answered and the prompt vLLM built is transformers' own, token for token."""
    got = engine_run["results"][name]
    assert "error" not in got, got
    assert got["prompt_token_ids"] == transformers_ids(checkpoint, name)


# --------------------------------------------------------------------------------------------------------------------
# MiniCPM-V 4.7 on 0.32.0: stock dies where the hotfix answers; video-only serving
# --------------------------------------------------------------------------------------------------------------------

#: The request that kills stock 0.32.0's 4.7 engine (63 embeddings for 119 placeholders at 640x480; 449x448 here).
KILLER = "slice_mode false"


@pytest.mark.placed(*V47_ENGINE)
def test_v47_stock_engine_dies_on_the_request_the_hotfix_answers(v47, tmp_path_factory):
    """Stock vLLM (every fix reverted right after the hook) on the 4.7 checkpoint: the per-request ``slice_mode:
    false`` image fails inside the engine with vLLM's placeholder-count error; the hotfix's engine answers it with
    transformers' prompt (:func:`test_engine_prompt_equals_transformers`)."""
    run = run_engine(v47, tmp_path_factory, [KILLER], revert=[f.NAME for f in REGISTRY])
    got = run["results"][KILLER]
    assert "error" in got, got
    assert "multimodal tokens to" in got["error"] and "placeholders" in got["error"], got["error"]


@pytest.mark.placed(*V47_ENGINE)
def test_v47_video_only_engine(v47, tmp_path_factory):
    """4.7 served with ``limit_mm_per_prompt={"image": 0, "video": 1}`` (stock: the tower stays on the meta device
    and the first video dies): the video is answered with transformers' prompt."""
    run = run_engine(v47, tmp_path_factory, ["video 2x56"], limits={"image": 0, "video": 1})
    assert run["status"]["video_tower"]["models"]["MiniCPM-V 4.7"]["applied"] is True, run["status"]["video_tower"]
    got = run["results"]["video 2x56"]
    assert "error" not in got, got
    assert got["prompt_token_ids"] == transformers_ids(v47, "video 2x56")
