"""Nothing silent on correct releases either: the q/k/v completeness guard (vllm_minicpm_hotfix/fixes/qkv_completeness_guard.py),
and a light subset of the bad-checkpoint outcomes of tests/loading/test_reliability.py, on every release, in this process.

Each bad checkpoint is a small copy of the bundled one with one thing wrong, loaded the way a vLLM worker loads it at
start-up (``get_model_loader(load_config).load_model``: vLLM's safetensors iterator, the model's ``load_weights``,
vLLM's "weights not initialized" check), with every fix of the registry applied as the post-import hook applies them.
Under ``auto`` the q/k/v completeness is checked on every release: by the q/k/v loader where vLLM's own loading is
broken (0.25-0.29), by the guard where it is correct (0.22-0.24, 0.30+). Stock vLLM (``off``) is asserted too: where its
loading is correct it loads the incomplete checkpoints without an error and the missing rows keep what the parameter
held before (uninitialised memory in a real start-up; -7 here).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from safetensors.torch import save_file
from support.vllm_build import build_vllm_model, checkpoint_tensors

from support.bad_checkpoints import (  # the bad checkpoints' builders and vLLM's two ways of loading them
    fused_only,
    load_like_vllm,
    start_up,
    without,
    write_checkpoint,
)

from vllm_minicpm_hotfix.fixes import qkv_completeness_guard as qkv_guard
from vllm_minicpm_hotfix.fixes.qkv_loader import QKVLoadError

P = "model.vision_tower.vit_merger.self_attn."
QKV = ("q", "k", "v")
GUARD = qkv_guard.NAME
INCOMPLETE = "vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
NEVER = (
    "vit_merger q/k/v never loaded: ['vit_merger.self_attn.qkv_proj.weight', 'vit_merger.self_attn.qkv_proj.bias'] "
    "received no q_proj/k_proj/v_proj (or qkv_proj) tensor from the checkpoint and would keep uninitialised values"
)
#: What the loader adds after a shard's name where vLLM >= 0.30 renamed q/k/v before handing them over.
RENAMED = r"( \(renamed by vLLM to qkv_proj\.(weight|bias)\))?"


def wrong_q_shape(base: dict) -> dict:
    return {**base, P + "q_proj.weight": torch.randn(65, 64, generator=torch.Generator().manual_seed(5))}


CHECKPOINTS = {
    "complete": lambda b: b,
    "missing_k_bias": lambda b: without(b, P + "k_proj.bias"),
    "missing_k_weight": lambda b: without(b, P + "k_proj.weight"),
    "no_qkv": lambda b: without(b, *(f"{P}{p}_proj.{s}" for p in QKV for s in ("weight", "bias"))),
    "fused_only": fused_only,
    "wrong_q_shape": wrong_q_shape,
    "bf16": lambda b: {k: v.to(torch.bfloat16) for k, v in b.items()},
}


@pytest.fixture(scope="module")
def base() -> dict[str, torch.Tensor]:
    return checkpoint_tensors(TINY)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, base):
    """``ckpt(name)`` -> a folder with the tiny model's config.json and checkpoint ``name`` (written once)."""
    root = tmp_path_factory.mktemp("guard-checkpoints")
    return functools.cache(lambda name: write_checkpoint(root / name, CHECKPOINTS[name](base)))


def start_up_fails(path: Path, error: type[BaseException]) -> str:
    with pytest.raises(BaseException) as info:
        start_up(path)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    print(f"\n{type(info.value).__name__}: {info.value}")
    return str(info.value)


def params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------------------------
# The decision, composed with the q/k/v loader fix
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_which_check_is_on(m46, expected, mode):
    """auto: the loader where vLLM's loading is broken, the guard where it is correct -- exactly one of them. force:
    the loader everywhere, and the guard not stacked on it (not applicable: the loader refuses already). off: none."""
    with hotfix(m46, mode, fixes=None) as st:
        qkv, guard = st["qkv_loader"], st[GUARD]
        if mode == "off":
            assert not qkv.applied and not guard.applied
            return
        if mode == "force" or expected[0] == "broken":
            assert qkv.applied and not guard.applied, (qkv, guard)
            assert guard.verdict == "correct" and "already refuses" in guard.reason, guard
            assert not qkv_guard.probe(m46).applicable
        else:
            assert guard.applied and not qkv.applied, (qkv, guard)
            assert guard.verdict == "broken" and "without an error" in guard.reason, guard
        print(f"\n{mode}: q/k/v loader {qkv.applied}, guard {guard.applied}: {guard.why}")


