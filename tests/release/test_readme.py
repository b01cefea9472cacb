"""README is the front door: its figures and tables come from a recorded run, and its links lead somewhere.

* The sections between ``<!-- results:NAME -->`` markers, and the whole page ``docs/results/matrix.md``, are what
  ``scripts/results.py readme`` renders from ``docs/results/test-run.json`` (written by ``scripts/test --record``):
  a hand-edited figure fails here. README's table has one row per vLLM release of the recorded run, each naming
  the fixes whose recorded verdict there is ``broken`` (read here from the JSON, not from the renderer).
* Every relative link in README.md and docs/*.md names a file of the repository.
* The test command README gives is the one ``.ci/run`` runs.

Placed on one environment: it reads files only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.placed("0.28.0")

REPO = Path(__file__).resolve().parents[2]


def test_generated_sections_match_the_recorded_run():
    data = json.loads((REPO / "docs/results/test-run.json").read_text())
    assert data["environments"] and data["passed"] > 0
    out = subprocess.run([sys.executable, str(REPO / "scripts/results.py"), "readme", "--check"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (REPO / "README.md").read_text()
    for name in ("members", "releases", "run"):
        body = re.search(rf"<!-- results:{name} -->\n(.*?)\n<!-- /results:{name} -->", text, re.S)
        assert body and body.group(1).strip(), f"README's {name} section is empty"
    assert f"`{data['commit']}`" in text
    matrix = (REPO / "docs/results/matrix.md").read_text()
    assert f"`{data['commit']}`" in matrix
    for env in data["environments"]:
        for name in env.get("verdicts") or {}:
            assert f"(`{name}`)" in matrix, name


def test_one_row_per_release_naming_its_fixes():
    data = json.loads((REPO / "docs/results/test-run.json").read_text())
    section = re.search(r"<!-- results:releases -->\n(.*?)\n<!-- /results:releases -->",
                        (REPO / "README.md").read_text(), re.S).group(1)
    rows = {cells[1].strip(): cells for cells in (ln.split("|") for ln in section.splitlines())
            if len(cells) > 4 and re.fullmatch(r" \d+\.\d+\.\d+ ", cells[1])}
    wanted: dict[str, set[str]] = {}
    for env in data["environments"]:
        if env.get("verdicts"):
            broken = {n for n, v in env["verdicts"].items() if v == "broken"}
            wanted.setdefault(env["vllm"].split("+")[0], set()).update(broken)
    assert set(rows) == set(wanted)
    for release, broken in wanted.items():
        assert set(re.findall(r"`(\w+)`", rows[release][3])) == broken, release


def test_members_table_says_how_each_release_serves_each_member():
    """README's first-screen table: per release, each backported member is "registered by the hotfix" where the
    recorded backport probe found vLLM lacking it, "vLLM's own" where vLLM registers it (read from the JSON here)."""
    data = json.loads((REPO / "docs/results/test-run.json").read_text())
    section = re.search(r"<!-- results:members -->\n(.*?)\n<!-- /results:members -->",
                        (REPO / "README.md").read_text(), re.S).group(1)
    lines = section.splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {cells[0]: cells for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])
            if re.fullmatch(r"\d+\.\d+\.\d+", cells[0])}
    for env in data["environments"]:
        for b in (env.get("backports") or {}).values():
            cell = rows[env["vllm"].split("+")[0]][header.index(b["member"])]
            if b["verdict"] == "missing":
                assert "registered by the hotfix" in cell, (env["environment"], cell)
            elif b["reason"].startswith("vLLM's own"):
                assert "vLLM's own" in cell, (env["environment"], cell)
            else:
                assert "cannot be served" in cell, (env["environment"], cell)


def test_links_lead_to_files():
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (doc.parent / target).exists():
                bad.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not bad, bad


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci/run").read_text()
    assert re.search(r"^scripts/test\s", readme, re.M), "README's test command"
    assert re.search(r"^(exec )?scripts/test( \|\| status=\$\?)?\s*$", ci, re.M), ".ci/run must run README's test command"
    assert not re.search(r"^set [^\n]*-e", ci, re.M) or re.search(r"^scripts/test \|\| status=\$\?\s*$", ci, re.M) \
        or re.search(r"^exec scripts/test\s*$", ci, re.M), "a failing test run must fail .ci/run"
    assert re.search(r'^exit "\$status"\s*$', ci, re.M) or re.search(r"^exec scripts/test\s*$", ci, re.M)
