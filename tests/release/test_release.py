"""The release: the version (pyproject, ``__version__``, ``--version``, CHANGELOG), the release workflow, and the
release facts ``doctor`` quotes (``vllm_minicpm_hotfix/data/releases.json``, derived from the recorded run).

Placed on 0.22.1 (one of the short sessions): nothing here depends on the vLLM release, and the real ``doctor`` on
every environment is asserted by tests/cli/test_cli.py. The built wheel's metadata, ``--version`` and ``doctor`` over a
vLLM environment are checked by ``scripts/check-dist`` (``.ci/run``), not here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from support.paths import REPO
import vllm_minicpm_hotfix
from vllm_minicpm_hotfix.cli import releases
from vllm_minicpm_hotfix.cli.doctor import table as doctor_render, verdict as doctor_judge
from vllm_minicpm_hotfix.fixes import names

pytestmark = pytest.mark.placed("0.22.1")

RUN = REPO / "docs" / "results" / "test-run.json"


def _pyproject_version() -> str:
    (version,) = re.findall(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    return version


def test_version_is_pyprojects_everywhere():
    """The clone on sys.path has no metadata of its own: ``__version__`` is the source version, which equals
    pyproject's; the command prints it; CHANGELOG.md has a section for it."""
    want = _pyproject_version()
    assert vllm_minicpm_hotfix.SOURCE_VERSION == want
    assert vllm_minicpm_hotfix.__version__ == want
    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    assert proc.stdout.strip() == f"vllm-minicpm-hotfix {want}"
    assert re.search(rf"^## {re.escape(want)}\b", (REPO / "CHANGELOG.md").read_text(), re.MULTILINE)


def test_release_workflow_publishes_with_a_trusted_publisher():
    """.github/workflows/release.yml: a tag builds both distributions with uv, checks them, and publishes through
    PyPI's trusted publishing (an OIDC token, no password); the job that publishes has ``id-token: write``."""
    text = (REPO / ".github" / "workflows" / "release.yml").read_text()
    assert "uv build" in text and "twine check" in text
    assert re.search(r"uses: pypa/gh-action-pypi-publish@", text)
    assert re.search(r"id-token: write", text)
    assert not re.search(r"^\s*password:", text, re.MULTILINE) and "secrets." not in text  # no stored token


def test_packaged_release_facts_are_the_recorded_runs():
    """``data/releases.json`` says, per environment of the recorded run, the fixes applied there (stock verdict
    ``broken``) -- computed here from docs/results/test-run.json directly. Fails when the run is re-recorded and
    the file not re-derived (``python3 scripts/release_facts.py``)."""
    run = json.loads(RUN.read_text())
    facts = json.loads(releases.DATA.read_text())
    assert (facts["commit"], facts["date"]) == (run["commit"], run["date"])
    assert [e["environment"] for e in facts["environments"]] == [e["environment"] for e in run["environments"]]
    for got, env in zip(facts["environments"], run["environments"]):
        assert (got["vllm"], got["transformers"]) == (env["vllm"], env["transformers"])
        assert got["verdicts"] == env["verdicts"]
        assert got["applied"] == [n for n, v in env["verdicts"].items() if v == "broken"]
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "release_facts.py"), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


FACTS = {"commit": "c0ffee", "date": "2026-12-01 08:00 UTC", "environments": [
    {"environment": "0.28.0", "vllm": "0.28.0", "transformers": "5.24.0", "applied": ["a", "b"],
     "verdicts": {"a": "broken", "b": "broken", "c": "correct"}},
    {"environment": "0.32.0", "vllm": "0.32.0", "transformers": "5.19.0", "applied": ["b"],
     "verdicts": {"a": "correct", "b": "broken", "c": "correct"}},
    {"environment": "0.22.1", "vllm": "0.22.1", "transformers": "5.24.0", "applied": [],
     "verdicts": {"a": "correct", "b": "correct", "c": "correct"}},
    {"environment": "0.33.0", "vllm": "0.33.0", "transformers": "5.20.2", "applied": [],
     "verdicts": {"a": "correct", "b": "correct", "c": "correct"}},
]}


