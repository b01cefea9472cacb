"""``install()`` twice, vLLM's model module imported, ``install()`` once more (tests/activation/test_hook.py); prints
``status()``, what the first two calls returned and whether the qkv_loader fix is patched."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm_minicpm_hotfix as h  # noqa: E402

first = h.install()
second = h.install()
import vllm.model_executor.models.minicpmv4_6 as m  # noqa: E402
from vllm_minicpm_hotfix.fixes import _base, qkv_loader  # noqa: E402

h.install()
print(json.dumps({"status": h.status(), "first": first, "second": second, "patched": _base.is_patched(qkv_loader, m)}))
