"""``lora_tower``: a LoRA adapter of the MiniCPM-V vision tower, which vLLM's LoRA manager cannot apply, is
refused with one clear error instead of being loaded and silently ignored; ``enable_tower_connector_lora`` gets a
clear error instead of vLLM's ``TypeError``.

What a worker runs, without an engine: vLLM's model runner's ``LoRAModelRunnerMixin.load_lora_model`` (the LoRA
manager wraps the model) on vLLM's model built on CPU from the bundled tiny checkpoint, then its
``LRUCacheWorkerLoRAManager.add_adapter`` with an adapter that peft writes for the vision tower's attention and MLP
layers (tests/support/lora_tower_adapter.py, a fresh interpreter with peft from tests/support/peft_site.py) -- the call behind a
``--lora-modules`` adapter at start-up and ``POST /v1/load_lora_adapter``. The reference for "ignored" is vLLM's
own manager: the adapter's tower weights are loaded, and none of its layers is a LoRA layer and no punica wrapper
serves the tower (``punica_wrapper_mapping`` holds the language model only).

Stock (every fix applied but this one), on every environment: the tower adapter is accepted (``add_adapter`` is
True) and ignored; with ``enable_tower_connector_lora`` 0.22-0.28 die in ``get_punica_wrapper`` with a ``TypeError``
and 0.30+ ignore the flag (the model says it does not support it). With the fix: ``add_adapter`` raises naming the
adapter, the tower modules and the model; the manager still takes an adapter afterwards; and the flag is a clear
error where vLLM would die.

In the API server: vLLM's own ``OpenAIServingModels.load_lora_adapter`` (the call behind ``POST
/v1/load_lora_adapter`` and ``--lora-modules``) with a stand-in for the engine client that records ``add_lora``.
Stock sends the tower adapter on to the engine ("added successfully"); with the fix it is vLLM's 400
``BadRequestError`` with the guard's text, and nothing reaches the engine.

Cheap (no engine; one peft interpreter, ~10 s): every environment; the probe's import check (a fresh vLLM
interpreter) on three.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from support import expected as table
import pytest
import torch
from support.hotfix import hotfix
from support.paths import REPO, TINY
from support.venvs import clean_env
from support.peft_site import peft_site
from support.programs import run_reporting
from vllm_minicpm_hotfix.fixes import lora_tower, names

OTHERS = tuple(n for n in names() if n != lora_tower.NAME)
TOWER = ("vpm.", "vit_merger.", "merger.")
#: What stock start-up with enable_tower_connector_lora does is recorded per environment in tests/data/stock.json
#: (``lora_tower_flag``): the exception's class name (TypeError on 0.22-0.28, the stub's None reaching
#: get_punica_wrapper / max()) or None (0.30+: the flag is ignored with a warning).


@pytest.fixture(scope="module")
def tower_adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("tower-lora") / "tower"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "lora_tower_adapter.py"), str(TINY), str(out)],
                          env=clean_env(PYTHONPATH=str(peft_site())), capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])["modules"]
    assert len(modules) == 12, modules  # 2 layers x (q, k, v, out, fc1, fc2)
    return out


def fresh_model(m46):
    """vLLM's model of the tiny checkpoint (the LoRA manager replaces its layers in place: one per start). Built
    outside any other ``hotfix`` block (leaving this one reverts every fix)."""
    from support.vllm_build import build_vllm_model

    with hotfix(m46, "auto", fixes=("qkv_loader",)):
        return build_vllm_model(TINY)


def start(model, tower_connector: bool):
    """What the model runner does at start-up with ``--enable-lora`` (and ``--enable-tower-connector-lora``): the
    runner, whose ``lora_manager`` is vLLM's ``LRUCacheWorkerLoRAManager``."""
    from vllm.config import DeviceConfig, LoRAConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    mc = ModelConfig(model=str(TINY), dtype="float32", enforce_eager=True, max_model_len=512)
    cfg = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                     lora_config=LoRAConfig(max_lora_rank=8, max_loras=1,
                                            enable_tower_connector_lora=tower_connector))
    runner = LoRAModelRunnerMixin()
    with set_current_vllm_config(cfg):
        runner.load_lora_model(model, cfg, torch.device("cpu"))
    return runner


def request(path, lora_id: int = 1):
    from vllm.lora.request import LoRARequest

    return LoRARequest("tower", lora_id, str(path))


def tower_layers(runner) -> list[str]:
    manager = runner.lora_manager._adapter_manager
    return [n for n, mod in manager.model.named_modules() if n.startswith(TOWER) and "LoRA" in type(mod).__name__]


