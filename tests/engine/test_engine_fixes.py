"""The engine-side fixes against the real vLLM of this environment, without an engine: vLLM's own
multimodal processor for the bundled tiny checkpoint (``MULTIMODAL_REGISTRY.create_processor``) and vLLM's own model
built on CPU from it (:mod:`vllm_build`), with the same batching the model runner uses
(``vllm.multimodal.utils.group_and_batch_mm_kwargs``) and the same merge that kills EngineCore
(``_merge_multimodal_embeddings``).

The references are independent of the fixes: the ``<|image_pad|>`` / ``<|video_pad|>`` tokens counted in the prompt
vLLM built, and the rows of the embeddings vLLM's real vision tower returns for each item encoded on its own. Each
defect is first shown on vLLM *without* the fix under test (only the two load fixes, ``qkv_loader`` and
``processor_downsample_mode``, applied where this environment needs them to process images at all: the baseline),
then with it.

* ``placeholder_guard``: requests whose placeholder count disagrees with their tensors (per release, from the notes
  and measured: ``{"max_slice_nums": 1}`` on 0.22-0.31, ``{"slice_mode": false}`` everywhere) -- the real merge raises
  the error that kills EngineCore; with the guard vLLM's processor raises one ``ValueError`` naming the item and both
  counts, on the uncached and the cached path (where a refused item must not be recorded as sent to the engine);
  requests whose counts agree come out bit-identical.
* ``encoder_modes``: a 16x and a 4x image in one encoder batch, and a 4x video.
* ``video_tower``: the model built with ``limit_mm_per_prompt={"image": 0, "video": 1}``.
* ``video_budget``: frames budgeted per video vs frames vLLM's loader samples, and a 32-frame video's embeddings vs
  the encoder budget vLLM computes from it.
"""

from __future__ import annotations

import contextlib
import dataclasses

from support import expected as table
import numpy as np
import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from vllm_minicpm_hotfix import hook, record
from vllm_minicpm_hotfix.fixes import _base, encoder_modes, placeholder_guard, video_budget, video_tower
from support.engine import OURS, KILL_REQUESTS, family, image, video, fixes, process, pads_in_prompt, embed, items_of, merge, sender_cache, model_config, mconfig, vproc, build_model, vmodel, fam, stock_verdict  # noqa: F401

# --------------------------------------------------------------------------------------------------------------------
# placeholder_guard
# --------------------------------------------------------------------------------------------------------------------

#: Seeded sizes (not hand-picked) for the count formula.
FORMULA_SIZES = [tuple(int(v) for v in row) for row in np.random.default_rng(2026).integers(1, 700, (8, 2))]


@pytest.mark.parametrize("mm_kwargs", [{}, {"downsample_mode": "4x"}], ids=["16x", "4x"])
def test_guard_count_is_the_vision_towers(m46, vproc, vmodel, mm_kwargs):
    """The guard's count from ``tgt_sizes`` equals the rows vLLM's real vision tower returns, per item."""
    rows = []
    with fixes(m46):
        for w, h in FORMULA_SIZES:
            out = process(vproc, {"image": [image(w, h)]}, mm_kwargs)
            ((_, item),) = items_of(out)
            want = int(embed(vmodel, [("image", item)])[0].shape[0])
            got, what = placeholder_guard.expected_embeddings("image", item, vproc.info.get_hf_config())
            rows.append(((w, h), got, want, what))
    print("\n" + "\n".join(map(str, rows)))
    assert all(got == want for _, got, want, _ in rows), rows


