"""``status()`` of the package imported alone (tests/activation/test_hook.py): the record, and which of wrapt, torch and vLLM
that import pulled in."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vllm_minicpm_hotfix as h  # noqa: E402

st = h.status()
print(json.dumps({"st": st, "mods": sorted(m for m in ("wrapt", "torch", "vllm") if m in sys.modules)}))
