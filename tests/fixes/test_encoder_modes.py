"""``encoder_modes`` against the real vLLM of this environment, without an engine: a 16x and a 4x image in one encoder
batch, and a 4x video, batched as vLLM's model runner batches them (``group_and_batch_mm_kwargs``), against each item
encoded on its own (:mod:`support.engine`).

The probe per family member: decided (``broken`` or ``correct``) on the member's own classes with the member's own
transformers image processor (4.6's where transformers lacks the member), 4.7's and MiniCPM-OCR's verdict equal to 4.6's
(their classes inherit every method the fix wraps), ``correct`` on every member once forced. Run everywhere the suite
runs (each environment has 4.7 and OCR classes: vLLM's own or the backport's) and on ``0.33.0:tf5.24.0``, the one
environment with vLLM's own OCR classes and a transformers that has OCR's image processor.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from support.hotfix import hotfix
from vllm_minicpm_hotfix.decision import State
from vllm_minicpm_hotfix.fixes import _base, encoder_modes, placeholder_guard
from support.engine import (  # noqa: F401 - fixtures
    vision_reference, image, video, fixes, process, pads_in_prompt, embed, items_of, merge, mconfig, vproc, vmodel,
    stock_verdict,
)


@pytest.mark.parametrize("shape", [(3, 56, 56), (3, 28, 84), (1, 14, 14), (3, 70, 42)])
def test_probe_patch_layout_is_transformers_own(shape):
    """The encoder_modes probe's image processor lays patches out without ``unfold``: the same tensor as
    transformers' own ``MiniCPMV4_6ImageProcessor.reshape_by_patch`` (patch 14) for every shape tried."""
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor

    image = torch.randn(*shape)
    ref = MiniCPMV4_6ImageProcessor().reshape_by_patch(image, 14)
    ours = encoder_modes._probe_image_processor(MiniCPMV4_6ImageProcessor).reshape_by_patch(image, 14)
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    assert torch.equal(ours, ref)


def test_mixed_mode_batch(m46, vproc, vmodel, environment):
    """A 16x and a 4x request's images in one encoder batch: stock 0.22-0.31 encodes both in 16x (the 4x one gets a
    quarter of its placeholder's embeddings: the merge kills the engine); with the fix each item's embeddings equal
    that item encoded alone, bit for bit."""
    with fixes(m46):
        a = process(vproc, {"image": [image(224, 224)]}, {"downsample_mode": "16x"})
        b = process(vproc, {"image": [image(224, 224)]}, {"downsample_mode": "4x"})
        solo = [embed(vmodel, items_of(a))[0], embed(vmodel, items_of(b))[0]]
        assert [pads_in_prompt(vproc, o) for o in (a, b)] == [int(e.shape[0]) for e in solo] == [20, 80]
        stock = embed(vmodel, items_of(a) + items_of(b))
    print(f"\nsolo rows {[e.shape[0] for e in solo]}, stock batch rows {[e.shape[0] for e in stock]}")
    if stock_verdict("encoder_modes", environment) == "broken":
        assert [int(e.shape[0]) for e in stock] == [20, 20]
        with pytest.raises(ValueError, match="Attempted to assign"):
            merge(m46, vmodel, b, [stock[1]])
    with fixes(m46, "encoder_modes") as st:
        assert st["encoder_modes"].applied is (stock_verdict("encoder_modes", environment) == "broken")
        for order in ((a, b), (b, a)):
            got = embed(vmodel, items_of(order[0]) + items_of(order[1]))
            want = solo if order[0] is a else solo[::-1]
            assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_mixed_mode_video_batch(m46, vproc, vmodel, environment):
    """A 16x and a 4x request's videos in one encoder batch (two concurrent requests, batched as the model runner
    batches them): each video's embeddings equal the model's own encoding of its frames in its own mode, in either
    order. Stock 0.22-0.31 carries no per-video mode (the encoder fails on such a batch, or the 4x video is not
    encoded in 4x); 0.32+ groups by its own per-video flag."""
    vids = {"16x": video(2, 112, 112), "4x": video(2, 140, 112)}
    broken = stock_verdict("encoder_modes", environment) == "broken"
    with fixes(m46, "encoder_modes") as st:
        assert st["encoder_modes"].applied is broken
        outs = {m: process(vproc, {"video": [v]}, {"downsample_mode": m}) for m, v in vids.items()}
        data = {m: placeholder_guard.item_data(o["mm_kwargs"]["video"][0]) for m, o in outs.items()}
        ref = {m: vision_reference(vmodel, data[m], m) for m in vids}
        rows = {m: int(r.shape[0]) for m, r in ref.items()}
        assert rows["4x"] > rows["16x"], rows
        for order in (("16x", "4x"), ("4x", "16x")):
            got = embed(vmodel, items_of(outs[order[0]], "video") + items_of(outs[order[1]], "video"))
            print(f"\n{order}: rows {[int(g.shape[0]) for g in got]}, want {[rows[m] for m in order]}")
            assert [int(g.shape[0]) for g in got] == [rows[m] for m in order]
            assert all(torch.equal(g, ref[m]) for g, m in zip(got, order))
    with fixes(m46):
        stock_out = {m: process(vproc, {"video": [v]}, {"downsample_mode": m}) for m, v in vids.items()}
        try:
            stock = embed(vmodel, items_of(stock_out["16x"], "video") + items_of(stock_out["4x"], "video"))
        except Exception as exc:  # noqa: BLE001 - what stock does with the batch is the observation
            stock = exc
    print(f"stock batch: {stock if isinstance(stock, Exception) else [int(e.shape[0]) for e in stock]}, "
          f"its own modes' rows {rows}")
    if broken:  # the encoder fails on the batch, or the 4x video is not encoded in 4x
        assert isinstance(stock, Exception) or int(stock[1].shape[0]) != rows["4x"], stock
    else:
        assert all(torch.equal(g, ref[m]) for g, m in zip(stock, ("16x", "4x")))


