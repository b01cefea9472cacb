"""The loader alone, on the real vLLM self-attention module (its real ``QKVParallelLinear`` / ``RowParallelLinear``
and their weight loaders) of a model built from the tiny checkpoint: every input shape the loader accepts, and every
bad input it must refuse with one clear error."""

from __future__ import annotations

import pytest
import torch
from support.vllm_build import build_vllm_model, checkpoint_tensors

from vllm_minicpm_hotfix.fixes.qkv_loader import QKVLoadError, load_session, load_weights

PREFIX = "model.vision_tower.vit_merger.self_attn."


@pytest.fixture(scope="module")
def ckpt(tiny):
    """The self-attention's tensors from the checkpoint, with the module prefix stripped (as vLLM hands them)."""
    return {k[len(PREFIX):]: v for k, v in checkpoint_tensors(tiny).items() if k.startswith(PREFIX)}


@pytest.fixture
def attn(tiny):
    model = build_vllm_model(tiny, load=False)
    a = model.vit_merger.self_attn
    with torch.no_grad():  # a known non-checkpoint state, so "unchanged" is checkable
        for p in a.parameters():
            p.fill_(-7.0)
    return a


def fused(ckpt, suffix):
    return torch.cat([ckpt[f"{p}_proj.{suffix}"] for p in "qkv"])


def assert_exact(attn, ckpt):
    for suffix in ("weight", "bias"):
        assert torch.equal(getattr(attn.qkv_proj, suffix).detach(), fused(ckpt, suffix))
        assert torch.equal(getattr(attn.out_proj, suffix).detach(), ckpt[f"out_proj.{suffix}"])


def split_items(ckpt):
    return sorted(ckpt.items())


def test_split_qkv_loads_exact_and_returns_parameter_names(attn, ckpt):
    consumed = []

    def gen():
        for item in split_items(ckpt):
            consumed.append(item[0])
            yield item

    loaded = load_weights(attn, gen())
    assert loaded == {"qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias"}
    assert len(consumed) == len(ckpt) == 8
    assert_exact(attn, ckpt)


def test_prestacked_with_shard_id_loads_exact(attn, ckpt):
    """How vLLM >= 0.30 hands them over: ``qkv_proj.*`` with ``tensor.shard_id`` set."""
    items = []
    for name, t in split_items(ckpt):
        head, _, suffix = name.partition(".")
        if head in ("q_proj", "k_proj", "v_proj"):
            t = t.clone()
            t.shard_id = head[0]
            name = f"qkv_proj.{suffix}"
        items.append((name, t))
    assert load_weights(attn, iter(items)) == {"qkv_proj.weight", "qkv_proj.bias", "out_proj.weight", "out_proj.bias"}
    assert_exact(attn, ckpt)


def test_already_fused_checkpoint_loads_exact(attn, ckpt):
    """case-04: a checkpoint re-saved with one fused qkv_proj tensor."""
    items = [(f"qkv_proj.{s}", fused(ckpt, s)) for s in ("weight", "bias")]
    items += [(f"out_proj.{s}", ckpt[f"out_proj.{s}"]) for s in ("weight", "bias")]
    load_weights(attn, iter(items))
    assert_exact(attn, ckpt)


def test_other_dtype_is_cast_like_vllm(attn, ckpt):
    items = [(n, t.to(torch.bfloat16)) for n, t in split_items(ckpt)]
    load_weights(attn, iter(items))
    for suffix in ("weight", "bias"):
        want = torch.cat([ckpt[f"{p}_proj.{suffix}"].to(torch.bfloat16) for p in "qkv"]).float()
        assert torch.equal(getattr(attn.qkv_proj, suffix).detach(), want)


