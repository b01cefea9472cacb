"""The interpreters vLLM images run: CPython 3.12 (vLLM's own images) and 3.13, besides the suite's 3.11.

For each, the same vLLM release in an environment built by ``scripts/cpu-env RELEASE --python X.Y`` (reused when it
exists; built, ~1-2 min, when it does not), and in an overlay of it each route loads the bundled tiny checkpoint
through vLLM's own ``load_weights``:

* pip: the wheel (the one this session built) installed by ``uv pip install`` -- armed by the ``.pth``;
* bundle: an overlay *without* wrapt (an image as shipped), ``PYTHONPATH=<bundle>`` made by *another* Python (3.13's
  bundle on 3.12, the suite's 3.11 one on 3.13) -- armed by ``sitecustomize.py``, with the bundle's pure-Python wrapt.

In the same process the vit_merger ``qkv_proj`` must equal ``cat(q, k, v)`` of the checkpoint bit for bit, and after
the fix is reverted stock vLLM must fail with the release's error (the release must be a broken one: 0.28.0).
One vLLM process per Python and route (4 in all, ~40 s each on a quiet 2-core machine), so the module is placed on one
release, 0.28.0 (its -py3.12/-py3.13 environments come from locks/vllm-0.28.0-py3.1X.txt).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.observed import observed
from support.paths import REPO, TINY
from support.venvs import clean_env, make_bundle, overlay_env, pip_install
from support.hotfix_log import patched_pids
from support.programs import run_reporting

from vllm_minicpm_hotfix import _bootstrap

pytestmark = pytest.mark.placed("0.28.0")

VERSIONS = ("3.12", "3.13")
#: Who makes the bundle each Python loads: never itself ("suite": this suite's own interpreter, 3.11).
BUNDLE_MADE_BY = {"3.12": "3.13", "3.13": "suite"}

@pytest.fixture(scope="module")
def broken_release(release, expected) -> str:
    if expected[0] != "broken" or not expected[1]:
        pytest.fail(f"tests/activation/test_pythons.py must run on a release where stock vLLM is broken (0.28.0), not {release}: "
                    f"its placement (pytestmark) says where")
    return release


@pytest.fixture(scope="module")
def pythons(broken_release) -> dict[str, Path]:
    """version -> interpreter of ``scripts/cpu-env RELEASE --python X.Y`` (and "suite": this suite's own)."""
    out = {"suite": Path(sys.executable)}
    for v in VERSIONS:
        proc = subprocess.run([str(REPO / "scripts" / "cpu-env"), broken_release, "--python", v], capture_output=True,
                              text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            pytest.fail(f"scripts/cpu-env {broken_release} --python {v} failed:\n{proc.stderr[-3000:]}")
        out[v] = Path(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture(scope="module")
def bundles(pythons, tmp_path_factory) -> dict[str, Path]:
    """maker version -> a bundle written by ``vllm-minicpm-hotfix bundle`` run with that Python."""
    root = tmp_path_factory.mktemp("bundles")
    return {maker: make_bundle(root / f"by-{maker}", pythons[maker]) for maker in set(BUNDLE_MADE_BY.values())}


@pytest.mark.parametrize("route", ["pip", "bundle"])
@pytest.mark.parametrize("version", VERSIONS)
def test_route_loads_exactly_on(version, route, pythons, bundles, wheel, broken_release, expected, tmp_path):
    python = pythons[version]
    if route == "pip":
        env_python = overlay_env(tmp_path / "env", over=python)
        pip_install(env_python, str(wheel))
        env = clean_env()
        expect_source, home = "pth", None
    else:
        env_python = overlay_env(tmp_path / "env", over=python, wrapt=False)
        home = bundles[BUNDLE_MADE_BY[version]]
        env = clean_env(PYTHONPATH=str(home))
        expect_source = "sitecustomize"
    out, log = run_reporting("load_on_python", TINY, python=env_python, env=env, cwd=tmp_path, timeout=600)
    assert out["python"].startswith(version + "."), out["python"]
    assert out["activations"][0] == expect_source, out["activations"]
    if route == "pip":
        assert "/site-packages/" in out["package"] and Path(out["package"]).is_relative_to(tmp_path / "env")
    else:
        assert Path(out["package"]).is_relative_to(home)
        assert Path(out["wrapt"]).is_relative_to(home / _bootstrap.VENDOR_DIR)  # the image has none
        made_by = json.loads((home / "vllm-minicpm-hotfix-bundle.json").read_text())["made_with_python"]
        assert not made_by.startswith(version + ".")
    assert patched_pids(log, "qkv_loader") == [str(out["pid"])]
    assert out["exact"] == {"weight": True, "bias": True} and out["distinct"]
    assert set(out["qkv_loaded"]) == {"vit_merger.self_attn.qkv_proj.weight", "vit_merger.self_attn.qkv_proj.bias"}
    # The same vLLM with the fix reverted: stock fails with the error users report on this release.
    assert out["reverted"] is True
    assert out["stock_error"] is not None and expected[1] in out["stock_error"], out["stock_error"]
    observed("pythons", out["python"], **{route: "loads, exact"})


def test_bundle_bytecode_is_per_python_and_never_stale(pythons, bundles, tmp_path):
    """A bundle holds hash-checked bytecode for the Python that made it only (``__pycache__/*.cpython-3XY.pyc``):
    another Python compiles the sources itself and arms; the maker's own bytecode is not used once a source changed."""
    made = bundles["3.13"]
    tags = {p.name.split(".")[1] for p in (made / "__pycache__").glob("*.pyc")}
    assert tags == {"cpython-313"}, tags
    for v in ("suite", "3.12"):
        out, _ = run_reporting("arm_module", python=pythons[v],
                               env=clean_env(PYTHONPATH=str(made), PYTHONDONTWRITEBYTECODE="1"), cwd=tmp_path)
        assert out["waiting"] == ["sitecustomize"], (v, out)
    # A changed source with the maker's (now stale) hash-checked .pyc next to it: the source wins.
    copy = tmp_path / "edited"
    shutil.copytree(made, copy)
    arm = copy / "_vllm_minicpm_hotfix_arm.py"
    arm.write_text(arm.read_text() + "\nSTALE_MARKER = 'source read'\n")
    out, _ = run_reporting("arm_module", python=pythons["3.13"],
                           env=clean_env(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1"), cwd=tmp_path)
    assert out["stale_marker"] == "source read" and out["waiting"] == ["sitecustomize"]
