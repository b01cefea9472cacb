"""What a user of the newest release runs first, on that release: ``doctor`` and ``verify`` with the hotfix active
(the bundle route: the repository's ``sitecustomize.py`` on ``PYTHONPATH``), in fresh interpreters.

* ``doctor`` exits 0, its verdict ``ok``, and no fix's probe is ``undetermined`` or ``unrecognised`` on stock vLLM for
  MiniCPM-V 4.6 or for a member this vLLM defines: every fix decided by the release's own code
  (vLLM 0.34.0's new ``get_cached_item`` made ``placeholder_guard``'s probe ``undetermined`` and doctor exit 1 before);
  ``placeholder_guard`` applied wherever its probe finds stock broken.
* ``verify`` (the bundled tiny checkpoint through vLLM's own ``load_weights``) exits 0 with ``PASS``: the vit_merger
  tensors equal the checkpoint's bit for bit (its own reference: the checkpoint read with safetensors).

Placed on the newest release the recorded data knows and on any newer one (:func:`support.placement.newest_envs`:
0.34.0 today, the canary's release the day a newer one reaches the index); the same checks on the older releases are
tests/cli/test_cli.py's. About 30 s of CPU for doctor and 60 s for verify (most of it importing vLLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO, TINY
from support.placement import newest_envs

pytestmark = pytest.mark.placed(*newest_envs())

UNSURE = ("undetermined", "unrecognised")


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_MINICPM_HOTFIX", None)  # the default, auto
    return subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_doctor_passes_with_every_fix_decided():
    proc = _cli("doctor", "--json")
    tail = f"--- stderr (tail) ---\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    undecided = {(name, model): entry["stock"] for name, fix in report["fixes"].items()
                 for model, entry in fix["models"].items()
                 if entry.get("declared") and not entry.get("unknown") and entry.get("stock") in UNSURE}
    assert not undecided, f"fixes the release's own code left undecided: {undecided}\n{tail}"
    guard = report["fixes"]["placeholder_guard"]
    assert guard["stock"] != "broken" or guard["applied"], guard
    assert proc.returncode == 0 and report["ok"], f"{report['summary']}\n{tail}"


def test_verify_loads_the_checkpoint_bit_exact():
    proc = _cli("verify", "--model", str(TINY))
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and last.startswith("PASS:"), f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