def test_stock_request_reaches_the_engine_and_kills_it(m46, vproc, vmodel, fam):
    """Without the guard, each engine-killing request of this family passes vLLM's processor; the real merge then
    raises what kills EngineCore (``Attempted to assign ... multimodal tokens to ... placeholders``)."""
    with fixes(m46):
        for mm_kwargs, pads, rows in KILL_REQUESTS[fam]:
            out = process(vproc, {"image": [image(224, 224)]}, mm_kwargs)
            emb = embed(vmodel, items_of(out))
            print(f"\n{mm_kwargs}: {pads_in_prompt(vproc, out)} pads, {emb[0].shape[0]} embeddings")
            assert (pads_in_prompt(vproc, out), int(emb[0].shape[0])) == (pads, rows), mm_kwargs
            with pytest.raises(ValueError, match=rf"Attempted to assign .*{rows}.* to {pads} placeholders"):
                merge(m46, vmodel, out, emb)


def test_guard_refuses_naming_item_and_counts(m46, vproc, fam):
    with fixes(m46, "placeholder_guard") as st:
        assert st["placeholder_guard"].applied
        for mm_kwargs, pads, rows in KILL_REQUESTS[fam]:
            # the bad image second: the message names its index in the request
            with pytest.raises(ValueError) as err:
                process(vproc, {"image": [image(100, 100), image(224, 224)]}, mm_kwargs)
            msg = str(err.value)
            print(f"\n{mm_kwargs}: {msg}")
            assert isinstance(err.value, placeholder_guard.PlaceholderMismatchError)
            assert f"image item 1 of this request has {pads} <|image_pad|> placeholder tokens" in msg
            assert f"give {rows} vision embeddings" in msg


def test_guard_cached_path_refuses_before_the_cache_records(m46, vproc, mconfig, fam):
    """Through vLLM's sender cache: the refused item is not recorded as sent (a second identical request is refused
    again, with its data, instead of reaching the engine as a cache reference); a good request is cached as usual."""
    cache = sender_cache(mconfig)
    mm_kwargs, pads, rows = KILL_REQUESTS[fam][0]
    with fixes(m46, "placeholder_guard"):
        for _ in range(2):
            with pytest.raises(ValueError, match=f"image item 0 of this request has {pads} .* give {rows} vision"):
                process(vproc, {"image": [image(224, 224)]}, mm_kwargs, cache=cache)
        first = process(vproc, {"image": [image(224, 224)]}, {}, cache=cache)
        again = process(vproc, {"image": [image(224, 224)]}, {}, cache=cache)
    assert first["mm_kwargs"]["image"][0] is not None
    assert again["mm_kwargs"]["image"][0] is None  # sent once, then a cache reference
    assert first["prompt_token_ids"] == again["prompt_token_ids"]


@pytest.mark.parametrize("mm_kwargs", [{}, {"downsample_mode": "4x"}, {"use_image_id": False}], ids=str)
def test_guard_leaves_agreeing_requests_bit_identical(m46, vproc, vmodel, mm_kwargs):
    items = {"image": [image(300, 60), image(224, 224)]}
    with fixes(m46):
        want = process(vproc, items, mm_kwargs)
    with fixes(m46, "placeholder_guard"):
        got = process(vproc, items, mm_kwargs)
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    for a, b in zip(got["mm_kwargs"]["image"], want["mm_kwargs"]["image"]):
        da, db = placeholder_guard.item_data(a), placeholder_guard.item_data(b)
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    # and the counts really agree: the merge accepts vLLM's own embeddings
    merge(m46, vmodel, got, embed(vmodel, items_of(got)))


def test_guard_catches_a_4x_video_without_a_video_flag(m46, vproc, environment):
    """Without ``encoder_modes`` a 0.22-0.31 video carries no mode: the guard counts it in the config's mode and
    refuses the 4x video (whose placeholder is sized for 4x); on 0.32+ vLLM's own flag makes the counts agree."""
    vid = video(1, 112, 112)
    with fixes(m46, "placeholder_guard"):
        if stock_verdict("encoder_modes", environment) == "broken":
            with pytest.raises(ValueError, match=r"video item 0 of this request has \d+ <\|video_pad\|>") as err:
                process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})
            print("\n" + str(err.value))
        else:
            process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})


# --------------------------------------------------------------------------------------------------------------------
# encoder_modes
# --------------------------------------------------------------------------------------------------------------------


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


