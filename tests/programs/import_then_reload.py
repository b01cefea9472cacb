"""vLLM's model module imported before ``install()``, then ``importlib.reload``-ed and ``install()`` called again
(tests/loading/test_reliability.py::test_module_imported_before_install_then_reloaded). Prints which classes are patched."""

import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm.model_executor.models.minicpmv4_6 as m  # noqa: E402

MODEL = "MiniCPMV4_6ForConditionalGeneration"
old = m.MiniCPMV4_6ViTWindowAttentionSelfAttn
import vllm_minicpm_hotfix as h  # noqa: E402
from vllm_minicpm_hotfix.fixes import _base  # noqa: E402


def patched(cls) -> bool:
    return _base.patched_by(cls, "load_weights") is not None


installed = h.install()
at_once = patched(m.MiniCPMV4_6ViTWindowAttentionSelfAttn) and patched(getattr(m, MODEL))
m2 = importlib.reload(m)
new = m2.MiniCPMV4_6ViTWindowAttentionSelfAttn
again = h.install()
# what vLLM's model registry resolves the architecture to after the reload (it imports the module by name)
from vllm.model_executor.models.registry import ModelRegistry  # noqa: E402

resolved = ModelRegistry._try_load_model_cls(MODEL)
print(json.dumps({"installed": installed, "at_once": at_once, "same_module": m2 is m, "new_class": new is not old,
                  "old_still_patched": patched(old), "new_patched": patched(new),
                  "new_model_patched": patched(getattr(m2, MODEL)), "install_again": again,
                  "registry_class_patched": patched(resolved) if resolved is not None else None,
                  "status_applied": h.status()["fixes"]["qkv_loader"]["applied"]}))