def test_four_x_video(m46, vproc, vmodel, environment):
    """A 2-frame video requested in 4x: its embeddings are the model's own 4x encoding of its frames (stock 0.22-0.31
    encodes it in 16x: a quarter of the rows); the per-video flag is in the processed item."""
    vid = video(2, 112, 112)
    with fixes(m46):
        out = process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})
        stock = embed(vmodel, items_of(out, "video"))[0]
    with fixes(m46, "encoder_modes"):
        out = process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})
        data = placeholder_guard.item_data(out["mm_kwargs"]["video"][0])
        assert encoder_modes.VIDEO_FLAG in data and not bool(data[encoder_modes.VIDEO_FLAG].any())
        got = embed(vmodel, items_of(out, "video"))[0]
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vmodel.vllm_config), torch.no_grad():
        pv = list(data["video_pixel_values"])
        ref = torch.cat(vmodel.get_vision_hidden_states(
            {"pixel_values": pv, "tgt_sizes": data["video_tgt_sizes"]}, downsample_mode="4x"))
    print(f"\nvideo rows: stock {stock.shape[0]}, fixed {got.shape[0]}, 4x reference {ref.shape[0]}")
    assert torch.equal(got, ref)
    assert (stock.shape[0] * 4 == ref.shape[0]) is (stock_verdict("encoder_modes", environment) == "broken")


#: transformers' ``model_type`` of each family member: its package under ``transformers.models`` and its key in
#: transformers' own ``IMAGE_PROCESSOR_MAPPING_NAMES`` (the reference for the image processor the probe runs).
MODEL_TYPES = {"MiniCPM-V 4.6": "minicpmv4_6", "MiniCPM-V 4.7": "minicpmv4_7", "MiniCPM-OCR": "minicpm_ocr"}
#: The one environment that runs only the tests naming it (support.placement.NARROW_ENVS): vLLM's own OCR classes
#: with a transformers that has MiniCPM-OCR.
OCR_NARROW = "0.33.0:tf5.24.0"


def _transformers_has(member: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{MODEL_TYPES[member]}") is not None


def _member_verdicts_are_decided(m46) -> None:
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    views = _base.member_modules(m46)
    assert set(views) == set(MODEL_TYPES), views  # every member has classes here: vLLM's own or the backport's
    stock = {member: encoder_modes.probe(view) for member, view in views.items()}
    print("\n" + "\n".join(f"{m} ({views[m].__name__}): {v.state.value}: {v.reason}" for m, v in stock.items()))
    for member, view in views.items():
        verdict = stock[member]
        assert verdict.state in (State.BROKEN, State.CORRECT), (member, verdict)
        assert verdict.state is stock["MiniCPM-V 4.6"].state, (member, verdict, stock["MiniCPM-V 4.6"])
        # The image processor the probe feeds the member's frames to is transformers' own for that model type; where
        # transformers lacks the model (vLLM cannot serve the member here), 4.6's, and the probe says so.
        ip_cls, note = encoder_modes.member_image_processor(view)
        names = IMAGE_PROCESSOR_MAPPING_NAMES.get(MODEL_TYPES[member]) if _transformers_has(member) else None
        if names is not None:
            assert (ip_cls.__name__, note) == (names["torchvision"], ""), member
        else:
            assert ip_cls.__name__ == IMAGE_PROCESSOR_MAPPING_NAMES["minicpmv4_6"]["torchvision"], member
            assert "has no" in note, (member, note)
            assert verdict.state is State.BROKEN or note in verdict.reason, (member, verdict)  # 4x video run: said
        # OCR's frames reach 4.6's image processor only where transformers has no OCR's (the cause of OCR's
        # "undetermined" on vLLM 0.33-0.34: its own process_videos' options refused by 4.6's kwargs check).
        if member == "MiniCPM-OCR" and names is not None:
            assert "MiniCPMV4_6ImageProcessorKwargs" not in verdict.reason, verdict
    with hotfix(m46, "force", fixes=("encoder_modes",)) as st:
        assert st.applied and all(row["applied"] for m, row in st.models.items() if m in views), st.models
        views = _base.member_modules(m46)
        for member, view in views.items():
            now = encoder_modes.probe(view)
            assert now.state is State.CORRECT, (member, now)
            assert "4x video 4" in now.reason, (member, now)  # the 4x video ran, with the member's image processor


def test_every_member_is_decided(m46):
    """Every family member gets ``broken`` or ``correct`` (never ``undetermined``), the verdict 4.6's, judged with
    transformers' own image processor for that model type (MiniCPM-OCR's on vLLM 0.34.0, whose own ``process_videos``
    hands it options it refuses), or 4.6's where transformers lacks the model, said in the reason; forced, every member
    re-probes ``correct`` with the 4x video run."""
    _member_verdicts_are_decided(m46)


@pytest.mark.placed(OCR_NARROW)
def test_every_member_is_decided_with_vllms_own_ocr_classes(m46):
    """The same on vLLM 0.33's own MiniCPM-OCR classes with transformers 5.24's MiniCPM-OCR: decided there too."""
    assert _transformers_has("MiniCPM-OCR")
    _member_verdicts_are_decided(m46)