# --------------------------------------------------------------------------------------------------------------------
# A missing shard: stock is silent where its loading is correct; auto and force raise one clear error
# --------------------------------------------------------------------------------------------------------------------


#: vLLM's "weights not initialized" check (``DefaultModelLoader.track_weights_loading``) names a shard a stacked
#: layer (``StackedColumnParallelLinear``) received none of, from vLLM 0.34.0 on; 0.22-0.33 exempt the whole layer.
LOADER_REFUSES_A_MISSING_SHARD = ((0, 34), "Following weights were not initialized from checkpoint: "
                                           "{'vit_merger.self_attn.qkv_proj.bias.k'}")


def loader_refuses_a_missing_shard(release: str) -> bool:
    return tuple(int(x) for x in release.split(".")[:2]) >= LOADER_REFUSES_A_MISSING_SHARD[0]


def test_stock_loads_incomplete_checkpoints_silently(m46, expected, ckpt, release):
    """Stock vLLM through its model loader (``load_weights``, then the "weights not initialized" check), the path a
    user's load takes. Without k_proj.bias: 0.25-0.29 fail every split q/k/v checkpoint anyway; 0.22-0.24 and
    0.30-0.33 load it (the k rows of the bias keep what they held); 0.34+ refuse it in the loader's check, naming
    ``qkv_proj.bias.k``. Without any q/k/v it loads on every release, 0.34 and the broken ones included (nothing trips
    over a k_proj name, and the check leaves a layer that received no shard to its per-parameter rule, which exempts
    it): qkv_proj keeps what it held -- so the guard stays needed on 0.34 (its probe: broken)."""
    with hotfix(m46, "off", fixes=None):
        if expected[1] is not None:  # 0.25-0.29: stock fails on every split q/k/v checkpoint
            with pytest.raises(ValueError, match=re.escape(expected[1])):
                load_like_vllm(ckpt("missing_k_bias"))
        elif loader_refuses_a_missing_shard(release):
            with pytest.raises(ValueError) as info:
                load_like_vllm(ckpt("missing_k_bias"))
            print(f"\nmissing k_proj.bias: {type(info.value).__name__}: {info.value}")
            assert str(info.value) == LOADER_REFUSES_A_MISSING_SHARD[1]
        else:
            b = load_like_vllm(ckpt("missing_k_bias")).vit_merger.self_attn.qkv_proj.bias.detach()
            assert torch.equal(b[64:128], torch.full((64,), -7.0))
            assert not torch.equal(b[:64], torch.full((64,), -7.0))  # q and v were loaded
        qkv = load_like_vllm(ckpt("no_qkv")).vit_merger.self_attn.qkv_proj
    assert torch.equal(qkv.weight.detach(), torch.full_like(qkv.weight, -7.0))
    assert torch.equal(qkv.bias.detach(), torch.full_like(qkv.bias, -7.0))


def test_probe_judges_through_the_model_loader(m46, expected, release):
    """The probe's verdict and reason follow what stock vLLM's load (measured above) does with each incomplete set:
    where the loader's check refuses a missing shard (0.34+) the probe says so and is still ``broken`` for the set
    with no q/k/v at all; elsewhere both sets load silently (or, 0.25-0.29, nothing split loads: not applicable)."""
    got = qkv_guard.probe(m46)
    print(f"\n{got.state.value}: {got.reason}")
    if expected[1] is not None:
        assert got.state.value == "correct" and not got.applicable, got
        return
    assert got.state.value == "broken", got
    assert "lets no q/k/v tensor at all" in got.reason or "and no q/k/v tensor at all through" in got.reason, got
    refuses = "it refuses the six q/k/v tensors without k_proj.bias: vLLM's model loader refuses it (ValueError: " \
              + LOADER_REFUSES_A_MISSING_SHARD[1] + ")"
    assert (refuses in got.reason) is loader_refuses_a_missing_shard(release), got


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_missing_k_proj_bias_raises(m46, expected, ckpt, mode):
    with hotfix(m46, mode, fixes=None) as st:
        guarded = st[GUARD].applied  # (revert marks the entry "reverted" on leaving)
        msg = start_up_fails(ckpt("missing_k_bias"), QKVLoadError)
    if guarded:
        assert msg == INCOMPLETE + "vit_merger.self_attn.qkv_proj.bias: shard(s) 'k' missing (received 'q', 'v')"
    else:
        assert re.fullmatch(re.escape(INCOMPLETE) + r"vit_merger\.self_attn\.qkv_proj\.bias: shard\(s\) 'k' missing "
                            rf"\(received 'q' from 'q_proj\.bias{RENAMED}', 'v' from 'v_proj\.bias{RENAMED}'\)", msg), msg


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_no_qkv_at_all_raises(m46, ckpt, mode):
    with hotfix(m46, mode, fixes=None):
        assert start_up_fails(ckpt("no_qkv"), QKVLoadError) == NEVER


