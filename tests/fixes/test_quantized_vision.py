"""Quantized MiniCPM-V 4.6 checkpoints on the installed vLLM, module level: the real model built from a
real ``ModelConfig`` / ``VllmConfig`` the way vLLM's DefaultModelLoader builds it (``configure_quant_config``, then the
class), loaded through its own top-level ``load_weights``. No engine (that is ``tests/e2e/test_quantized_engine.py``).

The checkpoints are written here from the bundled tiny one (:mod:`quant_checkpoints`): the language model's linear
layers packed GPTQ / AWQ from integer codes chosen by the test, the vision tower, vit_merger and merger bf16 -- the
published layout (GPTQModel's and AutoAWQ's MiniCPM-V 4.6 quantize the language model only). Every expectation below
is checked against those checkpoint tensors; the stock failures per environment are in tests/data/stock.json.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from support import expected as table
from support import quant_checkpoints as qc
from support.hotfix import hotfix
from support.observed import observed
from support.paths import TINY
from support.vllm_build import build_vllm_model, load_checkpoint

from vllm_minicpm_hotfix import decision, quant_layout
from vllm_minicpm_hotfix.cli import quant_report
from vllm_minicpm_hotfix.fixes._base import MARKER_ATTR, deferred
from vllm_minicpm_hotfix.fixes import quantized_vision as qv

DTYPE = "bfloat16"  # GPTQ/AWQ take half/bfloat16 activations only
ATTN = "MiniCPMV4_6ViTWindowAttentionSelfAttn"
QKQKV = f"There is no module or parameter named 'qkqkv_proj' in {ATTN}"
K_PROJ = f"There is no module or parameter named 'k_proj' in {ATTN}"
NO_DATA = "'QKVParallelLinear' object has no attribute 'data'"
NO_KERNEL = "Failed to find a kernel that can implement the WNA16 linear layer"
FC1_MISSING_A = "'encoder.layers.0.mlp.fc1.weight'"  # KeyError (<= 0.24) / no module or parameter named ... (>= 0.25)

#: What stock vLLM does with each layout, per environment, is recorded in tests/data/stock.json (``quantized``: None --
#: it loads -- or [stage, text of the error], stage "build" or "load"); :func:`stock_outcome` observes it.

#: GPTQModel-style module list (a recipe some users follow): substrings, so it also matches the vision attention.
GPTQ_LIST = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]  # fmt: skip
#: The skip list in transformers' names (in_proj_b / in_proj_a: 2 rows in the tiny model, too few to pack).
AWQ_SKIP = ["model.vision_tower", "model.merger", "lm_head", "linear_attn.in_proj_b", "linear_attn.in_proj_a"]
UNALIGNED = 80  # vision intermediate size: a multiple of 16 like the real 4304, not of 32


def _unaligned(tensors: dict, config: dict) -> None:
    config["vision_config"]["intermediate_size"] = UNALIGNED
    n4 = 4 * UNALIGNED  # the vit_merger's MLP is 4x the vision intermediate size
    for k in list(tensors):
        if ".mlp.fc1." in k:
            tensors[k] = tensors[k][:UNALIGNED].contiguous()
        elif ".mlp.fc2.weight" in k:
            tensors[k] = tensors[k][:, :UNALIGNED].contiguous()
        elif k.startswith("model.vision_tower.vit_merger.linear_1."):
            tensors[k] = tensors[k][:n4].contiguous()
        elif k == "model.vision_tower.vit_merger.linear_2.weight":
            tensors[k] = tensors[k][:, :n4].contiguous()


LAYOUTS = {
    "gptq": dict(method="gptq", quantize=qc.is_lm_quantized, quantization_config=qc.GPTQ_CONFIG),
    "gptq_list": dict(method="gptq", quantize=qc.is_lm_quantized,
                      quantization_config=dict(qc.GPTQ_CONFIG, modules_in_block_to_quantize=GPTQ_LIST)),
    "gptq_vitqkv": dict(method="gptq", quantize=lambda m: qc.is_lm_quantized(m) or m in qc.VIT_MERGER_QKV,
                        quantization_config=qc.GPTQ_CONFIG),
    "awq": dict(method="awq", quantize=qc.is_lm_quantized,
                quantization_config=dict(qc.AWQ_CONFIG, modules_to_not_convert=AWQ_SKIP)),
    "awq_unaligned": dict(method="awq", quantize=qc.is_lm_quantized,
                          quantization_config=dict(qc.AWQ_CONFIG, modules_to_not_convert=AWQ_SKIP),
                          transform=_unaligned),
}  # fmt: skip


#: Where vLLM builds MiniCPM-V 4.7 (and its model on CPU): the 4.7 source checkpoint joins the layouts there.
V47_RELEASES = ("0.32.0",)


@pytest.fixture(scope="session", params=["4.6", pytest.param("4.7", marks=pytest.mark.placed(*V47_RELEASES))])
def source(request, tmp_path_factory) -> Path:
    """The float checkpoint the layouts are written from: the bundled 4.6 one, or the tiny 4.7 one transformers
    writes (``scripts/make_tiny_checkpoint.py --member 4.7``, same sizes and names)."""
    if request.param == "4.6":
        return TINY
    from support import tiny_checkpoints

    return tiny_checkpoints.write(tmp_path_factory.mktemp("tiny-v47") / "ckpt", "--member", "4.7")


@pytest.fixture(scope="session")
def written(source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, spec in LAYOUTS.items():
        qc.write_checkpoint(source, root / name, **spec)
        out[name] = root / name
    return out


def stock_outcome(ckpt: Path):
    """What the installed vLLM does with ``ckpt`` as it is now: ``(None, model)`` -- built and loaded -- or
    ``(["build" | "load", the error's text (``expected.error_text``)], model or None)``."""
    try:
        model = build_vllm_model(ckpt, dtype=DTYPE, load=False, model_cls=model_class(ckpt))
    except Exception as exc:  # noqa: BLE001 - what stock vLLM raises is the observation
        return ["build", table.error_text(exc)], None
    try:
        load_checkpoint(model, ckpt)
    except Exception as exc:  # noqa: BLE001
        return ["load", table.error_text(exc)], model
    return None, model


def agrees(seen: list | None, want: list | None) -> bool:
    """A recorded outcome holds for an observed one: both load, or the same stage with the recorded text in the error."""
    return (seen is None) == (want is None) and (seen is None or (seen[0] == want[0] and want[1] in seen[1]))


@contextlib.contextmanager
def hotfixed(m46, mode: str = "auto"):
    """Both loading fixes as the post-import hook applies them under ``VLLM_MINICPM_HOTFIX=mode``; reverted after.
    Yields ``{NAME: FixStatus}``."""
    with hotfix(m46, mode, fixes=("qkv_loader", qv.NAME)) as status:
        yield status


def json_arch(ckpt: Path) -> str:
    import json

    return json.loads((Path(ckpt) / "config.json").read_text())["architectures"][0]


def model_class(ckpt: Path):
    """vLLM's model class for the checkpoint's architecture: ``MiniCPMV4_6ForConditionalGeneration`` in
    ``minicpmv4_6.py``, ``MiniCPMV4_7ForConditionalGeneration`` in ``minicpmv4_7.py`` (where vLLM registers them)."""
    import importlib

    arch = json_arch(ckpt)
    tag = arch.removeprefix("MiniCPMV").split("For")[0].lower()  # "4_6" / "4_7"
    return getattr(importlib.import_module(f"vllm.model_executor.models.minicpmv{tag}"), arch)


def build_and_load(ckpt: Path):
    model = build_vllm_model(ckpt, dtype=DTYPE, load=False, model_cls=model_class(ckpt))
    assert type(model).__name__ == json_arch(ckpt), type(model)
    load_checkpoint(model, ckpt)
    return model


# --------------------------------------------------------------------------------------------------------------------
# Reference values: vLLM's parameters from the checkpoint's own tensors (names mapped here, independently)
# --------------------------------------------------------------------------------------------------------------------

_TO_HF = (("language_model.model.", "model.language_model."), ("vit_merger.", "model.vision_tower.vit_merger."),
          ("vpm.", "model.vision_tower."), ("merger.", "model.merger."))  # fmt: skip
_PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
           "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}  # fmt: skip


def hf_modules(vllm_module: str) -> list[str]:
    for new, old in _TO_HF:
        if vllm_module.startswith(new):
            base = old + vllm_module[len(new) :]
            head, _, last = base.rpartition(".")
            return [f"{head}.{s}" for s in _PACKED.get(last, (last,))]
    raise AssertionError(f"no checkpoint name for {vllm_module}")


def expected(param_name: str, ckpt: dict) -> torch.Tensor:
    """The checkpoint's value for vLLM parameter ``param_name``: fused shards concatenated along the output dim
    (dim 0 of a float ``weight``/``bias``; dim 1 of ``qweight``/``qzeros``/``scales``, whose layouts put the output
    last); ``g_idx`` is per input column, the same for every shard."""
    module, _, suffix = param_name.rpartition(".")
    parts = [ckpt[f"{m}.{suffix}"] for m in hf_modules(module)]
    if suffix == "g_idx":
        assert all(torch.equal(p, parts[0]) for p in parts)
        return parts[0]
    return torch.cat(parts, dim=1 if suffix in ("qweight", "qzeros", "scales") else 0)


def assert_params_exact(model, ckpt: dict, prefixes: tuple[str, ...], suffixes: tuple[str, ...] | None = None) -> int:
    """Every parameter under ``prefixes`` (with a suffix in ``suffixes``) equals its checkpoint value bit for bit."""
    n = 0
    for name, p in model.named_parameters():
        if not name.startswith(prefixes) or (suffixes and name.rpartition(".")[2] not in suffixes):
            continue
        want = expected(name, ckpt)
        got = p.detach()
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs checkpoint {tuple(want.shape)}"
        assert got.dtype == want.dtype or got.is_floating_point(), f"{name}: dtype {got.dtype} vs {want.dtype}"
        assert torch.equal(got.to(want.dtype) if want.is_floating_point() else got, want), f"{name} != checkpoint"
        n += 1
    return n


VISION = ("vpm.", "vit_merger.", "merger.")
LM_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


# --------------------------------------------------------------------------------------------------------------------
# The checkpoints themselves
# --------------------------------------------------------------------------------------------------------------------


def test_packing_is_independently_checkable(written):
    """Unpacking every packed tensor with plain shifts gives back the codes, and the dequantized weight is exactly
    representable in bf16; the vision side is stored as float (bf16) in every layout."""
    for name in ("gptq", "awq"):
        t = qc.read_tensors(written[name])
        module = "model.language_model.layers.1.self_attn.q_proj"
        unpack = qc.unpack_gptq if name == "gptq" else qc.unpack_awq
        codes, zeros, scales = unpack({s: t[f"{module}.{s}"] for s in ("qweight", "qzeros", "scales")})
        assert codes.shape == (256, 64) and zeros.shape == (2, 256) and int(codes.min()) >= 0 and int(codes.max()) <= 15
        assert len(torch.unique(codes)) > 8  # not a degenerate constant code
        w = qc.dequantize(codes, zeros, scales)
        assert torch.equal(w.to(torch.bfloat16).float(), w)
        storage = quant_layout.vision_storage(written[name])
        assert storage and not any(s.quantized for s in storage.values())
        if name == "gptq":
            assert torch.equal(t[f"{module}.g_idx"], torch.arange(64, dtype=torch.int32) // qc.GROUP)
            assert int(t[f"{module}.qzeros"][0, 0]) == 0x77777777  # symmetric: zero 8 stored as 7 (v1)


# --------------------------------------------------------------------------------------------------------------------
# Stock vLLM, as the release table says
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.stock_pin
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stock(m46, written, environment, layout):
    seen, model = stock_outcome(written[layout])
    want = table.pin(environment, ("quantized", layout), seen)
    assert agrees(seen, want), f"stock vLLM: {seen}; recorded: {want}"
    if want is None:
        assert json_arch(written[layout]) == type(model).__name__, type(model)
        assert_params_exact(model, qc.read_tensors(written[layout]), VISION)
        observed("checkpoints", layout, stock="loads")
        return
    assert (model is None) == (want[0] == "build")
    observed("checkpoints", layout, stock=f"fails ({'constructing the model' if want[0] == 'build' else 'loading'})")


def test_probe_stock_and_patched(m46, monkeypatch):
    verdict = qv.probe(m46)
    assert verdict.state is decision.State.BROKEN, verdict
    assert "model.vision_tower" in verdict.reason
    monkeypatch.setattr(deferred, "EAGER", True)  # probed and applied at import, as doctor's re-probe needs
    with hotfixed(m46, "force") as status:
        assert not status[qv.NAME].first_use and status[qv.NAME].applied, status
        assert qv.probe(m46).state is decision.State.CORRECT
    assert qv.probe(m46).state is decision.State.BROKEN  # reverted


def test_probe_deferred_to_first_use(m46):
    """By default the hook does not probe: it sets a trigger on the model's ``__init__`` that hands an unquantized
    construction to vLLM's own ``__init__`` untouched and runs the real probe at the first quantized one. Until then
    the probe judges vLLM as shipped (the trigger is not the fix); resolving applies the fix as the hook would."""
    model_cls = getattr(m46, qv.MODEL_CLASS)
    stock_init = vars(model_cls)["__init__"]
    with hotfixed(m46) as status:
        entry = status[qv.NAME]
        assert (entry.verdict, entry.applied, entry.first_use) == ("deferred", False, True), entry
        assert deferred.is_trigger(vars(model_cls)["__init__"]) and deferred.pending(qv.NAME)
        assert vars(model_cls)["__init__"].__wrapped__ is stock_init
        assert qv.probe(m46).state is decision.State.BROKEN  # the trigger is not the fix
        assert not qv.uses_path(object(), vllm_config=type("C", (), {"quant_config": None})(), prefix="")
        assert deferred.resolve(qv.NAME) is entry and not deferred.pending(qv.NAME)
        assert (entry.verdict, entry.applied) == ("broken", True), entry
        assert vars(model_cls)["__init__"].__wrapped__ is stock_init and not deferred.is_trigger(vars(model_cls)["__init__"])
        assert qv.probe(m46).state is decision.State.CORRECT
    assert vars(model_cls)["__init__"] is stock_init
    with hotfixed(m46):  # reverted before first use: nothing left pending
        pass
    assert not deferred.pending(qv.NAME) and vars(model_cls)["__init__"] is stock_init


# --------------------------------------------------------------------------------------------------------------------
# With the hotfix (auto)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["gptq", "gptq_list"])
def test_gptq_loads_exact(m46, written, layout):
    ckpt = qc.read_tensors(written[layout])
    with hotfixed(m46):
        model = build_and_load(written[layout])
    # vit_merger: qkv_proj == cat(q, k, v), bit for bit (bf16 checkpoint into a bf16 model), and all other vision
    n_vision = assert_params_exact(model, ckpt, VISION)
    qkv = model.vit_merger.self_attn.qkv_proj
    want = torch.cat([ckpt[f"model.vision_tower.vit_merger.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv.weight.detach(), want) and n_vision > 20
    # every language-model quantized tensor as stored (fused layers: the shards concatenated)
    n_lm = assert_params_exact(model, ckpt, ("language_model.",), LM_QUANT_SUFFIXES)
    quantized_layers = [n for n, m in model.named_modules() if n.startswith("language_model.") and hasattr(m, "qweight")]
    assert len(quantized_layers) == 8 and n_lm >= 3 * len(quantized_layers), (quantized_layers, n_lm)
    # the vision side was built unquantized, as stored
    assert not any(hasattr(m, "qweight") for n, m in model.named_modules() if n.startswith(VISION))
    # our loader is attached to the vit_merger self-attention only: no language-model class carries a patch
    lm_attn = type(model.language_model.model.layers[1].self_attn)
    lm_qkv = type(model.language_model.model.layers[1].self_attn.qkv_proj)
    for cls in (lm_attn, lm_qkv, type(model.language_model)):
        assert not any(getattr(v, MARKER_ATTR, None) for v in vars(cls).values()), cls
    observed("checkpoints", layout, hotfix="loads, exact")


def test_vit_merger_qkv_quantized(m46, written):
    """q/k/v of the vit_merger stored GPTQ: each suffix lands in qkv_proj as its shard, values as stored."""
    ckpt = qc.read_tensors(written["gptq_vitqkv"])
    with hotfixed(m46):
        model = build_and_load(written["gptq_vitqkv"])
    qkv = model.vit_merger.self_attn.qkv_proj
    assert hasattr(qkv, "qweight") and not hasattr(qkv, "weight")
    n = assert_params_exact(model, ckpt, ("vit_merger.self_attn.qkv_proj.",))
    assert n >= 4  # qweight, qzeros, scales, bias (+ g_idx where vLLM keeps it)
    for suffix in ("qweight", "scales"):  # shard order q, k, v along the output dim: a swapped shard fails here
        parts = [ckpt[f"model.vision_tower.vit_merger.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
        assert not torch.equal(parts[0], parts[1])
        got = getattr(qkv, suffix).detach()
        assert torch.equal(got[:, 64:128].to(parts[1].dtype), parts[1])
    assert_params_exact(model, ckpt, ("vit_merger.self_attn.out_proj.", "vpm.", "merger."))
    observed("checkpoints", "gptq_vitqkv", hotfix="loads, exact")


@pytest.mark.parametrize("layout", ["awq", "awq_unaligned"])
def test_awq_loads_vision_exact(m46, written, layout):
    ckpt = qc.read_tensors(written[layout])
    with hotfixed(m46) as status:
        # probed at first use: the hook only set the trigger; the quantized model's construction runs the probe
        assert status[qv.NAME].verdict == "deferred" and not status[qv.NAME].applied, status
        model = build_and_load(written[layout])
        assert status[qv.NAME].first_use and status[qv.NAME].verdict == "broken" and status[qv.NAME].applied, status
    assert assert_params_exact(model, ckpt, VISION) > 20
    assert not any(hasattr(m, "qweight") for n, m in model.named_modules() if n.startswith(VISION))
    assert assert_params_exact(model, ckpt, ("language_model.",), ("qweight", "qzeros", "scales")) >= 24
    rows = getattr(model, qv.ROWS_ATTR)
    assert {r.layer for r in rows} >= {"vpm.encoder.layers.0.mlp.fc1", "vit_merger.self_attn.qkv_proj"}
    assert all(r.stored == "float" and r.built == "UnquantizedLinearMethod" and r.agrees for r in rows)
    observed("checkpoints", layout, hotfix="loads, exact")


def test_quantized_plain_linear_is_refused(m46, written, tmp_path):
    """A checkpoint that stores the merger quantized (vLLM's merger is a plain nn.Linear): one clear error at
    construction naming the layer and its tensors, not an assertion inside the weight loader."""
    bad = tmp_path / "merger-quantized"
    spec = dict(LAYOUTS["awq"], quantize=lambda m: qc.is_lm_quantized(m) or m == "model.merger.mlp.0.linear_1")
    qc.write_checkpoint(TINY, bad, **spec)
    with hotfixed(m46), pytest.raises(qv.QuantizedVisionError) as info:
        build_vllm_model(bad, dtype=DTYPE, load=False)
    assert "merger.mlp.0.linear_1" in str(info.value) and "qweight I32" in str(info.value)


@pytest.mark.stock_pin
def test_off_leaves_stock(m46, written, environment):
    with hotfixed(m46, "off"):
        seen, _ = stock_outcome(written["awq"])
    want = table.pin(environment, ("quantized", "awq"), seen)
    assert want is not None and agrees(seen, want), f"under off: {seen}; recorded stock: {want}"


# --------------------------------------------------------------------------------------------------------------------
# What doctor --model / verify --model report (quant_report), against the checkpoints written here
# --------------------------------------------------------------------------------------------------------------------


def test_layout_report_rows(m46, written):
    """The report says, layer by layer, how the checkpoint stores each vision linear layer and what vLLM builds:
    for the AWQ checkpoint stock vLLM disagrees on every vpm / vit_merger.self_attn layer, the hotfix on none."""
    rep = quant_report.report(written["awq"], hotfix=False)
    stock, fixed = rep["stock"], rep["hotfix"]
    names = {r.layer for r in stock}
    assert {"vpm.encoder.layers.0.self_attn.qkv_proj", "vpm.encoder.layers.1.mlp.fc2", "vit_merger.self_attn.qkv_proj",
            "vit_merger.linear_1", "merger.mlp.0.linear_2"} <= names, names
    assert all(r.stored == "float" for r in stock)
    quantized_stock = {r.layer for r in stock if r.built_quantized}
    assert quantized_stock == {n for n in names if n.startswith(("vpm.", "vit_merger.self_attn."))}
    assert {r.layer for r in stock if r.agrees is False} == quantized_stock
    assert all(r.agrees for r in fixed), [r for r in fixed if not r.agrees]
    agrees, lines = quant_report.report_lines(rep)
    assert not agrees and "DISAGREE (stock)" in lines[1] and "stock vLLM builds 10 quantized" in lines[0], lines
    assert quant_report.report_lines(dict(rep, active="hotfix"))[0] is True
    # the vit_merger q/k/v stored GPTQ: both agree on that layer (vLLM reads GPTQ dtypes itself when there is no list)
    rep = quant_report.report(written["gptq_vitqkv"], hotfix=True)
    row = {r.layer: r for r in rep["hotfix"]}["vit_merger.self_attn.qkv_proj"]
    assert row.stored == "quantized" and row.built_quantized and row.agrees
    assert quant_report.report(TINY) == {"quant_method": None}
