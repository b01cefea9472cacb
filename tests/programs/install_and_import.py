"""``install()``, then vLLM's model module imported (tests/loading/test_reliability.py: an unknown ``VLLM_MINICPM_HOTFIX``,
and a stand-in vLLM with a layout the hotfix does not know). Prints ``status()``, whether the self-attention's
``load_weights`` is patched (None when the module has no such class), whether the model's ``load_weights`` is vLLM's
own function untouched, and the module's names."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm_minicpm_hotfix as h  # noqa: E402
from vllm_minicpm_hotfix.fixes import _base  # noqa: E402

h.install()
import vllm.model_executor.models.minicpmv4_6 as m  # noqa: E402

attn = getattr(m, "MiniCPMV4_6ViTWindowAttentionSelfAttn", None)
lw = m.MiniCPMV4_6ForConditionalGeneration.__dict__["load_weights"]
untouched = lw.__qualname__ == "MiniCPMV4_6ForConditionalGeneration.load_weights" and not hasattr(lw, "__wrapped__")
print(json.dumps({"status": h.status(),
                  "patched": None if attn is None else _base.patched_by(attn, "load_weights") is not None,
                  "untouched": untouched, "names": sorted(vars(m))}))