def test_missing_k_proj_weight_raises_under_auto(m46, ckpt):
    with hotfix(m46, "auto", fixes=None) as st:
        guarded = st[GUARD].applied
        msg = start_up_fails(ckpt("missing_k_weight"), QKVLoadError)
    assert msg.startswith(INCOMPLETE + "vit_merger.self_attn.qkv_proj.weight: shard(s) 'k' missing (received 'q'"), msg
    assert ("'v')" if guarded else "v_proj.weight") in msg


def test_load_model_hands_out_nothing_when_the_guard_raises(m46, expected, ckpt, monkeypatch):
    """The guard raises inside ``load_weights``, so ``load_model`` never reaches post-processing or returns."""
    from vllm.model_executor.model_loader import base_loader

    ran = []
    real = base_loader.process_weights_after_loading
    monkeypatch.setattr(base_loader, "process_weights_after_loading", lambda *a, **k: ran.append(1) or real(*a, **k))
    with hotfix(m46, "auto", fixes=None):
        start_up_fails(ckpt("missing_k_bias"), QKVLoadError)
    assert ran == []


# --------------------------------------------------------------------------------------------------------------------
# A good checkpoint: the guard changes nothing
# --------------------------------------------------------------------------------------------------------------------


def test_guard_changes_nothing_on_good_checkpoints(m46, expected, ckpt):
    """Where the guard applies, every parameter equals stock vLLM's load of the same checkpoint (split, case-04's
    fused, bf16), what ``load_weights`` returns is the same, and every observed weight loader is put back."""
    if expected[0] == "broken":  # the guard is not applicable here: stock fails on every split checkpoint
        with hotfix(m46, "force", fixes=(GUARD,)) as guard:
            assert not guard.applied and "not applicable" in guard.why, guard
        return
    for name in ("complete", "fused_only", "bf16"):
        with hotfix(m46, "off", fixes=None):
            stock = params(load_like_vllm(ckpt(name)))
        with hotfix(m46, "auto", fixes=None) as st:
            assert st[GUARD].applied
            model = build_vllm_model(ckpt(name), load=False)
            qkv = model.vit_merger.self_attn.qkv_proj
            before = {n: p.__dict__.get("weight_loader", getattr(p, "_weight_loader", None))
                      for n, p in qkv.named_parameters()}
            with torch.no_grad():
                qkv.weight.fill_(-7.0)
                qkv.bias.fill_(-7.0)
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader import get_model_loader

            with set_current_vllm_config(model.vllm_config):
                get_model_loader(model.vllm_config.load_config).load_weights(model, model.vllm_config.model_config)
            after = {n: p.__dict__.get("weight_loader", getattr(p, "_weight_loader", None))
                     for n, p in qkv.named_parameters()}
        got = params(model)
        assert got.keys() == stock.keys()
        assert [n for n in stock if not torch.equal(got[n], stock[n])] == [], name
        assert all(after[n] is before[n] and before[n] is not None for n in before), (before, after)


def test_later_loads(m46, expected, ckpt, base):
    """After a complete load, a load that brings no vit_merger tensor (a partial weight update) is fine; one that
    brings some shards of a parameter but not all is not -- with whichever check auto turned on here."""
    with hotfix(m46, "auto", fixes=None):
        model = build_vllm_model(ckpt("complete"))
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(model.vllm_config):
            lm = [(k, v) for k, v in base.items() if k.startswith("model.language_model.")]
            model.load_weights(iter(lm))
            with pytest.raises(QKVLoadError, match=r"qkv_proj\.weight: shard\(s\) 'q', 'v' missing"):
                model.load_weights(iter([(P + "k_proj.weight", base[P + "k_proj.weight"])]))


