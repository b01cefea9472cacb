"""What a fresh interpreter looks like right after start-up, before it imports anything itself: every module
imported, the finders waiting for ``import vllm``, the ``sitecustomize`` that ran and the next one it chained to, and
the marker a stand-in image ``sitecustomize`` sets (tests/activation/test_activation.py)."""

import json
import sys

site_mod = sys.modules.get("sitecustomize")
print(json.dumps({
    "modules": sorted(sys.modules),
    "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)],
    "sitecustomize": getattr(site_mod, "__file__", None),
    "chained": getattr(getattr(site_mod, "CHAINED", None), "__file__", None),
    "image_marker": getattr(sys, "image_sitecustomize_ran", None),
}))
