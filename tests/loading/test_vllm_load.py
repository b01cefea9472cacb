"""The whole vLLM model, built on CPU from the tiny checkpoint and loaded through its own top-level ``load_weights``
(the call vLLM's DefaultModelLoader makes): stock, ``auto``, ``force`` and ``off``, on the installed release."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from support import expected as table
from support.hotfix import SEED_ERA_ERROR, hotfix
from support.vllm_build import build_vllm_model, checkpoint_tensors, load_checkpoint

from vllm_minicpm_hotfix import decision
from vllm_minicpm_hotfix.fixes import _base, qkv_loader

PREFIX = "model.vision_tower.vit_merger.self_attn."


def load(model, ckpt) -> set[str]:
    """What vLLM's DefaultModelLoader does: the model's own load_weights over the streamed checkpoint."""
    return load_checkpoint(model, ckpt)


def assert_vit_merger_exact(model, ckpt) -> None:
    """qkv_proj == cat(q, k, v) and out_proj == out_proj of the checkpoint, bit for bit."""
    t = checkpoint_tensors(ckpt)
    attn = model.vit_merger.self_attn
    for suffix in ("weight", "bias"):
        want = torch.cat([t[f"{PREFIX}{p}_proj.{suffix}"] for p in "qkv"]).to(attn.qkv_proj.weight.dtype)
        got = getattr(attn.qkv_proj, suffix).detach()
        assert got.shape == want.shape
        assert torch.equal(got, want), f"qkv_proj.{suffix} != cat(q, k, v)"
        assert torch.equal(getattr(attn.out_proj, suffix).detach(), t[f"{PREFIX}out_proj.{suffix}"])
    # The q, k and v of the checkpoint differ, so an exact match above cannot come from a swapped shard.
    assert not torch.equal(t[f"{PREFIX}q_proj.weight"], t[f"{PREFIX}k_proj.weight"])
    assert not torch.equal(t[f"{PREFIX}k_proj.bias"], t[f"{PREFIX}v_proj.bias"])


@pytest.mark.stock_pin
def test_verdict_matches_release(m46, release, environment):
    expected = table.verdict("qkv_loader", environment), table.stock_load_error(environment)
    verdict = qkv_loader.probe(m46)
    print(f"\nvLLM {release}: verdict {verdict.state.value}: {verdict.reason}")
    assert verdict.state.value == expected[0]
    if expected[1] is not None:
        assert expected[1] in verdict.reason


@pytest.mark.stock_pin
def test_stock_load(m46, release, environment, checkpoint):
    """Stock vLLM fails where it is broken with the error users reported, and loads exactly where it is correct."""
    expected = None, table.stock_load_error(environment)
    model = build_vllm_model(checkpoint, load=False)
    if expected[1] is not None:
        with pytest.raises(ValueError, match=re.escape(expected[1])):
            load(model, checkpoint)
    else:
        load(model, checkpoint)
        assert_vit_merger_exact(model, checkpoint)


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_hotfix_load_exact(m46, expected, checkpoint, mode):
    with hotfix(m46, mode) as fix:
        assert fix.applied == (mode == "force" or expected[0] == "broken"), fix
        assert _base.is_patched(qkv_loader, m46) == fix.applied
        model = build_vllm_model(checkpoint, load=False)
        loaded = load(model, checkpoint)
        assert_vit_merger_exact(model, checkpoint)
        if fix.applied:  # the loader reports parameter names (0.22-0.24's own loop reports q_proj.* instead)
            assert {"vit_merger.self_attn.qkv_proj.weight", "vit_merger.self_attn.qkv_proj.bias"} <= loaded


def test_auto_leaves_correct_release_untouched(m46, expected):
    attn = getattr(m46, "MiniCPMV4_6ViTWindowAttentionSelfAttn")
    model_cls = getattr(m46, "MiniCPMV4_6ForConditionalGeneration")
    before = (dict(attn.__dict__), dict(model_cls.__dict__))
    with hotfix(m46, "auto") as fix:
        during = (dict(attn.__dict__), dict(model_cls.__dict__))
    assert (during == before) == (expected[0] == "correct"), fix


def test_off_does_nothing(m46, expected, tiny):
    with hotfix(m46, "off") as fix:
        assert not fix.applied and "off" in fix.why
        assert not _base.is_patched(qkv_loader, m46)
        model = build_vllm_model(tiny, load=False)
        if expected[1] is not None:
            with pytest.raises(ValueError, match=re.escape(expected[1])):
                load(model, tiny)


@pytest.fixture
def seed_era(m46, monkeypatch):
    """case-01's code state, rebuilt on the installed release: the self-attention has a fused ``qkv_proj`` and no
    ``load_weights`` of its own, and nothing stacks q/k/v anywhere (no stacked mapper rules, no
    ``_stack_vit_merger_qkv``). That is vLLM main before 0.22 (0.20.2rc1.dev418+g0fa888465), which cannot be
    installed here."""
    attn = getattr(m46, "MiniCPMV4_6ViTWindowAttentionSelfAttn")
    model_cls = getattr(m46, "MiniCPMV4_6ForConditionalGeneration")
    if "load_weights" in attn.__dict__:
        monkeypatch.delattr(attn, "load_weights")
    mapper = model_cls.hf_to_vllm_mapper
    if getattr(mapper, "orig_to_new_stacked", None):
        monkeypatch.setattr(model_cls, "hf_to_vllm_mapper", dataclasses.replace(mapper, orig_to_new_stacked={}))
    if hasattr(m46, "_stack_vit_merger_qkv"):
        monkeypatch.setattr(m46, "_stack_vit_merger_qkv", lambda weights: weights)
    return m46


def test_seed_era_main_build(seed_era, tiny):
    """case-01: stock fails with the reported error; the verdict is broken; the hotfix (auto) loads bit-exact."""
    model = build_vllm_model(tiny, load=False)
    with pytest.raises(ValueError, match=SEED_ERA_ERROR):
        load(model, tiny)
    verdict = qkv_loader.probe(seed_era)
    assert verdict.state is decision.State.BROKEN and SEED_ERA_ERROR in verdict.reason
    with hotfix(seed_era, "auto") as fix:
        assert fix.applied
        model = build_vllm_model(tiny, load=False)
        load(model, tiny)
        assert_vit_merger_exact(model, tiny)
