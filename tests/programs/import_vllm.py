"""``import vllm`` (not the model module) and what activated: ``status()``, the activation routes that ran, the file
wrapt came from (None: not imported)."""

import json
import sys

import vllm  # noqa: F401
from vllm_minicpm_hotfix import _bootstrap
import vllm_minicpm_hotfix as h

print(json.dumps({"status": h.status(), "activations": _bootstrap.activations,
                  "wrapt": getattr(sys.modules.get("wrapt"), "__file__", None)}))