def test_removal_sentence():
    """The three sentences, on hand-made facts: nothing needed; a newer measured release needing none of the
    fixes needed here (the oldest such); none measured (or only an older one, named when it is all there is)."""
    assert releases.removal([], "0.28.0", FACTS)["sentence"] == "nothing to fix on this vLLM: the package can be removed"
    out = releases.removal(["a"], "0.28.0", FACTS)
    assert out["sentence"] == "needed for 1 fix; vLLM 0.32.0 (measured, transformers 5.19.0) needs none of them"
    assert out["release"] == {"environment": "0.32.0", "vllm": "0.32.0", "transformers": "5.19.0"}
    assert out["measured_at"] == {"commit": "c0ffee", "date": "2026-12-01 08:00 UTC"}
    out = releases.removal(["a", "b"], "0.28.0+cpu", FACTS)
    assert out["sentence"] == "needed for 2 fixes; vLLM 0.33.0 (measured, transformers 5.20.2) needs none of them"
    out = releases.removal(["a", "b"], "0.34.0", FACTS)  # only older releases need none: the newest is named
    assert out["release"]["vllm"] == "0.33.0"
    out = releases.removal(["a", "d"], "0.28.0", FACTS)  # "d" measured nowhere
    assert out["sentence"] == "needed, and no measured release fixes all of them" and out["release"] is None


def test_known_releases_come_from_the_facts():
    """doctor's advice on a fix its probe cannot judge names the releases of the recorded run, read from the
    facts: the oldest and newest measured ``major.minor`` (hand-made facts, then the packaged ones), nothing when
    the facts list none."""
    assert releases.known_range(FACTS) == "0.22-0.33"
    one = {"environments": [dict(FACTS["environments"][0], vllm="0.28.0+cpu")]}
    assert releases.known_range(one) == "0.28"
    assert releases.known_range({"environments": []}) is None
    shipped = sorted({tuple(int(x) for x in e["vllm"].split(".")[:2])
                      for e in json.loads(releases.DATA.read_text())["environments"]})
    want = f"{shipped[0][0]}.{shipped[0][1]}-{shipped[-1][0]}.{shipped[-1][1]}"
    advice = doctor_judge.mode_advice({"child": {}}, {"stock": "undetermined"})
    assert advice.endswith(f"(or use a vLLM release this hotfix was measured on, {want})"), advice


def test_removal_on_the_packaged_facts():
    """On the shipped facts: for each measured environment's own needs, no sentence claims a release that the
    recorded run shows needing one of them."""
    run = json.loads(RUN.read_text())
    for env in run["environments"]:
        needed = [n for n, v in env["verdicts"].items() if v != "correct"]
        out = releases.removal(needed, env["vllm"])
        if out["release"] is None:
            assert not needed or out["sentence"] == releases.NONE_FIXES_ALL
            continue
        named = next(e for e in run["environments"] if e["environment"] == out["release"]["environment"])
        assert all(named["verdicts"][n] == "correct" for n in needed)


def _fix(stock: str, reason: str, applied: bool = False) -> dict:
    return {"label": "x", "stock": stock, "stock_reason": reason, "now": "correct", "now_reason": reason,
            "applied": applied, "needed": stock != "correct", "ok": True, "hook_error": None, "why": None}


def test_doctor_rows_say_not_needed_once_and_the_verdict_is_short():
    fixes = {n: _fix("correct", f"not needed: {n} is fine") for n in names()[:5]}
    fixes[names()[5]] = _fix("correct", "not needed here: the loader refuses it itself")
    fixes.update({n: _fix("broken", "broken here", applied=True) for n in names()[6:]})
    rows = doctor_render._fix_rows(fixes)
    for (name, status, detail), n in zip(rows[:5], names()[:5]):
        assert (name, status, detail) == (n, "OK", f"not needed: {n} is fine")
    assert rows[5] == (names()[5], "OK", "not needed here: the loader refuses it itself")
    report = {"vllm": {"installed": True, "version": "0.28.0"}, "fixes": fixes,
              "child": {"vllm_version": "0.28.0", "module": True,
                        "steps": {"model module": {"hook_installed": True}}}}
    ok, line = doctor_judge.judge(report)
    assert ok and line == ("OK: a vLLM 0.28.0 started from this environment loads MiniCPM-V 4.6 correctly "
                           f"({len(names()) - 6} fixes patched by the hotfix, 6 correct upstream; hotfix active)")
    assert doctor_judge.removal(report)["needed"] == names()[6:]
