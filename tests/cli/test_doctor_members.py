"""``doctor``'s rows for the family members other than 4.6 (MiniCPM-V 4.7, MiniCPM-OCR), through real ``doctor`` runs
in fresh vLLM processes of this environment.

The reference is independent of the hook's record: ``doctor`` under ``VLLM_MINICPM_HOTFIX=off`` (nothing patched, in
a process of its own) probes every member's classes as vLLM ships them. Under ``auto`` the rows must say the same
stock verdict: a member whose stock classes a fix finds broken (4.7 and OCR inherit 4.6's methods, so the hotfix's
4.6 wrapper is what makes them correct) reads ``stock vLLM broken -> PATCHED``, never "not needed" judged from the
patched classes; a member it finds correct reads "not needed"; and a fix that declares only other members
(``canvas_mrope``, ``ocr_video_kwargs``) does not read "stock vLLM correct -> PATCHED" on its 4.6 row when it was
patched for another member.

Placed where both members' classes exist: 0.28.0 (the hotfix's backports, transformers 5.24) and 0.33.0 (vLLM's own
4.7 and OCR classes). Two ``doctor`` runs, ~1 min each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.paths import REPO

from vllm_minicpm_hotfix.fixes import REGISTRY

pytestmark = pytest.mark.placed("0.28.0", "0.33.0")

V46 = "MiniCPM-V 4.6"
OTHERS = ("MiniCPM-V 4.7", "MiniCPM-OCR")


def doctor_json(mode: str, tmp_path) -> dict:
    """``python -m vllm_minicpm_hotfix doctor --json`` with the repository on PYTHONPATH (its sitecustomize activates
    the hotfix in doctor's vLLM process) and ``VLLM_MINICPM_HOTFIX=mode``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MINICPM_HOTFIX") or k.endswith("_ENV")}
    env.update(PYTHONPATH=str(REPO), VLLM_MINICPM_HOTFIX=mode)
    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", "doctor", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doctor")
    return doctor_json("off", tmp), doctor_json("auto", tmp)


def test_member_rows_say_the_stock_verdict(reports):
    off, auto = reports
    assert not any(r["applied"] for r in off["fixes"].values())  # the reference: nothing patched
    rows = {r["check"]: r for r in auto["checks"]}
    checked = {"broken": 0, "correct": 0}
    for fix in REGISTRY:
        for member in OTHERS:
            ref = (off["fixes"][fix.NAME].get("models") or {}).get(member)
            if ref is None or not ref["declared"]:
                continue
            stock = ref["now"]  # the probe on the member's classes as vLLM ships them
            row = rows[f"{fix.NAME} [{member}]"]
            detail = row["detail"].removeprefix("probed at first use (here in doctor's child): ")
            if stock == "broken":
                assert row["status"] == "OK" and detail.startswith("stock vLLM broken -> PATCHED, now correct"), row
            elif stock == "correct":
                assert row["status"] == "OK" and detail.startswith("not needed"), row
            else:  # undetermined on the stock classes: never "not needed"
                assert not detail.startswith("not needed") and f"stock vLLM {stock}" in detail, row
            checked[stock] = checked.get(stock, 0) + 1
    # Both kinds are there: members inherit broken 4.6 methods, and some of their own code is correct.
    assert checked["broken"] >= 3 and checked["correct"] >= 1, checked


def test_a_fix_of_other_members_only_says_for_whom_it_patched(reports):
    """A fix that does not declare 4.6 is patched exactly for the members the reference finds broken (0.33.0:
    ``canvas_mrope`` for vLLM's own 4.7; 0.28.0: none, the backports compute what it fixes themselves), and its own
    row names them instead of reading "stock vLLM correct -> PATCHED"."""
    off, auto = reports
    rows = {r["check"]: r for r in auto["checks"]}
    want = {name: [m for m, r in f["models"].items() if r["declared"] and r["now"] == "broken"]
            for name, f in off["fixes"].items() if (f.get("models") or {}).get(V46, {}).get("declared") is False}
    got = {name: [m for m, r in auto["fixes"][name]["models"].items() if r.get("applied")] for name in want}
    assert got == want, (got, want)
    for name, acting in got.items():
        detail = rows[name]["detail"]
        if acting:
            assert f"PATCHED for {', '.join(acting)} only" in detail and "stock vLLM correct" not in detail, detail
        else:
            assert "PATCHED" not in detail, detail


def test_the_decision_row_names_a_members_stock_verdict(reports):
    """The decision row (stock vLLM's verdicts) says a fix of 4.7 only is broken for 4.7 where its stock classes
    are, not the 4.6 "correct" of classes it leaves alone."""
    off, auto = reports
    decision = next(r["detail"] for r in auto["checks"] if r["check"] == "decision")
    for fix in REGISTRY:
        models = off["fixes"][fix.NAME].get("models") or {}
        if (models.get(V46) or {}).get("declared") is False:
            for member in OTHERS:
                ref = models.get(member)
                if ref and ref["declared"]:
                    assert f"{fix.LABEL} {member} {ref['now']}" in decision, (fix.NAME, decision)
