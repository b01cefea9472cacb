"""``import vllm`` of a stand-in vLLM on ``PYTHONPATH`` (tests/activation/test_pep829.py): which ``vllm`` was imported, what
activated, and whether a finder is still waiting."""

import json
import sys

import vllm
from vllm_minicpm_hotfix import _bootstrap, hook

print(json.dumps({"vllm": vllm.__file__, "activations": _bootstrap.activations, "hook_installed": hook._installed,
                  "wrapt": sys.modules["wrapt"].__file__,
                  "waiting": [f for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)] != []}))
