"""Install modes people use, each in a throwaway environment: the PEP 829 ``.start`` entry point, ``pip install -e .``,
``pip install --target DIR`` + ``PYTHONPATH=DIR``. Each activates the hotfix, or ``doctor`` explains why not.

Covered elsewhere: the wheel installed by ``uv pip install`` into a venv (the ``pip_env`` fixture;
``tests/activation/test_activation.py::test_pth_activates_on_import_and_plugin_is_idempotent`` imports vLLM there),
``uv pip install -e .`` (``tests/activation/test_activation.py::test_editable_install_ships_the_pth``), and the ``.start`` file read
by a Python that implements PEP 829 (``tests/activation/test_pep829.py``). Three vLLM processes (~40 s each), so it is placed on
one release, 0.28.0, where stock vLLM is broken and the editable install's patch shows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import REPO
from support.venvs import clean_env, overlay_env, run_uv, site_packages, source_copy
from support.hotfix_log import patched_pids
from support.programs import run_reporting
from support.activation import HEAVY, import_m46, started

pytestmark = pytest.mark.placed("0.28.0")

START = "vllm-minicpm-hotfix.start"
PTH = "vllm-minicpm-hotfix.pth"
#: PEP 829's entry point syntax, as ``pkgutil.resolve_name(name, strict=True)`` of Python 3.15 checks it.
STRICT_ENTRY_POINT = re.compile(r"^(?!\d)\w+(\.(?!\d)\w+)*:(?!\d)\w+(\.(?!\d)\w+)*$")

def test_start_entry_point_resolves_and_arms_once(pip_env, tmp_path):
    """The installed ``.start`` file's entry point resolves with ``pkgutil.resolve_name`` (which imports the
    module) and arms the waiting finder in a fresh interpreter (``-S``: no ``.pth`` ran before it), labelled "start",
    idempotently with itself and the ``.pth``; in a normal start-up (the ``.pth`` armed it) it arms nothing twice;
    ``VLLM_MINICPM_HOTFIX=off``: nothing."""
    site = site_packages(pip_env)
    out, _ = run_reporting("resolve_start", site, python=pip_env, flags=("-S",), env=clean_env(), cwd=tmp_path,
                           timeout=60)
    assert out["entries"] == ["_vllm_minicpm_hotfix_arm:start"]
    assert all(STRICT_ENTRY_POINT.match(e) for e in out["entries"])
    assert out["results"] == [["_vllm_minicpm_hotfix_arm:start", True, "None", "None"]]
    assert out["before"] == [] and out["after_start"] == ["start"]
    assert out["pth_line"] is False and out["after_pth"] == ["start"]
    assert not [m for m in out["modules"] if m.split(".")[0] in HEAVY + ("vllm_minicpm_hotfix",)]

    # Normal start-up of this Python (< 3.15: site runs the .pth, ignores the .start): armed once, by the .pth.
    normal, _ = run_reporting("resolve_start", site, python=pip_env, env=clean_env(), cwd=tmp_path)
    assert normal["before"] == ["start" if sys.version_info >= (3, 15) else "pth"]
    assert len(normal["after_start"]) == len(normal["after_pth"]) == 1  # (site never calls start() before 3.15)

    off, _ = run_reporting("resolve_start", site, python=pip_env, flags=("-S",),
                           env=clean_env(VLLM_MINICPM_HOTFIX="off"), cwd=tmp_path, timeout=60)
    assert off["after_pth"] == []


def test_pip_editable_install_activates(tmp_path, expected):
    """``pip install -e .`` with pip itself (build isolation: hatchling from the index): the ``.pth`` and ``.start``
    land in site-packages, start-up arms the hotfix from the clone, and vLLM's model module is patched on import."""
    src = source_copy(tmp_path / "src")
    python = overlay_env(tmp_path / "env")
    run_uv("pip", "install", "--python", str(python), "pip")  # pip into the overlay only
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(src)],
                          env=clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    site = site_packages(python)
    for name in (PTH, START):
        assert (site / name).read_text() == (REPO / name).read_text(), name
    out, log = import_m46(python, cwd=tmp_path)
    assert out["activations_before_plugins"] == ["pth"] and out["waiting"] == []
    assert Path(out["package"]).resolve().is_relative_to(src.resolve())
    assert out["status"]["fixes"]["qkv_loader"]["verdict"] == expected[0]
    assert out["qkv_patched"] is (expected[0] == "broken")
    assert patched_pids(log, "qkv_loader") == ([str(out["status"]["pid"])] if expected[0] == "broken" else [])


def test_target_dir_on_pythonpath_doctor_explains(wheel, tmp_path, expected):
    """``pip install --target DIR`` + ``PYTHONPATH=DIR``: ``site`` never reads the ``.pth``/``.start`` there, so
    nothing is armed at start-up; vLLM's own plugin loading still finds the entry point (the dist-info is on
    sys.path). ``doctor`` says the ``.pth`` does not run there and names the bundle as the route that does."""
    target = tmp_path / "target"
    run_uv("pip", "install", "--no-deps", "--python", sys.executable, "--target", str(target), str(wheel))
    assert (target / PTH).is_file() and (target / START).is_file() and (target / "vllm_minicpm_hotfix").is_dir()

    armed, _ = started(sys.executable, pythonpath=str(target), cwd=tmp_path)
    assert armed["waiting"] == []  # the .pth did not run

    # Without vLLM's plugin loading (a script importing the model module directly): not patched.
    direct, _ = import_m46(sys.executable, "--no-plugins", pythonpath=str(target), cwd=tmp_path)
    assert direct["activations"] == [] and direct["qkv_patched"] is False

    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix", "doctor", "--json"], cwd=tmp_path,
                          env=clean_env(PYTHONPATH=str(target)), capture_output=True, text=True, timeout=900,
                          check=False)
    report = json.loads(proc.stdout)
    pth = report["activation"]["pth"]
    assert pth["files"] == [] and pth["runs"] is None
    assert pth["outside_site_dirs"] == [str(target / PTH)]
    rows = [r for r in report["checks"] if r["check"] == ".pth" and r["status"] == "WARN"]
    assert len(rows) == 1 and "not in a site directory" in rows[0]["detail"]
    assert "vllm-minicpm-hotfix bundle" in rows[0]["detail"]
    # In a vLLM process the plugin entry point activates it (vLLM loads general plugins before model classes).
    steps = report["child"]["steps"]
    assert steps["startup"]["waiting_for_vllm"] is False and steps["plugins"]["activations"] == ["plugin"]
    assert report["fixes"]["qkv_loader"]["applied"] is (expected[0] == "broken")
    assert report["ok"] is True and proc.returncode == 0, report["summary"]
