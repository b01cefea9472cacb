"""The start-up module ``_vllm_minicpm_hotfix_arm`` as this Python imported it (tests/activation/test_pythons.py: a bundle's
bytecode): its file, the bytecode file it names, a marker an edited source sets, and the finders armed."""

import json
import sys

import _vllm_minicpm_hotfix_arm as arm

print(json.dumps({"stale_marker": getattr(arm, "STALE_MARKER", None), "file": arm.__file__,
                  "cached": getattr(arm.__spec__, "cached", None),
                  "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]}))