def test_tower_adapter_ignored_stock_and_refused_with_the_fix(m46, environment, tower_adapter):
    assert table.verdict(lora_tower.NAME, environment) == "broken"
    stock_model, fixed_model = fresh_model(m46), fresh_model(m46)
    with hotfix(m46, "auto", fixes=OTHERS):  # stock LoRA machinery (lora_support where the class needs it)
        runner = start(stock_model, tower_connector=False)
        loaded = runner.lora_manager._load_adapter(request(tower_adapter))
        assert sorted(loaded.loras) and all(n.startswith("vpm.encoder.layers.") for n in loaded.loras), loaded.loras
        assert runner.lora_manager.add_adapter(request(tower_adapter)) is True  # accepted ...
        manager = runner.lora_manager._adapter_manager
        assert list(manager.punica_wrapper_mapping) == ["language_model"]  # ... and no wrapper serves the tower
        assert tower_layers(runner) == []
    with hotfix(m46, "auto", fixes=None) as entries:
        assert entries[lora_tower.NAME].applied
        runner = start(fixed_model, tower_connector=False)
        with pytest.raises(lora_tower.TowerLoRAError) as err:
            runner.lora_manager.add_adapter(request(tower_adapter))
        text = str(err.value)
        print(f"\n{text}")
        assert f"LoRA adapter 'tower' ({tower_adapter})" in text
        assert "12 module(s) of the MiniCPM-V 4.6 vision tower" in text
        assert "vpm.encoder.layers.0.mlp.fc1" in text and "language model of MiniCPM-V 4.6 only" in text
        assert runner.lora_manager.list_adapters() == set()
        # The manager keeps working: an adapter of the language model (vLLM's own dummy LoRA) is still taken.
        from vllm.lora.request import LoRARequest

        assert runner.lora_manager.add_dummy_lora(LoRARequest("lm", 2, "/not/a/path"), rank=8)
    assert lora_tower.probe(m46).state.value == "broken"  # reverted: vLLM's own classes


@pytest.mark.stock_pin
def test_tower_connector_flag_is_a_clear_error_where_vllm_dies(m46, environment, tower_adapter):
    stock_model, fixed_model = fresh_model(m46), fresh_model(m46)
    with hotfix(m46, "auto", fixes=OTHERS):
        try:
            runner, raised = start(stock_model, tower_connector=True), None
        except Exception as exc:  # noqa: BLE001 - what stock start-up raises is the observation
            runner, raised = None, exc
        seen = None if raised is None else type(raised).__name__
        stock = table.pin(environment, ("lora_tower_flag",), seen)
        assert seen == stock, f"stock start-up: {raised!r}; recorded: {stock}"
        if stock is None:
            assert list(runner.lora_manager._adapter_manager.punica_wrapper_mapping) == ["language_model"]
            assert runner.lora_manager.add_adapter(request(tower_adapter)) is True
    with hotfix(m46, "auto", fixes=None):
        if stock is None:  # vLLM ignores the flag itself; the adapter is refused at load
            runner = start(fixed_model, tower_connector=True)
            with pytest.raises(lora_tower.TowerLoRAError, match="language model of MiniCPM-V 4.6 only"):
                runner.lora_manager.add_adapter(request(tower_adapter))
        else:
            with pytest.raises(lora_tower.TowerLoRAError) as err:
                start(fixed_model, tower_connector=True)
            print(f"\n{err.value}")
            assert "--enable-tower-connector-lora: MiniCPM-V 4.6 (MiniCPMV4_6ForConditionalGeneration)" in str(err.value)
            assert "Start without --enable-tower-connector-lora" in str(err.value)


@pytest.mark.placed("0.22.1", "0.28.0", "0.33.0")
def test_probe_imports_no_lora_code(m46):
    """The probe runs in every vLLM process: it must not import vLLM's LoRA modules (~0.13 s of CPU). A fresh
    interpreter per run (~10 s), so on the first, a middle and the last release only."""
    out, log = run_reporting("lora_probe_imports", env=clean_env(PYTHONPATH=str(REPO), VLLM_MINICPM_HOTFIX="off"))
    assert out == {"verdict": "broken", "imported": []}, log[-3000:]


class EngineClient:
    """Stands in for the API server's engine client (an ``AsyncLLM``): the model config ``OpenAIServingModels``
    reads, and ``add_lora``, which records what would be sent to the engine. What the engine then does with the tower
    adapter (load it and ignore it) is the test above, on vLLM's own LoRA manager; the real server is
    tests/e2e/test_lora_serve.py (0.23.0)."""

    def __init__(self, model_config):
        self.model_config = model_config
        self.sent: list[str] = []

    def __getattr__(self, name):  # renderer, input_processor, io_processor ...: not used by an adapter load
        return None

    async def add_lora(self, lora_request) -> bool:
        self.sent.append(lora_request.lora_name)
        return True


def load_via_api(path):
    """vLLM's ``OpenAIServingModels.load_lora_adapter`` (what ``POST /v1/load_lora_adapter`` and ``--lora-modules``
    at start-up call) for the adapter at ``path``: ``(result, names sent to the engine)``."""
    import asyncio

    from vllm.config import ModelConfig
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    engine = EngineClient(ModelConfig(model=str(TINY), dtype="float32", enforce_eager=True, max_model_len=512))
    models = OpenAIServingModels(engine, [BaseModelPath(name="tiny", model_path=str(TINY))])
    result = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="tower", lora_path=str(path))))
    return result, engine.sent


def test_api_server_refuses_the_tower_adapter_with_400_before_the_engine(m46, tower_adapter):
    with hotfix(m46, "auto", fixes=OTHERS):
        result, sent = load_via_api(tower_adapter)
        assert sent == ["tower"] and "added successfully" in str(result), result  # stock: sent on to the engine
    with hotfix(m46, "auto", fixes=None):
        result, sent = load_via_api(tower_adapter)
        assert sent == [], sent
        assert result.error.code == 400 and result.error.type == "BadRequestError", result
        # vLLM 0.26+'s create_error_response writes "<path>" for file paths in a message.
        assert re.search(r"LoRA adapter 'tower' \((<path>|" + re.escape(str(tower_adapter)) + r")\) has weights for 12 "
                         r"module\(s\) of the MiniCPM-V 4.6 vision tower", result.error.message), result.error.message
        assert "vpm.encoder.layers.0.mlp.fc1" in result.error.message