def test_any_suffix_goes_through_qkv_weight_loader_with_shard_id(attn, ckpt):
    """Quantized checkpoints carry other suffixes (``scales``, ``qweight``, ...): each must reach the parameter of
    that name through ``QKVParallelLinear.weight_loader`` with its shard id."""
    qkv = attn.qkv_proj
    rows = qkv.weight.shape[0]
    scales = torch.nn.Parameter(torch.zeros(rows), requires_grad=False)
    scales.output_dim = 0
    scales.weight_loader = qkv.weight_loader
    qkv.register_parameter("scales", scales)
    per = {p: torch.randn(rows // 3, generator=torch.Generator().manual_seed(i)) for i, p in enumerate("qkv")}
    items = split_items(ckpt) + [(f"{p}_proj.scales", per[p]) for p in "qkv"]
    loaded = load_weights(attn, iter(items))
    assert "qkv_proj.scales" in loaded
    assert torch.equal(qkv.scales.detach(), torch.cat([per["q"], per["k"], per["v"]]))


def test_missing_shard_names_parameter_and_shard(attn, ckpt):
    items = [(n, t) for n, t in split_items(ckpt) if n != "k_proj.weight"]
    with pytest.raises(QKVLoadError, match=r"vit_merger\.self_attn\.qkv_proj\.weight: shard\(s\) 'k' missing"):
        load_weights(attn, iter(items))


def test_missing_bias_shard(attn, ckpt):
    items = [(n, t) for n, t in split_items(ckpt) if n != "v_proj.bias"]
    with pytest.raises(QKVLoadError, match=r"qkv_proj\.bias: shard\(s\) 'v' missing"):
        load_weights(attn, iter(items))


def test_duplicate_shard_is_refused(attn, ckpt):
    items = split_items(ckpt) + [("q_proj.weight", ckpt["q_proj.weight"])]
    with pytest.raises(QKVLoadError, match=r"shard 'q' of vit_merger\.self_attn\.qkv_proj\.weight arrived twice"):
        load_weights(attn, iter(items))


def test_fused_next_to_split_is_a_duplicate(attn, ckpt):
    items = split_items(ckpt) + [("qkv_proj.bias", fused(ckpt, "bias"))]
    with pytest.raises(QKVLoadError, match="arrived twice"):
        load_weights(attn, iter(items))


def test_unknown_name_lists_parameters(attn, ckpt):
    items = split_items(ckpt) + [("z_proj.weight", ckpt["q_proj.weight"])]
    with pytest.raises(QKVLoadError, match=r"'vit_merger\.self_attn\.z_proj\.weight'.*matches no parameter.*'qkv_proj\.weight'"):
        load_weights(attn, iter(items))


def test_wrong_shape_names_tensor_shard_and_both_shapes(attn, ckpt):
    q = ckpt["q_proj.weight"]
    bad = torch.zeros(q.shape[0] + 2, q.shape[1])
    items = [(n, bad if n == "q_proj.weight" else t) for n, t in split_items(ckpt)]
    want = (
        rf"q_proj\.weight -> vit_merger\.self_attn\.qkv_proj\.weight \(shard 'q'\): checkpoint shape "
        rf"\[{q.shape[0] + 2}, {q.shape[1]}\] but vit_merger\.self_attn\.qkv_proj\.weight needs \[{q.shape[0]}, "
        rf"{q.shape[1]}\]"
    )
    with pytest.raises(QKVLoadError, match=want):
        load_weights(attn, iter(items))


def test_wrong_out_proj_shape_is_one_clear_error(attn, ckpt):
    o = ckpt["out_proj.weight"]
    items = [(n, o[:, :-1] if n == "out_proj.weight" else t) for n, t in split_items(ckpt)]
    with pytest.raises(QKVLoadError, match=rf"out_proj\.weight.*checkpoint shape \[{o.shape[0]}, {o.shape[1] - 1}\]"):
        load_weights(attn, iter(items))


def test_bad_shard_id_attribute(attn, ckpt):
    t = ckpt["q_proj.weight"].clone()
    t.shard_id = "x"
    with pytest.raises(QKVLoadError, match="carries shard_id 'x'"):
        load_weights(attn, iter([("qkv_proj.weight", t)]))


def test_shards_split_over_two_calls_complete_within_one_session(attn, ckpt):
    """A checkpoint sharded over files can reach the module in two calls (AutoWeightsLoader groups consecutive
    names only); the model-level session judges completeness over both."""
    items = split_items(ckpt)
    first = [(n, t) for n, t in items if n.startswith(("k_proj", "out_proj"))]
    rest = [(n, t) for n, t in items if not n.startswith(("k_proj", "out_proj"))]
    with load_session():
        load_weights(attn, iter(first))
        load_weights(attn, iter(rest))
    assert_exact(attn, ckpt)
    with pytest.raises(QKVLoadError, match="missing"):
        load_weights(attn, iter(first))  # alone, outside a session: incomplete
