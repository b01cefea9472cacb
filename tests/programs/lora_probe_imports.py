"""lora_tower's probe on the installed vLLM's model module, in a fresh interpreter: prints its verdict and whether
the probe imported vLLM's LoRA manager modules (tests/fixes/test_lora_tower.py: it must not; they cost ~0.13 s of CPU in
every vLLM process). Run with the repository on PYTHONPATH and VLLM_MINICPM_HOTFIX=off."""

import importlib
import json
import sys

module = importlib.import_module("vllm.model_executor.models.minicpmv4_6")

from vllm_minicpm_hotfix.fixes import lora_tower  # noqa: E402

verdict = lora_tower.probe(module)
print(json.dumps({"verdict": verdict.state.value,
                  "imported": [m for m in ("vllm.lora.model_manager", "vllm.lora.worker_manager") if m in sys.modules]}))
