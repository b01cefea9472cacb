"""Test-only start-up code for an e2e server that leaves some fixes out: on a server's PYTHONPATH, every process of
the server runs it after the ``.pth`` files that arm the hotfix; each fix NAME listed (comma-separated) in
``VLLM_MINICPM_HOTFIX_TEST_LEAVE_OUT`` then probes ``correct``, so ``auto`` leaves it unapplied and logs why.
Imports no vLLM."""

import os

from vllm_minicpm_hotfix.decision import State, Verdict
from vllm_minicpm_hotfix.fixes import by_name

for _name in filter(None, os.environ.get("VLLM_MINICPM_HOTFIX_TEST_LEAVE_OUT", "").split(",")):
    by_name(_name).probe = lambda module: Verdict(State.CORRECT, "left out by VLLM_MINICPM_HOTFIX_TEST_LEAVE_OUT")
