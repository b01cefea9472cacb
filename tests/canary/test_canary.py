"""The canary (scripts/canary): what fails it and what it only reports, driven end to end on stand-in releases -- the
installed vLLM altered the way a new release might change it (tests/programs/standin_release.py), judged against the
recorded release facts.

Placed on 0.33.0 (a short session): the stand-ins alter vLLM 0.33.0's own ``VideoMediaIO`` and ``minicpmv`` module,
which every release 0.22-0.34 shares, and 0.33.0 is recorded (``video_budget``: broken). Each canary run here is one
fresh vLLM process (``--no-suite``: the suite step is driven with a tiny test file of its own).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO
from support.placement import environment_spec

pytestmark = pytest.mark.placed("0.33.0")

CANARY = REPO / "scripts" / "canary"
STANDIN = REPO / "tests" / "programs" / "standin_release.py"


def _canary_module():
    loader = importlib.machinery.SourceFileLoader("scripts_canary", str(CANARY))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


canary = _canary_module()


def run_canary(out, *args, env=None):
    """scripts/canary with this environment's Python (built already), its stdout and canary.json."""
    proc = subprocess.run([sys.executable, str(CANARY), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=900, cwd=REPO, env=env, check=False)
    result = out / "canary.json"
    return proc, (json.loads(result.read_text()) if result.is_file() else None)


def standin(out, release, *alterations, suite=None):
    args = ["--release", release, "--python", sys.executable, "--spec", environment_spec(),
            "--verdicts-program", f"{STANDIN} {' '.join(alterations)}"]
    return run_canary(out, *args, *(["--", *suite] if suite else ["--no-suite"]))


@pytest.fixture(scope="module")
def passing_test(tmp_path_factory):
    path = tmp_path_factory.mktemp("suite") / "test_stand_in_suite.py"
    path.write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    return path


def test_a_probe_made_undetermined_by_new_code_fails_the_canary(tmp_path, release):
    """New code that a fix's probe cannot read (the loader's frame count moved out of ``VideoMediaIO.__init__``'s
    signature): ``video_budget`` is ``undetermined``, the hotfix in ``auto`` leaves it off, and the canary fails
    naming it -- and only it, on a release whose other verdicts are all determined."""
    proc, result = standin(tmp_path, release, "loader-default-moved")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    status = json.loads((tmp_path / "verdicts.json").read_text())["status"]["fixes"]["video_budget"]
    assert (status["verdict"], status["applied"]) == ("undetermined", False), status
    assert result["failures"], result
    assert all(f.startswith("video_budget is undetermined for MiniCPM-V 4.6") for f in result["failures"]), result
    assert "VideoMediaIO num_frames default is None" in result["failures"][0]
    assert "canary: FAIL: video_budget is undetermined" in proc.stdout
    assert result["changed"] == {"video_budget": ["broken", "undetermined"]}, result


def test_a_fix_no_longer_needed_is_reported_without_failing(tmp_path, release, passing_test):
    """New code that fixes upstream what a fix repairs (the 16-frame cap raised to the loader's 32): its stock verdict
    turns ``correct`` where the recorded release said ``broken``; the canary reports it and passes (the suite step,
    here one passing test, passes too)."""
    proc, result = standin(tmp_path, release, "frame-cap-raised", suite=[str(passing_test)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert result["failures"] == [], result
    assert result["reference"] == release, result
    assert result["changed"] == {"video_budget": ["broken", "correct"]}, result
    assert any(r.startswith(f"video_budget is no longer needed on vLLM {release}") for r in result["reports"]), result
    assert "canary: REPORT: video_budget is no longer needed" in proc.stdout
    assert any("suite" in r and "passed: 1 tests, 0 failures" in r for r in result["reports"]), result


def test_a_failing_or_empty_suite_fails_the_canary(tmp_path, release):
    """The suite step for real (pytest in this environment, its junit report) with a failing test, then with no test
    at all: both fail the judgement, whatever the verdicts (here a release with every verdict as recorded)."""
    failing = tmp_path / "test_stand_in_failure.py"
    failing.write_text("def test_differs_from_reference():\n    assert [1, 2] == [1, 3]\n")
    env = canary.child_env(environment_spec())
    recorded = json.loads(canary.RELEASES.read_text())
    verdicts = {"status": {"fixes": {}}, "stock": {}}
    for name, args in (("failing", [str(failing)]), ("empty", [str(failing), "-k", "no_such_test"])):
        out = tmp_path / name
        out.mkdir()
        suite = canary.run_suite(sys.executable, env, args, out)
        result = canary.judge(verdicts, suite, recorded, release)
        assert [f for f in result["failures"] if f.startswith("the suite")], (name, suite, result)
    assert suite["tests"] == 0


def test_a_release_that_does_not_import_fails_the_canary(tmp_path, release):
    """``import vllm`` raising (as every VllmConfig of 0.34.0 did without its workaround) fails the canary."""
    proc, result = standin(tmp_path, release, "import-broken")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert result["failures"] and result["failures"][0].startswith(f"vLLM {release} does not import: RuntimeError"), \
        result


def test_a_release_that_cannot_be_installed_is_reported_without_failing(tmp_path):
    """cpu-env refusing the release (0.21.0: on the index, but older than every CPU recipe and than MiniCPM-V 4.6) is
    reported, nothing else is done, and the canary passes."""
    env = {**os.environ, "VLLM_MINICPM_HOTFIX_ENVS": str(tmp_path / "envs")}
    proc, result = run_canary(tmp_path / "out", "--release", "0.21.0", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "canary: REPORT: vLLM 0.21.0 cannot be installed" in proc.stdout
    assert "no known CPU recipe for vLLM 0.21.0" in proc.stdout
    assert result is None and not (tmp_path / "envs" / "vllm-0.21.0-unpinned").exists()


def test_the_newest_release_is_the_newest_final_one():
    versions = ["0.9.2", "0.35.0rc1", "0.34.0", "0.10.1.1", "0.34.1.dev3", "0.33.0"]
    assert canary.newest_release(versions) == "0.34.0"
    assert canary.newest_release(["0.35.0rc1"]) is None


def test_the_reference_is_the_releases_own_recorded_environment_else_the_newest():
    recorded = json.loads(canary.RELEASES.read_text())
    envs = recorded["environments"]
    assert canary.reference(recorded, "0.28.0")["environment"] == "0.28.0:unpinned"
    assert canary.reference(recorded, "0.33.0")["environment"] == "0.33.0"
    newest = max(envs, key=lambda e: canary.version_key_loose(e["vllm"]))["vllm"]
    assert canary.reference(recorded, "99.0.0")["environment"] == newest
