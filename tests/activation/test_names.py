"""Names the package defines once and the files that cannot import them spell again.

The start-up module ``_vllm_minicpm_hotfix_arm``, ``sitecustomize.py`` and the ``.pth`` file run at interpreter
start-up and may import nothing from the package, and pyproject.toml is not Python: each keeps its own spelling of a
name the package defines (in :mod:`vllm_minicpm_hotfix._bootstrap`, :mod:`vllm_minicpm_hotfix.plugin`,
:mod:`vllm_minicpm_hotfix.decision`). These tests keep the copies equal to the definitions; everything else imports
the definition.

Placed on the two full environments (``support.placement.FULL_ENVS``): the names do not depend on the vLLM release.
"""

from __future__ import annotations

import ast
import re

import pytest
from support.paths import REPO
from support.placement import FULL_ENVS
from vllm_minicpm_hotfix import _bootstrap, decision, hook, plugin
from vllm_minicpm_hotfix.cli import bundle
from vllm_minicpm_hotfix.cli.doctor import facts as doctor_facts
from vllm_minicpm_hotfix.fixes import qkv_loader

pytestmark = pytest.mark.placed(*FULL_ENVS)


def _assigned(path, name):
    """The literal value of the module-level assignment ``name = ...`` in ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} has no {name} = ...")


def test_start_up_module_copies():
    import _vllm_minicpm_hotfix_arm as arm

    assert arm.__name__ == _bootstrap.ARM_MODULE
    assert arm.FINDER_FLAG == _bootstrap.FINDER_FLAG and getattr(arm, _bootstrap.FINDER_FLAG) is True
    assert arm.ENV_VAR == decision.ENV_VAR and arm.OFF_VALUES == decision.OFF_VALUES
    assert (REPO / bundle.ARM_FILE).is_file()


def test_start_up_files_import_the_start_up_module():
    import _vllm_minicpm_hotfix_arm as arm

    pth = REPO / _bootstrap.PTH_NAME
    code = [ln for ln in pth.read_text().splitlines() if ln and not ln.startswith("#")]
    assert code == [f"import {_bootstrap.ARM_MODULE}"], code
    start = REPO / _bootstrap.START_NAME
    entries = [ln for ln in start.read_text().splitlines() if ln and not ln.startswith("#")]
    assert entries == [f"{_bootstrap.ARM_MODULE}:start"] and callable(arm.start), entries


def test_sitecustomize_carries_the_marker_and_imports_the_start_up_module():
    sc = REPO / "sitecustomize.py"
    assert _assigned(sc, _bootstrap.SITECUSTOMIZE_MARKER) is True
    assert bundle.SITECUSTOMIZE_LINE in sc.read_text()
    assert f"import {_bootstrap.ARM_MODULE}  #" in sc.read_text()


def test_pyproject_names_the_same_files_and_entry_point():
    text = (REPO / "pyproject.toml").read_text()
    table = re.search(r'^\[project\.entry-points\."([^"]+)"\]\n(\w+) = "([^"]+)"', text, re.MULTILINE)
    assert table is not None, "pyproject.toml declares no entry-point table"
    assert table.groups() == (plugin.GROUP, plugin.NAME, f"{plugin.__name__}:{plugin.register.__name__}")
    for name in (_bootstrap.PTH_NAME, _bootstrap.START_NAME):
        assert f'"{name}" = "{name}"' in text, name  # shipped at the wheel's root
    assert f'"{bundle.ARM_FILE}"' in text and f'"{bundle.PACKAGE}"' in text


def test_the_child_gets_the_names_from_their_owners(m46):
    names = doctor_facts.child_names()
    assert names == {"package": bundle.PACKAGE, "model_module": hook.TARGET_MODULE,
                     "finder_flag": _bootstrap.FINDER_FLAG, "sitecustomize_marker": _bootstrap.SITECUSTOMIZE_MARKER}
    assert hook.TARGET_MODULE == m46.__name__ and bundle.PACKAGE == hook.__name__.split(".")[0]
    assert getattr(m46, qkv_loader.MODEL_CLASS).__name__ == qkv_loader.MODEL_CLASS
