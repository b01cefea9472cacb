"""MiniCPM-OCR on vLLM's own classes (0.33: ``vllm/model_executor/models/minicpm_ocr.py``), with the transformers that
can read an OCR checkpoint (5.24; ``minicpm_ocr`` is there from 5.21.0, forced past vLLM 0.33's ``<5.21`` pin: the
environment ``0.33.0:tf5.24.0``, :data:`support.placement.NARROW_ENVS`). The reference is transformers' own
``MiniCPMOcrProcessor`` of the tiny OCR checkpoint transformers writes (``scripts/make_tiny_checkpoint.py --member
ocr --scale-resolution 448``) and that checkpoint's tensors.

* **Stock** (vLLM's classes as vLLM defines them): on 0.33 every image request raises ``TypeError:
  MiniCPMOcrImageProcessor.find_best_resize() missing 1 required positional argument: 'downsample_mode'`` --
  vLLM's 4.6 ``_compute_visual_tokens``, which OCR inherits, omits the argument transformers >= 5.21.0 requires;
  0.34.0 passes it itself (and ``processor_downsample_mode``'s probe finds OCR correct there), so stock builds a
  prompt there, still unlike transformers' where ``mm_placeholders`` finds OCR broken.
  ``scripts/measure_ocr_stock.py`` shows the same over the whole seeded sweep and every request kwarg.
* **With the hotfix** (every fix applied as the hook applies them): ``processor_downsample_mode``, which declares
  MiniCPM-OCR (vLLM's OCR info overrides ``_compute_visual_tokens`` with a body that omits the mode as 4.6's does),
  hands the mode, and ``mm_placeholders``, which declares it too, puts transformers' text in place of vLLM's OCR
  text (which keeps ``<image_id>`` under ``use_image_id: false`` and the sliced layout under ``slice_mode: false``):
  vLLM's prompt ids equal ``MiniCPMOcrProcessor``'s for tiny to sliced images, the ``"4x"`` grid (449 px: 28-
  against 56-pixel alignment), the request kwargs of :data:`REQUEST_KWARGS`, the model-level ones of
  :data:`MODEL_KWARGS` and two images.
* **The load**: vLLM's own OCR model class, built on CPU and loaded with its own ``load_weights`` (with the q/k/v
  fixes where the hook applies them): the window merger's ``qkv_proj`` equals cat(q, k, v) of the checkpoint.

Placed where vLLM has its OCR class and transformers reads its config: ``0.33.0:tf5.24.0`` (0.33.0's own pinned
5.20.2 has no ``minicpm_ocr``), 0.34.0 (its own 5.22.2) and any newer release with both; the backport covers
0.22-0.30 (tests/backports).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from support.backport47 import write_checkpoint
from support.hotfix import hotfix
from support.placement import own_member_envs
from support.prompt import assert_all_equal, hf_ids, image, make_pair, vllm_ids, with_hotfix

#: The narrow environment, and any other whose vLLM and transformers both ship MiniCPM-OCR (0.34.0 with its own
#: transformers 5.22.2; the canary's newest release): :func:`support.placement.own_member_envs`.
pytestmark = pytest.mark.placed(*own_member_envs("minicpm_ocr", "minicpm_ocr", "0.33.0:tf5.24.0"))

OCR_MODULE = "vllm.model_executor.models.minicpm_ocr"
MISSING_MODE = "find_best_resize() missing 1 required positional argument: 'downsample_mode'"
#: (width, height): tiny (upsized to scale_resolution), small, square, the 4x grid, wide, tall, sliced.
SIZES = [(20, 20), (50, 40), (448, 448), (449, 448), (640, 480), (1000, 300), (300, 1200), (1344, 896)]
#: Per-request kwargs. vLLM 0.33's own OCR keeps ``<image_id>`` under ``use_image_id: false`` and the sliced layout's
#: pads under ``slice_mode: false`` (762 against 256 at 449x448); ``mm_placeholders``, which declares MiniCPM-OCR,
#: gives transformers' text (laid out from the item's crops, which ``small_image_upsize`` decides from the pixels).
REQUEST_KWARGS = [{}, {"max_slice_nums": 2}, {"downsample_mode": "16x"}, {"slice_mode": False},
                  {"use_image_id": False}, {"small_image_upsize": "never"}, {"small_image_upsize": "adaptive"}]
#: Model-level ``--mm-processor-kwargs`` (the server's): the same three that vLLM's own text gets wrong or that
#: decide the crops from the pixels.
MODEL_KWARGS = [{"use_image_id": False}, {"slice_mode": False}, {"small_image_upsize": "never"},
                {"small_image_upsize": "adaptive"}]

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ocr") / "ckpt", member="ocr")


@pytest.fixture(scope="module")
def pair(ckpt):
    p = make_pair(ckpt, {})
    assert type(p.vllm).__module__ == OCR_MODULE, type(p.vllm)  # vLLM's own class, no backport
    assert type(p.hf).__name__ == "MiniCPMOcrProcessor"
    return p


def test_stock_fails_every_image_where_the_processor_fix_finds_ocr_broken(environment, pair):
    """Stock OCR where ``processor_downsample_mode``'s probe finds OCR's classes broken (0.33 with transformers 5.24):
    every image request raises transformers' ``TypeError``; where it finds them correct (0.34.0 passes the mode
    itself): none does. Either way the probe's verdict is the real classes' behaviour."""
    from support import expected as table

    broken = (table.member_verdicts("MiniCPM-OCR", environment) or {}).get("processor_downsample_mode") == "broken"
    for w, h in SIZES:  # vLLM's classes as vLLM defined them (tests/conftest.py: nothing patched between tests)
        if broken:
            with pytest.raises(TypeError, match=re.escape(MISSING_MODE)):
                vllm_ids(pair, "image", [image(w, h)], {})
        else:
            assert vllm_ids(pair, "image", [image(w, h)], {}), (w, h)


def test_prompt_ids_equal_transformers(m46, pair):
    cases = [(f"{w}x{h}", "image", [image(w, h)], kwargs) for kwargs in REQUEST_KWARGS for w, h in SIZES]
    with with_hotfix(m46) as statuses:
        # Each applied for OCR exactly where its probe finds OCR's classes broken (processor_downsample_mode: 0.33
        # with transformers 5.24, not 0.34.0, which passes the mode itself); the prompts below are the reference.
        for name in ("processor_downsample_mode", "mm_placeholders"):
            ocr = statuses[name].models["MiniCPM-OCR"]
            assert ocr["applied"] == (ocr["verdict"] == "broken"), (name, ocr)
        assert statuses["mm_placeholders"].models["MiniCPM-OCR"]["applied"], statuses["mm_placeholders"].models
        assert_all_equal(pair, cases + [("two images", "image", [image(640, 480), image(50, 40)], {})])


@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_model_level_kwargs_give_transformers_prompt(m46, ckpt, model_kwargs):
    pair = make_pair(ckpt, model_kwargs)
    cases = [(f"{w}x{h}", "image", [image(w, h)], {}) for w, h in SIZES]
    with with_hotfix(m46):
        assert_all_equal(pair, cases + [("two images", "image", [image(640, 480), image(50, 40)], {})])


def test_without_the_declaration_vllms_own_text_differs(m46, pair, monkeypatch):
    """What ``mm_placeholders``' declaration of MiniCPM-OCR changes on vLLM's own classes: without it (every other fix
    applied) ``use_image_id: false`` keeps ``<image_id>`` and ``slice_mode: false`` keeps the sliced layout's pads."""
    from vllm_minicpm_hotfix.fixes import mm_placeholders

    monkeypatch.setattr(mm_placeholders, "MODELS", tuple(m for m in mm_placeholders.MODELS if m != "MiniCPM-OCR"))
    img = image(449, 448)
    with with_hotfix(m46):
        got = vllm_ids(pair, "image", [img], {"use_image_id": False})
        assert got != hf_ids(pair, "image", [img], {"use_image_id": False})
        assert pair.tokenizer.convert_tokens_to_ids("<image_id>") in got


