"""What a fresh interpreter armed at start-up, before it imports anything itself: the finders waiting for
``import vllm``, the heavy modules and ours already imported, and the interpreter flags ``-I``/``-E``/``-S``."""

import json
import sys

print(json.dumps({"waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)],
                  "heavy": sorted(m for m in sys.modules if m.split(".")[0] in ("wrapt", "torch", "vllm")),
                  "ours": sorted(m for m in sys.modules if m.startswith("vllm_minicpm_hotfix")),
                  "flags": [sys.flags.isolated, sys.flags.ignore_environment, sys.flags.no_site]}))
