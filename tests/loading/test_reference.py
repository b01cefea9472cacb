"""Numerics against the reference: vLLM's window merger, loaded through the hotfix where vLLM needs it, computes what
transformers' own ``MiniCPMV4_6ViTWindowAttentionMerger`` computes on the same input (float32, within 1e-5)."""

from __future__ import annotations

import pytest
import torch
from support.hotfix import hotfix
from support.vllm_build import build_vllm_model, load_checkpoint, prepare_for_forward

H, W = 4, 6  # patch grid of one image: 6 windows of 2x2


@pytest.fixture(scope="module")
def models(m46, tiny):
    import transformers

    with hotfix(m46, "auto"):
        vllm_model = build_vllm_model(tiny, load=False)
        load_checkpoint(vllm_model, tiny)
    prepare_for_forward(vllm_model, "vit_merger")
    hf = transformers.MiniCPMV4_6ForConditionalGeneration.from_pretrained(
        tiny, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    (hf_merger,) = [m for n, m in hf.named_modules() if n.endswith("vit_merger")]
    return vllm_model.vit_merger, hf_merger


def windows(x: torch.Tensor) -> torch.Tensor:
    """[1, H*W, D] patch sequence -> [H/2 * W/2, 4, D] 2x2 windows, row-major (vLLM's _apply_window_attention)."""
    d = x.shape[-1]
    return x.view(H // 2, 2, W // 2, 2, d).permute(0, 2, 1, 3, 4).reshape(-1, 4, d)


@pytest.fixture(scope="module")
def x(models) -> torch.Tensor:
    d = models[1].embed_dim
    return torch.randn(1, H * W, d, generator=torch.Generator().manual_seed(1234))


@torch.no_grad()
def test_self_attention_matches_hf(models, x):
    vllm_merger, hf_merger = models
    w = windows(x)
    ours = vllm_merger.self_attn(w)
    cu = torch.arange(0, w.shape[0] * 4 + 1, 4, dtype=torch.int32)
    ref, _ = hf_merger.self_attn(w.reshape(1, -1, w.shape[-1]), cu_seqlens=cu, max_seqlen=4)
    assert ours.shape == w.shape
    torch.testing.assert_close(ours.reshape(ref.shape), ref, atol=1e-5, rtol=0)
    assert ref.abs().max() > 1e-3  # a real signal, not two zero tensors


@torch.no_grad()
def test_whole_window_merger_block_matches_hf(models, x):
    vllm_merger, hf_merger = models
    ours, new_sizes, _ = vllm_merger(x, torch.tensor([[H, W]]), None)
    ref = hf_merger(x, torch.tensor([[H, W]], dtype=torch.int32))
    assert new_sizes.tolist() == [[H // 2, W // 2]]
    assert ours.shape == ref.shape == (1, H * W // 4, x.shape[-1])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
