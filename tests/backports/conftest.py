"""The backports' tests' shared fixtures: vLLM's model registry module, and a folder that makes the package importable
by vLLM's registry-inspection subprocess."""

from __future__ import annotations

import importlib

import pytest

from support.backport47 import importable_package


@pytest.fixture(scope="module")
def registry_module():
    """``vllm.model_executor.models.registry`` (``ModelRegistry``), where the hook runs the backports."""
    return importlib.import_module("vllm.model_executor.models.registry")


@pytest.fixture(scope="module")
def importable(tmp_path_factory) -> str:
    """``PYTHONPATH`` for vLLM's registry-inspection subprocess (:func:`support.backport47.importable_package`)."""
    return importable_package(tmp_path_factory.mktemp("importable"))