def test_vit_merger_qkv_equals_the_checkpoint(m46, ckpt):
    import torch
    from support.vllm_build import build_vllm_model, checkpoint_tensors, load_checkpoint

    ocr = importlib.import_module(OCR_MODULE)
    tensors = checkpoint_tensors(ckpt)
    with hotfix(m46, "auto", fixes=("qkv_loader", "qkv_completeness_guard")):
        model = build_vllm_model(ckpt, load=False, model_cls=ocr.MiniCPMOcrForConditionalGeneration)
        load_checkpoint(model, ckpt)
    params = dict(model.named_parameters())
    for s in ("weight", "bias"):
        parts = [tensors[f"model.vision_tower.vit_merger.self_attn.{p}_proj.{s}"] for p in "qkv"]
        assert torch.equal(params[f"vit_merger.self_attn.qkv_proj.{s}"], torch.cat(parts)), s


def test_bad_request_kwargs_are_refused_before_the_pixel_work(m46, pair):
    """``request_kwargs`` declares MiniCPM-OCR: on vLLM 0.33's own classes a bad per-request kwarg raises its
    ``RequestKwargsError`` (HTTP 400) naming the kwarg and the value before vLLM hands the image to transformers."""
    from support.prompt import pixel_work_calls, processed
    from vllm_minicpm_hotfix.fixes import request_kwargs as rk

    with pixel_work_calls(pair.vllm) as calls:
        for kwargs in ({"slice_mode": "false"}, {"max_slice_nums": 0}, {"scale_resolution": 13}, {"patch_size": 7},
                       {"small_image_upsize": "sometimes"}):
            ((key, value),) = kwargs.items()
            with with_hotfix(m46), pytest.raises(rk.RequestKwargsError) as info:
                processed(pair, "image", [image(640, 480)], kwargs)
            assert str(info.value).startswith("MiniCPM-OCR: ") and f"mm_processor_kwargs.{key} = {value!r}" in str(info.value)
    assert not calls, calls


