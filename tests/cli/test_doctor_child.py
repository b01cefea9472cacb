"""``vllm_minicpm_hotfix/cli/doctor/child.py``: the program ``doctor`` runs by path in fresh interpreters, here in its
``startup`` mode, in real interpreters of this environment (real start-up: ``site``, PYTHONPATH, the repository's
``sitecustomize.py``). Its ``vllm`` mode -- the fresh vLLM process -- is what every ``doctor`` run in
tests/cli/test_cli.py starts, for each way the hotfix can be present.

The point of running it by path: what it reports must be what the *environment* did at start-up, with nothing of the
package imported by the child itself, and without its own folder (the package folder) on ``sys.path``.

Placed where tests/cli/test_cli.py runs the child's ``vllm`` mode (``FULL_ENVS``): start-up does not depend on the vLLM
release.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO
from support.placement import FULL_ENVS
from vllm_minicpm_hotfix.cli.doctor import child as doctor_child, facts as doctor_facts

pytestmark = pytest.mark.placed(*FULL_ENVS)

NAMES = json.dumps(doctor_facts.child_names())
PACKAGE_DIR = str(REPO / "vllm_minicpm_hotfix")


def start(*flags: str, cwd=None, **env: str) -> tuple[dict, str]:
    """``python FLAGS .../cli/doctor/child.py startup NAMES`` with this environment's variables plus ``env`` (nothing of
    the hotfix unless ``env`` names it); returns the JSON it prints and its stderr."""
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_MINICPM_HOTFIX")}
    full.update(env)
    proc = subprocess.run([sys.executable, *flags, str(doctor_facts.CHILD), "startup", NAMES], env=full,
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_child_is_the_file_doctor_runs():
    assert doctor_facts.CHILD == __import__("pathlib").Path(doctor_child.__file__).resolve()
    cmd = doctor_facts.child_command("startup", NAMES)
    assert cmd[0] == sys.executable and cmd[-3:] == [str(doctor_facts.CHILD), "startup", NAMES]
    assert "-m" not in cmd and "-c" not in cmd


def test_it_imports_nothing_at_module_level():
    """Only ``sys`` at module level: until vLLM is imported the child must not pull in the package (whose
    ``__init__`` is what the environment's activation is expected to import) nor anything from its own folder."""
    tree = ast.parse(REPO.joinpath("vllm_minicpm_hotfix", "cli", "doctor", "child.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [a.name for n in top for a in n.names] == ["sys"]


def test_nothing_activated():
    facts, stderr = start("-X", "importtime")
    assert facts["armed_by"] is None and facts["ours"] is False and facts["package_imported"] is False
    assert PACKAGE_DIR not in facts["path"] and "" not in facts["path"]  # its own folder was dropped
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in stderr.splitlines() if ln.startswith("import time:")]
    assert imported and not [m for m in imported if m.startswith("vllm_minicpm_hotfix")], imported


def test_repository_on_pythonpath_arms_at_start_up():
    """The repository's sitecustomize.py arms the start-up module (waiting for ``import vllm``) without importing
    the package."""
    facts, _ = start(PYTHONPATH=str(REPO))
    assert facts["sitecustomize"] == str(REPO / "sitecustomize.py") and facts["ours"] is True
    assert facts["armed_by"] == "sitecustomize" and facts["package_imported"] is False
    assert facts["path"][0] == str(REPO) and PACKAGE_DIR not in facts["path"]


def test_off_runs_sitecustomize_but_does_not_arm():
    facts, _ = start(PYTHONPATH=str(REPO), VLLM_MINICPM_HOTFIX="off")
    assert facts["ours"] is True and facts["armed_by"] is None


def test_isolated_mode_ignores_pythonpath():
    """``python -I`` (what some entry points use): PYTHONPATH is ignored, so the repository's sitecustomize does not
    run; ``-I`` also adds no script folder to drop."""
    facts, _ = start("-I", PYTHONPATH=str(REPO))
    assert facts["ours"] is False and facts["armed_by"] is None
    assert str(REPO) not in facts["path"] and PACKAGE_DIR not in facts["path"]


def test_usage_error(capsys):
    assert doctor_child.main(["startup"]) == 2
    assert "usage: child.py" in capsys.readouterr().err
