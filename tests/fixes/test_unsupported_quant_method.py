"""``unsupported_quant_method`` on the installed vLLM, module level: a checkpoint whose ``quant_method`` this vLLM lacks
(bitsandbytes NF4, written from the bundled tiny checkpoint by :mod:`support.quant_checkpoints`, or any unknown
method) gets one error naming what loads; where vLLM still has bitsandbytes (<= 0.26) its own outcome stands."""

from __future__ import annotations

from pathlib import Path
import pytest
from support import quant_checkpoints as qc
from support.hotfix import hotfix
from support.observed import observed
from support.paths import TINY
from support.vllm_build import build_vllm_model
from vllm_minicpm_hotfix import quant_layout


DTYPE = "bfloat16"  # GPTQ/AWQ take half/bfloat16 activations only
#: Releases whose vLLM still has bitsandbytes (its quantization registry; removed in 0.27).
HAS_BNB = {"0.22.1", "0.23.0", "0.24.0", "0.26.0"}
#: What those do with the NF4 checkpoint in this CPU environment, which has no bitsandbytes package: vLLM builds the
#: layers with BitsAndBytesLinearMethod, whose constructor requires it.
BNB_MISSING = "Please install bitsandbytes"


@pytest.fixture(scope="module")
def bnb(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bnb")
    qc.write_bnb(TINY, out)
    return out


def _model_config(folder: Path):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype=DTYPE, enforce_eager=True)


def test_bitsandbytes(m46, release, bnb):
    storage = quant_layout.vision_storage(bnb)
    assert storage["model.merger.mlp.0.linear_1"].quantized  # transformers quantizes the vision side too
    if release in HAS_BNB:
        for mode in ("off", "auto"):
            with hotfix(m46, mode, fixes=None):
                with pytest.raises(ImportError, match=BNB_MISSING):
                    build_vllm_model(bnb, dtype=DTYPE, load=False)
        observed("checkpoints", "bnb", stock="needs the bitsandbytes package", hotfix="same (not a hotfix matter)")
        return
    with pytest.raises(Exception, match="Unknown quantization method: bitsandbytes") as stock_info:
        _model_config(bnb)
    assert "GPTQ" not in str(stock_info.value)
    with hotfix(m46, "auto", fixes=("unsupported_quant_method",)) as status:
        assert status.applied, status
        with pytest.raises(Exception) as info:
            _model_config(bnb)
    text = str(info.value)
    assert "quant_method='bitsandbytes'" in text and str(bnb) in text, text
    assert "'gptq'" in text and "'awq'" in text and "bf16" in text, text
    assert text.count("MiniCPM-V 4.6 checkpoint") == 1
    observed("checkpoints", "bnb", stock="fails: Unknown quantization method", hotfix="one error naming what loads")


def test_any_unknown_method_is_explained(m46, release, tmp_path):
    """Any quant_method the installed vLLM lacks gets the explanation, not only bitsandbytes. Where vLLM still has
    bitsandbytes the fix's probe finds nothing to do under ``auto``: vLLM's own error stands."""
    import json

    other = tmp_path / "other"
    qc.write_bnb(TINY, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "no_such_method"
    (other / "config.json").write_text(json.dumps(cfg))
    with hotfix(m46, "auto", fixes=("unsupported_quant_method",)) as status:
        applied = status.applied  # (the status says reverted once the context is left)
        with pytest.raises(Exception) as info:
            _model_config(other)
    text = str(info.value)
    if release in HAS_BNB:
        assert not applied, status
        assert "Unknown quantization method: no_such_method" in text and "MiniCPM-V 4.6" not in text, text
        return
    assert applied, status
    assert "quant_method='no_such_method'" in text and "MiniCPM-V 4.6 checkpoint" in text, text
