"""The activation paths, each in real interpreters of this environment (real start-up: ``site``, ``.pth`` files,
``sitecustomize``; real vLLM imports), never in-process mocks:

* ``pip install`` -> ``vllm-minicpm-hotfix.pth`` (_vllm_minicpm_hotfix_arm.py, then vllm_minicpm_hotfix/_bootstrap.py
  at ``import vllm``) and the ``vllm.general_plugins`` entry point (vllm_minicpm_hotfix/plugin.py);
* PYTHONPATH injection -> the top-level ``sitecustomize.py``, alone or in a ``vllm-minicpm-hotfix bundle`` folder
  (vllm_minicpm_hotfix/cli/bundle.py) with its pure-Python wrapt.

"Installed" always means a throwaway overlay of this environment (tests/support/venvs.py), never the shared one.
Only three tests import vLLM (~30 s each); the rest start bare interpreters (~50 ms).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from support.paths import REPO
from support.placement import FULL_ENVS
from support.venvs import clean_env, overlay_env, pip_install, site_packages, source_copy
from support.hotfix_log import patched_pids, summaries
from support.programs import PROGRAMS, run_program, run_reporting, site_copy

from vllm_minicpm_hotfix import _bootstrap
from vllm_minicpm_hotfix.cli import bundle
from support.activation import HEAVY, started, import_m46

pytestmark = pytest.mark.placed(*FULL_ENVS)


# --------------------------------------------------------------------------------------------------------------------
# Packaging: the wheel ships the .pth and the entry point; pip install and pip install -e both get the .pth
# --------------------------------------------------------------------------------------------------------------------


def z_read(wheel, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name).decode()


def test_wheel_ships_pth_start_entry_point_and_no_sitecustomize(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        pth = z.read("vllm-minicpm-hotfix.pth").decode()
        start = z.read("vllm-minicpm-hotfix.start").decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
        template = z.read("vllm_minicpm_hotfix/_sitecustomize.py.txt").decode()
    assert pth == (REPO / "vllm-minicpm-hotfix.pth").read_text()
    # PEP 829 (Python 3.15+): the matching .start file, next to the .pth at the root; one entry point, no import line.
    assert start == (REPO / "vllm-minicpm-hotfix.start").read_text()
    entries = [ln.strip() for ln in start.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert entries == ["_vllm_minicpm_hotfix_arm:start"]
    assert "[vllm.general_plugins]" in entry_points
    assert "minicpm_hotfix = vllm_minicpm_hotfix.plugin:register" in entry_points
    assert template == (REPO / "sitecustomize.py").read_text()
    # A top-level sitecustomize.py in site-packages would shadow the image's own: never shipped.
    assert "sitecustomize.py" not in names
    assert {"vllm_minicpm_hotfix/_bootstrap.py", "vllm_minicpm_hotfix/plugin.py"} <= names
    # The start-up module the .pth imports sits at the wheel's root, next to the package.
    assert z_read(wheel, "_vllm_minicpm_hotfix_arm.py") == (REPO / "_vllm_minicpm_hotfix_arm.py").read_text()


def test_editable_install_ships_the_pth(work, tmp_path):
    """``uv pip install -e .`` (PEP 660, hatchling's editable wheel): the .pth and the .start file land in
    site-packages and arm the hotfix from the source tree. (tests/activation/test_install_modes.py: ``pip install -e .``.)"""
    src = source_copy(tmp_path / "src")
    python = overlay_env(tmp_path / "env")
    pip_install(python, "-e", str(src))
    for name in ("vllm-minicpm-hotfix.pth", "vllm-minicpm-hotfix.start"):
        assert (site_packages(python) / name).read_text() == (REPO / name).read_text(), name
    out, _ = run_reporting("package_file", python=python, env=clean_env(), cwd=tmp_path)
    assert out["waiting"] == ["pth"]
    assert Path(out["file"]).resolve().is_relative_to(src.resolve())


# --------------------------------------------------------------------------------------------------------------------
# Start-up cost: every path defers wrapt, torch and vLLM
# --------------------------------------------------------------------------------------------------------------------


def test_pth_adds_one_small_module_at_start_up_and_nothing_heavy(pip_env, tmp_path):
    plain, _ = started(sys.executable, cwd=tmp_path)
    armed, _ = started(pip_env, cwd=tmp_path)
    added = set(armed["modules"]) - set(plain["modules"])
    assert added == {"_vllm_minicpm_hotfix_arm"}, added  # not even the package: it waits for `import vllm`
    assert not [m for m in armed["modules"] if m.split(".")[0] in HEAVY]
    assert armed["waiting"] == ["pth"]


def test_pth_without_its_start_up_module_reports_and_start_up_goes_on(wheel, tmp_path):
    """A broken install (the ``.pth`` left, ``_vllm_minicpm_hotfix_arm.py`` gone): the ``.pth`` line is a plain
    import (no ``try``, no ``exec``: that costs ~85 us at every start), so Python's ``site`` reports it -- loudly, at
    every start, which is what a broken install should do -- and start-up goes on unarmed."""
    python = overlay_env(tmp_path / "env")
    pip_install(python, str(wheel))
    (site_packages(python) / "_vllm_minicpm_hotfix_arm.py").unlink()
    proc = run_program("print_ran", python=python, env=clean_env(), cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    assert "Error processing line 4 of" in proc.stderr and "vllm-minicpm-hotfix.pth" in proc.stderr
    assert "No module named '_vllm_minicpm_hotfix_arm'" in proc.stderr


@pytest.mark.parametrize("where", ["repo", "bundle"])
def test_sitecustomize_adds_nothing_heavy_at_start_up(where, bundle_dir, tmp_path):
    folder = REPO if where == "repo" else bundle_dir
    plain, _ = started(sys.executable, cwd=tmp_path)
    armed, _ = started(sys.executable, pythonpath=str(folder), cwd=tmp_path)
    added = set(armed["modules"]) - set(plain["modules"])
    assert added == {"sitecustomize", "_vllm_minicpm_hotfix_arm"}, added
    assert not [m for m in armed["modules"] if m.split(".")[0] in HEAVY]
    assert Path(armed["sitecustomize"]).resolve() == (folder / "sitecustomize.py").resolve()
    assert armed["waiting"] == ["sitecustomize"]


# --------------------------------------------------------------------------------------------------------------------
# sitecustomize chains to the image's own
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def image_site(tmp_path) -> Path:
    """A folder standing in for the image's site directory, with its own sitecustomize (as Debian/Ubuntu ship)."""
    return site_copy("image_site", tmp_path / "image-site")  # sets sys.image_sitecustomize_ran = __name__


@pytest.mark.parametrize("where", ["repo", "bundle"])
def test_sitecustomize_chains_to_the_next_one(where, bundle_dir, image_site, tmp_path):
    folder = REPO if where == "repo" else bundle_dir
    out, log = started(sys.executable, pythonpath=f"{folder}:{image_site}", cwd=tmp_path)
    assert out["image_marker"] == "sitecustomize"  # the image's ran, under its own name
    assert Path(out["chained"]).resolve() == (image_site / "sitecustomize.py").resolve()
    assert Path(out["sitecustomize"]).resolve() == (folder / "sitecustomize.py").resolve()
    assert out["waiting"] == ["sitecustomize"]
    assert "Error" not in log


def test_sitecustomize_without_a_next_one_and_twice_on_the_path(bundle_dir, image_site, tmp_path):
    alone, _ = started(sys.executable, pythonpath=str(bundle_dir), cwd=tmp_path)
    assert alone["chained"] is None and alone["image_marker"] is None
    # Repository and bundle both on the path, then the image's: each ours chains to the next, the image's runs once.
    twice, _ = started(sys.executable, pythonpath=f"{REPO}:{bundle_dir}:{image_site}", cwd=tmp_path)
    assert twice["image_marker"] == "sitecustomize"
    assert len(twice["waiting"]) == 1


def test_sitecustomize_skips_its_own_folder_under_another_name(bundle_dir, image_site, tmp_path):
    """The bundle on the path twice, first through a symbolic link: the next ``sitecustomize`` found by name is this
    folder again, so ``_find_next`` falls back to resolving every entry and chains to the image's, once."""
    link = tmp_path / "bundle-link"
    link.symlink_to(bundle_dir, target_is_directory=True)
    out, log = started(sys.executable, pythonpath=f"{link}:{bundle_dir}:{image_site}", cwd=tmp_path)
    assert out["image_marker"] == "sitecustomize"
    assert Path(out["chained"]).resolve() == (image_site / "sitecustomize.py").resolve()
    assert out["waiting"] == ["sitecustomize"]
    assert "Error" not in log


def test_sitecustomize_never_raises(bundle_dir, image_site, tmp_path):
    """The image's sitecustomize fails: start-up goes on, reported the way Python reports its own; the hotfix is
    still armed. A broken package next to ours does not stop the chain either."""
    shutil.copy(PROGRAMS / "broken_image_site" / "sitecustomize.py", image_site / "sitecustomize.py")
    out, log = started(sys.executable, pythonpath=f"{bundle_dir}:{image_site}", cwd=tmp_path)
    assert "Error in sitecustomize" in log and "image sitecustomize broke" in log
    assert out["waiting"] and out["chained"] is None

    broken = tmp_path / "broken"
    shutil.copytree(bundle_dir, broken)
    (broken / "_vllm_minicpm_hotfix_arm.py").write_text("raise ImportError('synthetic')\n")  # its .pyc is stale now
    shutil.copy(PROGRAMS / "image_site" / "sitecustomize.py", image_site / "sitecustomize.py")  # the working one again
    out, log = started(sys.executable, pythonpath=f"{broken}:{image_site}", cwd=tmp_path)
    assert out["waiting"] == [] and out["image_marker"] == "sitecustomize"
    assert "Traceback" not in log


# --------------------------------------------------------------------------------------------------------------------
# VLLM_MINICPM_HOTFIX=off and the plugin's register()
# --------------------------------------------------------------------------------------------------------------------


def test_off_disables_every_automatic_path(pip_env, bundle_dir, tmp_path):
    """pth + sitecustomize + plugin all present, ``VLLM_MINICPM_HOTFIX=off``: nothing armed at start-up, nothing
    imported, and ``register()`` -- what vLLM calls in each of its processes -- installs nothing. vLLM itself is not
    imported (30 s): with no finder armed and no hook registered, nothing is left that could patch it."""
    out, _ = started(pip_env, pythonpath=str(bundle_dir), cwd=tmp_path, VLLM_MINICPM_HOTFIX="off")
    assert out["waiting"] == []
    assert not [m for m in out["modules"] if m.split(".")[0] in HEAVY]
    reg, _ = run_reporting("register", python=pip_env,
                           env=clean_env(PYTHONPATH=str(bundle_dir), VLLM_MINICPM_HOTFIX="off"), cwd=tmp_path)
    assert reg == {"result": "None", "installed": False, "activations": [], "wrapt": None, "waiting": []}


def test_register_never_raises(bare_env, tmp_path):
    """No wrapt anywhere (package on sys.path by hand, no bundle), then a wrapt that raises on import: register()
    returns None, logs why, and leaves the hook uninstalled."""
    env = clean_env(PYTHONPATH="")
    out, log = run_reporting("register", "--append", REPO, python=bare_env, env=env, cwd=tmp_path)
    assert out["result"] == "None" and out["installed"] is False and out["activations"] == []
    assert "could not activate (plugin)" in log and "wrapt" in log

    broken = tmp_path / "broken-wrapt"
    (broken / "wrapt").mkdir(parents=True)
    (broken / "wrapt" / "__init__.py").write_text("raise RuntimeError('broken wrapt')\n")
    out, log = run_reporting("register", "--prepend", broken, "--prepend", REPO, env=env, cwd=tmp_path)
    assert out["result"] == "None" and out["installed"] is False
    assert "broken wrapt" in log


def test_bundle_uses_its_wrapt_only_when_the_environment_has_none(bare_env, bundle_dir, tmp_path):
    """install_now() (what the finder calls on ``import vllm``) picks the environment's wrapt where there is one."""
    with_wrapt, _ = run_reporting("register", "--install-now", env=clean_env(PYTHONPATH=str(bundle_dir)),
                                  cwd=tmp_path)
    assert with_wrapt["installed"] is True
    assert Path(with_wrapt["wrapt"]).resolve().is_relative_to(site_packages().resolve())
    without, _ = run_reporting("register", "--install-now", python=bare_env,
                               env=clean_env(PYTHONPATH=str(bundle_dir)), cwd=tmp_path)
    assert without["installed"] is True
    assert Path(without["wrapt"]).resolve().is_relative_to((bundle_dir / _bootstrap.VENDOR_DIR).resolve())


# --------------------------------------------------------------------------------------------------------------------
# The paths activate when vLLM imports the model module (these import vLLM: ~30 s each)
# --------------------------------------------------------------------------------------------------------------------


def test_pth_activates_on_import_and_plugin_is_idempotent(pip_env, expected, release, tmp_path):
    out, log = import_m46(pip_env, cwd=tmp_path)
    st = out["status"]
    assert out["activations_before_plugins"] == ["pth"]
    assert out["activations"] == ["pth", "plugin"]  # vLLM found and called our entry point; a no-op now
    assert out["waiting"] == []  # the finder took itself off sys.meta_path
    assert st["hook_installed"] and st["module_imported"]
    assert st["vllm_version"].split("+")[0] == release
    assert st["fixes"]["qkv_loader"]["verdict"] == expected[0]
    assert out["qkv_patched"] is (expected[0] == "broken")
    assert len(patched_pids(log, "qkv_loader")) == (1 if expected[0] == "broken" else 0)
    assert [s["pid"] for s in summaries(log)] == [st["pid"]]  # one summary line for the process
    assert Path(out["package"]).resolve().is_relative_to(site_packages(pip_env).resolve())


def test_bundle_without_wrapt_activates_with_its_own_wrapt(bare_env, bundle_dir, tmp_path):
    out, log = import_m46(bare_env, pythonpath=str(bundle_dir), cwd=tmp_path, VLLM_MINICPM_HOTFIX="force")
    assert out["activations"] == ["sitecustomize"]  # no entry point: the package is not installed
    assert Path(out["package"]).resolve().is_relative_to(bundle_dir.resolve())
    assert Path(out["wrapt"]).resolve().is_relative_to((bundle_dir / _bootstrap.VENDOR_DIR).resolve())
    assert out["qkv_patched"] and out["status"]["fixes"]["qkv_loader"]["applied"]
    assert patched_pids(log, "qkv_loader") == [str(out["status"]["pid"])]


def test_pip_and_bundle_together_patch_once(pip_env, bundle_dir, tmp_path):
    """Both installed and injected (force, so every release patches): one copy of the package runs (the bundle's,
    first on sys.path), one hook, one patch per fix."""
    out, log = import_m46(pip_env, pythonpath=str(bundle_dir), cwd=tmp_path, VLLM_MINICPM_HOTFIX="force")
    pid = str(out["status"]["pid"])
    assert Path(out["package"]).resolve().is_relative_to(bundle_dir.resolve())
    assert out["activations_before_plugins"] == ["pth"]  # .pth first; sitecustomize found the finder armed
    assert out["activations"] == ["pth", "plugin"]
    assert out["qkv_patched"]
    assert patched_pids(log, "qkv_loader") == [pid]
    assert len(summaries(log)) == 1  # two copies of the package, one summary line
    if out["status"]["fixes"].get("processor_downsample_mode", {}).get("applied"):
        assert patched_pids(log, "processor_downsample_mode") == [pid]
    # Installed wrapt, not the bundle's
    assert Path(out["wrapt"]).resolve().is_relative_to(site_packages().resolve())


# --------------------------------------------------------------------------------------------------------------------
# The bundle command
# --------------------------------------------------------------------------------------------------------------------


def test_bundle_layout_and_rebundle(tmp_path):
    dest = tmp_path / "b"
    manifest = bundle.write_bundle(dest)
    assert (dest / "sitecustomize.py").read_text() == (REPO / "sitecustomize.py").read_text()
    assert (dest / "vllm_minicpm_hotfix" / "_bootstrap.py").is_file()
    assert (dest / "_vllm_minicpm_hotfix_arm.py").read_text() == (REPO / "_vllm_minicpm_hotfix_arm.py").read_text()
    assert not list(dest.rglob("*.so"))
    # Bytecode for this interpreter, hash-checked (flags 0b11 in the .pyc header, PEP 552): valid after a copy.
    tag = sys.implementation.cache_tag
    for source in ("sitecustomize", "_vllm_minicpm_hotfix_arm"):
        pyc = dest / "__pycache__" / f"{source}.{tag}.pyc"
        assert int.from_bytes(pyc.read_bytes()[4:8], "little") == 0b11, pyc
    assert (dest / "vllm_minicpm_hotfix" / "__pycache__" / f"_bootstrap.{tag}.pyc").is_file()
    assert (dest / _bootstrap.VENDOR_DIR / "wrapt" / "__init__.py").is_file()
    assert (dest / _bootstrap.VENDOR_DIR / "wrapt" / "LICENSE").is_file()
    assert json.loads((dest / bundle.MANIFEST).read_text()) == manifest
    bundle.write_bundle(dest)  # an earlier bundle is replaced
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    assert bundle.main([str(other)]) == 1 and (other / "keep.txt").is_file()


def test_bundle_from_a_pip_install(pip_env, tmp_path):
    """``vllm-minicpm-hotfix bundle`` run from an installed wheel (no repository around) writes the same files."""
    dest = tmp_path / "from-wheel"
    proc = subprocess.run(
        [str(pip_env), "-m", "vllm_minicpm_hotfix", "bundle", str(dest)],
        cwd=tmp_path, env=clean_env(), capture_output=True, check=False, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (dest / "sitecustomize.py").read_text() == (REPO / "sitecustomize.py").read_text()
    assert (dest / "vllm_minicpm_hotfix" / "plugin.py").read_text() == (REPO / "vllm_minicpm_hotfix" / "plugin.py").read_text()
    assert not (dest / "vllm_minicpm_hotfix" / "_sitecustomize.py.txt").exists()
