"""``lora_support``: vLLM's own LoRA start-up accepts the 4.6 model and wraps its language model for adapters.

What ``--enable-lora`` runs at start-up, without an engine: vLLM's model runner's ``LoRAModelRunnerMixin.
load_lora_model(model, vllm_config, device)`` (``vllm/v1/worker/lora_model_runner_mixin.py``) on vLLM's model built
on CPU from the bundled tiny checkpoint, with a real ``LoRAConfig``. Stock 0.22-0.24 raise ``ValueError:
MiniCPMV4_6ForConditionalGeneration does not support LoRA yet.`` there (the pinned ``broken`` rows of
tests/support/expected.py); with the fix (and stock 0.25+, where the class inherits ``SupportsLoRA``) vLLM's LoRA manager
wraps the language model's packed linear layers (``packed_modules_mapping``: ``qkv_proj``, ``gate_up_proj``,
``in_proj_qkvz``, ``in_proj_ba``) with its LoRA layers and, with ``enable_tower_connector_lora`` off, leaves the
vision tower and connectors alone. Cheap (no engine): every environment.

Greedy tokens of a peft-written adapter through ``vllm serve --enable-lora``, against transformers + peft:
tests/e2e/test_lora_serve.py (0.23.0).
"""

from __future__ import annotations

from support import expected as table
import pytest
import torch
from support.hotfix import hotfix
from support.paths import TINY
from vllm_minicpm_hotfix.fixes import lora_support

PACKED = ("qkv_proj", "gate_up_proj", "in_proj_qkvz", "in_proj_ba")


@pytest.fixture(scope="module")
def model(m46):
    from support.vllm_build import build_vllm_model

    with hotfix(m46, "auto", fixes=("qkv_loader",)):
        return build_vllm_model(TINY)


def lora_config():
    from vllm.config import DeviceConfig, LoRAConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(TINY), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                     max_model_len=512)
    return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                      lora_config=LoRAConfig(max_lora_rank=8, max_loras=1))


def start_lora(model):
    """What the model runner does at start-up with ``--enable-lora``: the model with vLLM's LoRA layers in place."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    cfg = lora_config()
    with set_current_vllm_config(cfg):
        return LoRAModelRunnerMixin().load_lora_model(model, cfg, torch.device("cpu"))


def test_lora_start_up_refused_stock_where_pinned_and_accepted_with_the_fix(m46, environment, model):
    broken = table.verdict(lora_support.NAME, environment) == "broken"
    if broken:
        with pytest.raises(ValueError, match="MiniCPMV4_6ForConditionalGeneration does not support LoRA yet"):
            start_lora(model)
    with hotfix(m46, "auto", fixes=(lora_support.NAME,)) as entry:
        assert entry.applied is broken, entry
        wrapped = start_lora(model)
        lora = {n: type(mod).__name__ for n, mod in wrapped.named_modules() if "LoRA" in type(mod).__name__}
        print(f"\n{len(lora)} LoRA layers: {sorted(set(lora.values()))}")
        lm_packed = [n for n, _ in wrapped.named_modules()
                     if n.startswith("language_model.") and n.rsplit(".", 1)[-1] in PACKED]
        assert lm_packed and all(n in lora for n in lm_packed), [n for n in lm_packed if n not in lora]
        assert not [n for n in lora if n.startswith(("vpm.", "vit_merger.", "merger."))]
        assert lora_support.probe(m46).state.value == "correct"
    from vllm.model_executor.models import supports_lora

    assert supports_lora(m46.MiniCPMV4_6ForConditionalGeneration) is (not broken)  # reverted: vLLM's own class
