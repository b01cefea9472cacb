"""vLLM's model module imported as vLLM would, then vLLM's general plugins loaded (``--no-plugins``: not loaded, a
script importing the module directly); reports what activated and what is patched."""

import json
import sys

import vllm.model_executor.models.minicpmv4_6 as m
import vllm_minicpm_hotfix as h
from vllm_minicpm_hotfix import _bootstrap
from vllm_minicpm_hotfix.fixes import _base, qkv_loader
from vllm_minicpm_hotfix.fixes import processor_downsample_mode as processor_mode

before_plugins = list(_bootstrap.activations)
from vllm.plugins import load_general_plugins  # noqa: E402

if "--no-plugins" not in sys.argv[1:]:
    load_general_plugins()
wrapt = sys.modules.get("wrapt")
print(json.dumps({
    "status": h.status(),
    "package": h.__file__,
    "activations_before_plugins": before_plugins,
    "activations": _bootstrap.activations,
    "qkv_patched": _base.is_patched(qkv_loader, m),
    "attn_patched": _base.patched_by(m.MiniCPMV4_6ViTWindowAttentionSelfAttn, "load_weights") is not None,
    "processor_patched": _base.is_patched(processor_mode, m),
    "wrapt": getattr(wrapt, "__file__", None),
    "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)],
}))
