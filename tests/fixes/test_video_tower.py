"""``video_tower`` against the real vLLM of this environment, without an engine: the model built with
``limit_mm_per_prompt={"image": 0, "video": 1}`` has its vision tower and encodes a video as vLLM's processor sends
it (:mod:`support.engine`)."""

from __future__ import annotations

import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from vllm_minicpm_hotfix.fixes import placeholder_guard
from support.engine import (  # noqa: F401 - fixtures
    vision_reference, video, fixes, process, embed, items_of, mconfig, vproc, build_model, vmodel,
)


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
