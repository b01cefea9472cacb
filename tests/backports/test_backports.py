"""The backports' registry (``vllm_minicpm_hotfix.backports.BACKPORTS``): every backport has the interface, its
``NAME`` is its module's name, it has a test file of its own, and importing the package imports neither vLLM,
torch nor transformers (a fresh interpreter).

Placement: one environment (the package's own code: the same everywhere, support.placement.LOGIC_ENV).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.placement import LOGIC_ENV
from support.programs import run_program
from vllm_minicpm_hotfix import backports
from vllm_minicpm_hotfix.decision import Verdict

pytestmark = pytest.mark.placed(*LOGIC_ENV)


@pytest.mark.parametrize("backport", backports.BACKPORTS, ids=lambda b: b.NAME)
def test_every_backport_has_the_interface(backport):
    assert backport.NAME == backport.__name__.rpartition(".")[2]
    for attr in ("LABEL", "ARCH", "MEMBER"):
        assert isinstance(getattr(backport, attr), str) and getattr(backport, attr), attr
    for fn in ("probe", "register", "unregister"):
        assert callable(getattr(backport, fn)), fn
    assert isinstance(backport.probe(_EmptyRegistry()), Verdict)  # never raises, whatever it is handed
    assert (Path(__file__).parent / f"test_{backport.NAME}.py").is_file()
    assert backports.by_name(backport.NAME) is backport
    with pytest.raises(KeyError, match="known"):
        backports.by_name("no_such_backport")


class _EmptyRegistry:
    """A registry with no architectures (what the probe reads of vLLM's ``ModelRegistry``)."""

    models: dict = {}

    @staticmethod
    def get_supported_archs():
        return set()


def test_importing_the_package_imports_no_vllm_torch_or_transformers(tmp_path):
    out = json.loads(run_program("package_imports", "vllm_minicpm_hotfix.backports", cwd=tmp_path).stdout.strip()
                     .splitlines()[-1])
    assert out["heavy"] == [], out