def vision_reference(model, data: dict, mode: str, prefix: str = "video_") -> torch.Tensor:
    """The model's own vision tower on one processed item's slices in ``mode`` (``get_vision_hidden_states``, the
    tower, vit_merger and merger vLLM's ``embed_multimodal`` runs), concatenated: ``(tokens, hidden)``."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        return torch.cat(model.get_vision_hidden_states(
            {"pixel_values": list(data[f"{prefix}pixel_values"]), "tgt_sizes": data[f"{prefix}tgt_sizes"]},
            downsample_mode=mode))


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


# --------------------------------------------------------------------------------------------------------------------
# video_tower
# --------------------------------------------------------------------------------------------------------------------


def test_video_only_model_has_its_vision_tower(m46, vproc, vmodel):
    """``limit_mm_per_prompt={"image": 0, "video": 1}``: stock leaves the vision tower on the meta device (the first
    video dies there); with the fix it is built and loaded -- its weights equal the checkpoint's, and a video's
    embeddings equal those of the model built with images on."""
    from safetensors.torch import load_file

    with fixes(m46):
        out = process(vproc, {"video": [video(1, 112, 112)]}, {})
    stock = build_model(m46, image=0, video=1)
    # vLLM's placeholder for a skipped tower: no parameters of its own, the real module kept on the meta device
    assert type(stock.vpm).__name__ == "StageMissingLayer" and not list(stock.vpm.parameters())
    assert all(p.is_meta for p in stock.vpm.__dict__["module"].parameters())
    with pytest.raises(RuntimeError, match="meta") as err:
        embed(stock, items_of(out, "video"))
    print(f"\nstock, video only: {type(err.value).__name__}: {err.value}")
    del stock
    with hotfix(m46, "auto", fixes=("video_tower",)) as st:
        assert st.applied
        fixed = build_model(m46, image=0, video=1)
    # The real modules, as the model built with images on has them -- not vLLM's parameterless StageMissingLayer
    # (for which "no parameter is on meta" holds trivially) -- with every parameter loaded.
    for name in ("vpm", "vit_merger", "merger"):
        got, want = getattr(fixed, name), getattr(vmodel, name)
        assert type(got) is type(want) and type(got).__name__ != "StageMissingLayer", (name, type(got))
        params, ref_params = dict(got.named_parameters()), dict(want.named_parameters())
        assert params and params.keys() == ref_params.keys(), name
        assert not any(p.is_meta for p in params.values()), name
        assert all(torch.equal(params[k], ref_params[k]) for k in params), name
    ckpt = load_file(str(TINY / "model.safetensors"))
    key = next(k for k in ckpt if k.endswith("embeddings.patch_embedding.weight"))
    assert torch.equal(fixed.vpm.embeddings.patch_embedding.weight, ckpt[key])
    # Its outputs: the tower of the video-only model on the video's slices equals the normally built model's.
    data = placeholder_guard.item_data(out["mm_kwargs"]["video"][0])
    tower = vision_reference(fixed, data, "16x")
    assert tower.shape[0] > 0 and torch.equal(tower, vision_reference(vmodel, data, "16x"))
    assert torch.equal(embed(fixed, items_of(out, "video"))[0], embed(vmodel, items_of(out, "video"))[0])


# --------------------------------------------------------------------------------------------------------------------
# video_budget
# --------------------------------------------------------------------------------------------------------------------


def test_video_budget_covers_the_frames_vllm_loads(m46, vproc, mconfig):
    """The encoder budget vLLM computes for a video (``get_max_video_tokens``: frames x largest frame) against the embeddings of a
    video of as many frames as vLLM's loader samples (32, ``VideoMediaIO``'s default): stock budgets 16 frames and
    the video exceeds it (vLLM answers 400: 'exceeds the pre-allocated encoder cache size'); fixed, it fits."""
    info = vproc.info
    loads = video_budget.loader_default_frames()
    seq_len = mconfig.max_model_len
    counts = {"image": 1, "video": 1}
    with fixes(m46):
        stock_frames = info.get_num_frames_with_most_features(seq_len, counts)
        stock_budget = info.get_max_video_tokens(seq_len, counts)
        out = process(vproc, {"video": [video(loads, 448, 252)]}, {})
        need = pads_in_prompt(vproc, out, "video")
    with fixes(m46, "video_budget"):
        frames = info.get_num_frames_with_most_features(seq_len, counts)
        budget = info.get_max_video_tokens(seq_len, counts)
    print(f"\nloader {loads} frames; stock {stock_frames} frames / {stock_budget} tokens; fixed {frames} frames / "
          f"{budget} tokens; a {loads}-frame 448x252 video needs {need}")
    assert (stock_frames, frames) == (16, loads)
    assert stock_budget < need <= budget


def test_video_budget_never_lowers_and_follows_media_io_kwargs(m46):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    for num_frames, want in ((8, 16), (64, 64), (-1, 16)):
        info = MULTIMODAL_REGISTRY.create_processor(
            model_config(max_model_len=4096, media_io_kwargs={"video": {"num_frames": num_frames}})).info
        with fixes(m46, "video_budget"):
            assert info.get_num_frames_with_most_features(4096, {"video": 1}) == want, num_frames
    info = MULTIMODAL_REGISTRY.create_processor(model_config(max_model_len=700)).info
    with fixes(m46, "video_budget"):
        fit = info.get_max_video_frames(700 - info.get_max_image_tokens())
        assert fit < 16  # what fits bounds it, as in vLLM
        assert info.get_num_frames_with_most_features(700, {"image": 1, "video": 1}) == fit


# --------------------------------------------------------------------------------------------------------------------
# Modes, status, transactions
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_modes(m46, vproc, environment, mode, hotfix_mode):
    """The hook under each mode: ``off`` applies none of them (and a mismatching request passes the processor as
    stock), ``force`` all, ``auto`` exactly the ones pinned broken here; ``status()`` says so."""
    hotfix_mode(mode)
    try:
        hook.on_import(m46)
        st = record.current()
        for fix in OURS:
            entry = st.fixes[fix.NAME]
            want = {"off": False, "force": True, "auto": stock_verdict(fix.NAME, environment) == "broken"}[mode]
            assert entry.applied is want and _base.is_patched(fix, m46) is want, entry
            if mode == "auto" and not want:
                assert entry.verdict == "correct" and not _base.is_patched(fix, m46)
        if mode == "off":
            # processing needs the load fixes; apply just those to show the guard is not there
            _base.revert(m46)
            with fixes(m46):
                mm_kwargs, pads, _ = KILL_REQUESTS[family(environment[0])][0]
                out = process(vproc, {"image": [image(224, 224)]}, mm_kwargs)
                assert pads_in_prompt(vproc, out) == pads
    finally:
        _base.revert(m46)


def test_apply_is_all_or_nothing(m46, monkeypatch):
    """A failure setting the third of encoder_modes' attributes leaves all three as vLLM defined them."""
    before = {t: _base.resolve(m46, t) for t in encoder_modes.SETS}
    before = {t: getattr(o, a) for t, (o, a) in before.items()}

    def boom(original):
        raise RuntimeError("boom")

    monkeypatch.setattr(encoder_modes, "wrap_get_mm_fields_config", boom)
    with pytest.raises(RuntimeError, match="boom"):
        encoder_modes.apply(m46)
    after = {t: getattr(*_base.resolve(m46, t)) for t in encoder_modes.SETS}
    assert after == before
    assert not _base.is_patched(encoder_modes, m46)


def test_probes_are_cheap_and_leave_vllm_alone(m46):
    import time

    for fix in OURS:
        t = time.perf_counter()
        fix.probe(m46)
        dt = time.perf_counter() - t
        assert dt < 2.0, (fix.NAME, dt)
        assert not _base.is_patched(fix, m46)
