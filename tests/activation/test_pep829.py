"""PEP 829 (Python 3.15+): ``pip install`` of the wheel activates through ``vllm-minicpm-hotfix.start``, whose
presence makes ``site`` skip the import line of the matching ``vllm-minicpm-hotfix.pth``.

Only the real ``site.py`` of a Python that implements PEP 829 can show this, and the test environments run older
Pythons, so this module needs one named by ``VLLM_MINICPM_HOTFIX_PEP829_PYTHON`` (a ``python3.15`` or later).
scripts/test sets it to what ``scripts/pep829-python`` prints: Debian's own python3.15 binary packages, downloaded
and unpacked (nothing is built). The module is placed on 0.28.0; without the variable every test here FAILS with
that reason (never skipped, never reported as passing). The plain-Python half (the entry point
resolves with ``pkgutil.resolve_name`` and arms the finder once) runs everywhere: tests/activation/test_install_modes.py.

vLLM has no build for that Python, so the finder's ``import vllm`` trigger is shown with a stand-in ``vllm`` package
(an empty ``__init__.py``): the finder must fire on it, import the hotfix and register the post-import hook with a
real wrapt. What the hook then does to vLLM's model module is Python-version independent and tested on 3.11-3.13.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.observed import observed
from support.venvs import clean_env, run_uv, site_packages
from support.programs import reported, run_program, run_reporting

ENV_VAR = "VLLM_MINICPM_HOTFIX_PEP829_PYTHON"
pytestmark = pytest.mark.placed("0.28.0")
START = "vllm-minicpm-hotfix.start"
PTH = "vllm-minicpm-hotfix.pth"

@pytest.fixture(scope="module")
def pep829_python() -> Path:
    value = os.environ.get(ENV_VAR)
    if not value:
        pytest.fail(f"{ENV_VAR} is not set: these tests need a Python that implements PEP 829 (3.15+), which this "
                    f"environment does not have; set it to such an interpreter (docs/activation.md)")
    python = Path(value)
    if not python.is_file():
        pytest.fail(f"{ENV_VAR}={value} is not a file")
    return python


@pytest.fixture(scope="module")
def venv315(pep829_python, wheel, tmp_path_factory) -> Path:
    """A venv of that Python with pip (from the index), a real wrapt, and the wheel installed by ``pip install``."""
    dest = tmp_path_factory.mktemp("pep829") / "venv"
    subprocess.run([str(pep829_python), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120,
                   capture_output=True)
    python = dest / "bin" / "python"
    run_uv("pip", "install", "--python", str(python), "pip", "wrapt>=2")
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True,
                          text=True, timeout=600, check=False, env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python


def test_pip_install_activates_through_the_start_file(venv315, tmp_path):
    site = site_packages(venv315)
    assert (site / PTH).is_file() and (site / START).is_file()
    proc = run_program("pep829_started", python=venv315, flags=("-v",), env=clean_env(), cwd=tmp_path, timeout=60)
    out, _ = reported(proc)
    assert tuple(out["version"]) >= (3, 15), out["version"]
    assert out["waiting"] == ["start"], (
        f"not armed by the .start entry point ({out['waiting']}): does this Python implement PEP 829?")
    assert out["heavy"] == []  # armed, idle: neither the package nor wrapt imported at start-up
    # site's own trace (-v): the .pth's import line was skipped because of the matching .start file.
    skipped = [ln for ln in proc.stderr.splitlines() if str(site / PTH) in ln and str(site / START) in ln]
    assert skipped and "suppress" in skipped[0], proc.stderr[-3000:]
    observed("pythons", ".".join(map(str, out["version"][:3])), pip="armed by the .start file (PEP 829)")


def test_without_the_start_file_the_pth_line_runs(venv315, tmp_path):
    """Take the ``.start`` away: 3.15-3.17 still run the ``.pth``'s import line (PEP 829's deprecation period;
    3.18 ignores it), so the ``.start`` file is what switched it off above."""
    site = site_packages(venv315)
    saved = tmp_path / START
    shutil.move(site / START, saved)
    try:
        out, _ = run_reporting("pep829_started", python=venv315, env=clean_env(), cwd=tmp_path)
    finally:
        shutil.move(saved, site / START)
    assert out["waiting"] == (["pth"] if tuple(out["version"][:2]) < (3, 18) else [])


def test_start_armed_finder_installs_the_hook_on_import_vllm(venv315, tmp_path):
    standin = tmp_path / "standin"
    (standin / "vllm").mkdir(parents=True)
    (standin / "vllm" / "__init__.py").write_text("__version__ = '0+standin'\n")
    out, log = run_reporting("import_standin", python=venv315, env=clean_env(PYTHONPATH=str(standin)), cwd=tmp_path)
    assert Path(out["vllm"]).parent == standin / "vllm"
    assert out["activations"] == ["start"] and out["hook_installed"] is True and out["waiting"] is False
    assert Path(out["wrapt"]).is_relative_to(site_packages(venv315)), log[-2000:]


def test_doctor_names_the_start_file(venv315, tmp_path):
    proc = subprocess.run([str(venv315), "-m", "vllm_minicpm_hotfix", "doctor", "--json"], env=clean_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(proc.stdout)
    pth = report["activation"]["pth"]
    assert pth["runs"] == "start" and pth["start_files"] == [str(site_packages(venv315) / START)]
    row = next(r for r in report["checks"] if r["check"] == ".pth")
    assert row["status"] == "OK" and "PEP 829" in row["detail"] and START in row["detail"]
    # No vLLM for this Python: doctor says so (exit 1), after the start-up facts above.
    assert proc.returncode == 1 and "vLLM is not installed" in report["summary"]
