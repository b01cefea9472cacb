"""Right after start-up (tests/activation/test_pep829.py): this Python's version, the finders waiting for ``import vllm`` and
which of wrapt, vLLM and the package start-up imported."""

import json
import sys

w = [f for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]
print(json.dumps({"version": list(sys.version_info[:3]), "waiting": [f.source for f in w],
                  "heavy": sorted(m for m in sys.modules
                                  if m.split(".")[0] in ("wrapt", "vllm", "vllm_minicpm_hotfix"))}))
