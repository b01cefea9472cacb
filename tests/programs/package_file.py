"""The file the package is imported from, and the finders start-up armed (tests/activation/test_activation.py, an editable
install)."""

import json
import sys

import vllm_minicpm_hotfix as h

print(json.dumps({"file": h.__file__,
                  "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]}))