# --------------------------------------------------------------------------------------------------------------------
# The light subset of tests/loading/test_reliability.py's bad checkpoints, under auto, on every release
# --------------------------------------------------------------------------------------------------------------------


def test_case04_fused_only_loads_exact(m46, ckpt, base):
    with hotfix(m46, "auto", fixes=None):
        model = load_like_vllm(ckpt("fused_only"))
    attn = model.vit_merger.self_attn
    for s in ("weight", "bias"):
        assert torch.equal(getattr(attn.qkv_proj, s).detach(), torch.cat([base[f"{P}{p}_proj.{s}"] for p in QKV]))


def test_bf16_checkpoint_is_cast_like_vllm(m46, ckpt, base):
    with hotfix(m46, "auto", fixes=None):
        model = load_like_vllm(ckpt("bf16"))
    w = model.vit_merger.self_attn.qkv_proj.weight.detach()
    assert w.dtype == torch.float32
    assert torch.equal(w, torch.cat([base[f"{P}{p}_proj.weight"] for p in QKV]).to(torch.bfloat16).float())


def test_wrong_q_shape(m46, expected, ckpt, base):
    """The loader refuses it (naming both shapes); where vLLM's own loading runs (auto on a correct release) vLLM's
    ``QKVParallelLinear`` narrows the oversized shard to its first 64 rows without an error -- a shape check is not
    the guard's job (it checks which shards arrived), so this one stays silent there: docs/what-can-go-wrong.md."""
    with hotfix(m46, "auto", fixes=None) as st:
        if st["qkv_loader"].applied:
            msg = start_up_fails(ckpt("wrong_q_shape"), QKVLoadError)
            assert "checkpoint shape [65, 64] but vit_merger.self_attn.qkv_proj.weight needs [64, 64]" in msg
            return
        model = load_like_vllm(ckpt("wrong_q_shape"))
    w = model.vit_merger.self_attn.qkv_proj.weight.detach()
    assert torch.equal(w[:64], wrong_q_shape(base)[P + "q_proj.weight"][:64])


def test_probe_reason_is_json_serialisable(m46):
    json.dumps(qkv_guard.probe(m46).reason)


# --------------------------------------------------------------------------------------------------------------------
# A quantized vit_merger q/k/v (GPTQ): the guard observes vLLM's quantized parameters too
# --------------------------------------------------------------------------------------------------------------------

QUANT_DTYPE = "bfloat16"  # GPTQ takes half/bfloat16 activations only
#: Each quantized qkv_proj parameter and the dimension along which vLLM stacks q, k, v (GPTQ packs the input rows).
GPTQ_QKV = {"qweight": 1, "scales": 1, "qzeros": 1, "bias": 0}


@pytest.fixture(scope="module")
def gptq_vitqkv(tmp_path_factory) -> dict[str, Path]:
    """The tiny checkpoint with the language model and the vit_merger q/k/v packed GPTQ (tests/support/quant_checkpoints.py,
    tests/fixes/test_quantized_vision.py's ``gptq_vitqkv``): complete, and without ``k_proj.qweight`` (its scales and zeros kept,
    so k is still a quantized shard to vLLM and to the quantized_vision fix)."""
    from support import quant_checkpoints as qc

    root = tmp_path_factory.mktemp("guard-gptq")
    complete = root / "complete"
    qc.write_checkpoint(TINY, complete, method="gptq", quantization_config=qc.GPTQ_CONFIG,
                        quantize=lambda m: qc.is_lm_quantized(m) or m in qc.VIT_MERGER_QKV)
    missing = shutil.copytree(complete, root / "missing_k_qweight")
    tensors = without(qc.read_tensors(complete), P + "k_proj.qweight")
    save_file(tensors, str(missing / "model.safetensors"), {"format": "pt"})
    return {"complete": complete, "missing_k_qweight": missing}


