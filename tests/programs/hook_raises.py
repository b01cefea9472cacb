"""The qkv_loader fix's ``apply`` replaced by one that raises, then ``install()`` and vLLM's model module imported
(tests/loading/test_reliability.py::test_hook_raising_leaves_vllm_importable_and_unpatched). Prints what got patched."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_minicpm_hotfix.fixes import _base, qkv_loader  # noqa: E402


def boom(module):
    raise RuntimeError("synthetic failure inside a fix")


qkv_loader.apply = boom
import vllm_minicpm_hotfix as h  # noqa: E402

h.install()
import vllm.model_executor.models.minicpmv4_6 as m  # noqa: E402

attn, model = m.MiniCPMV4_6ViTWindowAttentionSelfAttn, m.MiniCPMV4_6ForConditionalGeneration
print(json.dumps({"status": h.status(), "attn_patched": _base.patched_by(attn, "load_weights") is not None,
                  "model_patched_by": _base.patched_by(model, "load_weights"),
                  "model_load_weights": model.__dict__["load_weights"].__qualname__,
                  "wrapped": hasattr(model.__dict__["load_weights"], "__wrapped__")}))