def test_request_slice_mode_false_is_refused_not_sent_to_the_engine(m46, pair, monkeypatch):
    """Without ``mm_placeholders``' declaration of MiniCPM-OCR, vLLM 0.33's own OCR keeps the sliced layout's pads for
    a per-request ``slice_mode: false`` while its tensors are the unsliced image's. ``placeholder_guard``, which
    declares MiniCPM-OCR too, refuses such a request (a ``ValueError``: HTTP 400) with the count transformers'
    ``MiniCPMOcrProcessor`` gives; without its declaration either, the prompt goes on with other pads than
    transformers' (the engine's merge of the embeddings would fail on it). With every fix, the prompt is
    transformers' (:func:`test_prompt_ids_equal_transformers`)."""
    from vllm_minicpm_hotfix.fixes import mm_placeholders
    from vllm_minicpm_hotfix.fixes import placeholder_guard as pg

    kwargs = {"slice_mode": False}
    img = image(449, 448)
    pad = pair.hf.image_token_id
    want = hf_ids(pair, "image", [img], kwargs).count(pad)
    monkeypatch.setattr(mm_placeholders, "MODELS", tuple(m for m in mm_placeholders.MODELS if m != "MiniCPM-OCR"))
    with with_hotfix(m46) as statuses:
        assert statuses[pg.NAME].applied
        with pytest.raises(pg.PlaceholderMismatchError) as info:
            vllm_ids(pair, "image", [img], kwargs)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and msg.startswith("MiniCPM-OCR: image item 0 ")
    assert f"give {want} vision embeddings" in msg, msg
    monkeypatch.setattr(pg, "MODELS", tuple(m for m in pg.MODELS if m != "MiniCPM-OCR"))
    with with_hotfix(m46):
        assert vllm_ids(pair, "image", [img], kwargs).count(pad) != want