def load_quantized(path: Path):
    """Built as vLLM builds a quantized model, loaded with vLLM's ``DefaultModelLoader.load_weights``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    model = build_vllm_model(path, dtype=QUANT_DTYPE, load=False)
    vc = model.vllm_config
    with set_current_vllm_config(vc):
        get_model_loader(vc.load_config).load_weights(model, vc.model_config)
    return model


def test_quantized_qkv_loads_exact_under_auto(m46, gptq_vitqkv):
    """Every fix under auto (the guard where vLLM's q/k/v loading is correct, the loader where it is broken): each
    GPTQ part of the vit_merger's qkv_proj equals the checkpoint's q, k, v stacked, bit for bit."""
    from support import quant_checkpoints as qc

    ckpt = qc.read_tensors(gptq_vitqkv["complete"])
    with hotfix(m46, "auto", fixes=None) as st:
        assert st["qkv_loader"].applied or st[GUARD].applied, st
        qkv = load_quantized(gptq_vitqkv["complete"]).vit_merger.self_attn.qkv_proj
    for suffix, dim in GPTQ_QKV.items():
        got = getattr(qkv, suffix).detach()
        want = torch.cat([ckpt[f"{P}{p}_proj.{suffix}"] for p in QKV], dim=dim)
        assert torch.equal(got, want.to(got.dtype)), suffix


def test_quantized_qkv_missing_k_raises_under_auto(m46, expected, gptq_vitqkv):
    """Without ``k_proj.qweight``: stock vLLM loads it where its own q/k/v loading is correct (GPTQ's method has
    post-processing, so vLLM's "weights not initialized" check exempts it too); auto refuses, naming the quantized
    parameter and the missing shard."""
    path = gptq_vitqkv["missing_k_qweight"]
    if expected[1] is None:
        with hotfix(m46, "off", fixes=None):
            load_quantized(path)
    with hotfix(m46, "auto", fixes=None):
        with pytest.raises(QKVLoadError) as info:
            load_quantized(path)
    msg = str(info.value)
    print(f"\n{msg}")
    assert msg.startswith(INCOMPLETE + "vit_merger.self_attn.qkv_proj.qweight: shard(s) 'k' missing (received 'q'"), msg
    assert not any(f"qkv_proj.{s}" in msg for s in ("scales", "qzeros", "bias")), msg


@pytest.mark.placed("0.33.0:tf5.24.0")  # vLLM's own OCR classes with a transformers that reads the checkpoint
def test_ocr_checkpoint_missing_k_proj_bias_raises(m46, tmp_path, monkeypatch):
    """An OCR checkpoint without ``vit_merger.self_attn.k_proj.bias``: vLLM 0.33's own load leaves the k rows of
    ``qkv_proj.bias`` as they were (its "weights not initialized" check exempts the layer); with the hotfix
    ``qkv_completeness_guard``, which declares MiniCPM-OCR (its ``load_weights`` is 4.6's), refuses the checkpoint
    naming the parameter and the missing shard; without the declaration it loads as stock does."""
    import torch
    from safetensors.torch import load_file, save_file
    from support.backport47 import write_checkpoint as write_member
    from support.vllm_build import build_vllm_model, load_checkpoint

    guard = qkv_guard
    ocr = importlib.import_module("vllm.model_executor.models.minicpm_ocr")
    bad = write_member(tmp_path / "missing-k-bias", member="ocr")
    (weights,) = bad.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.vision_tower.vit_merger.self_attn.k_proj.bias"]
    save_file(tensors, weights, metadata={"format": "pt"})

    def load() -> torch.Tensor:
        model = build_vllm_model(bad, load=False, model_cls=ocr.MiniCPMOcrForConditionalGeneration)
        bias = model.vit_merger.self_attn.qkv_proj.bias
        with torch.no_grad():
            bias.fill_(-7.0)
        load_checkpoint(model, bad)
        return bias.detach()

    with hotfix(m46, "off", fixes=None):
        k = load()[bias_rows(tensors)]
        assert torch.equal(k, torch.full_like(k, -7.0))  # stock: the k rows keep what they held
    with hotfix(m46, "auto", fixes=None) as statuses:
        assert statuses[guard.NAME].models["MiniCPM-OCR"]["applied"], statuses[guard.NAME].models
        with pytest.raises(QKVLoadError, match=re.escape("vit_merger.self_attn.qkv_proj.bias: shard(s) 'k' missing")):
            load()
    monkeypatch.setattr(guard, "MODELS", tuple(m for m in guard.MODELS if m != "MiniCPM-OCR"))
    with hotfix(m46, "auto", fixes=None):
        k = load()[bias_rows(tensors)]
        assert torch.equal(k, torch.full_like(k, -7.0))


def bias_rows(tensors: dict) -> slice:
    """The k rows of the fused ``qkv_proj.bias``: after q's."""
    n = tensors["model.vision_tower.vit_merger.self_attn.q_proj.bias"].shape[0]
    return slice(n, 2 * n)
