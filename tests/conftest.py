"""Shared fixtures. Every test here runs inside one CPU environment built by ``scripts/cpu-env RELEASE`` (real vLLM,
real torch, real transformers); ``scripts/test`` runs the suite once per release and names each one.

What each release is expected to do is written down once, in :data:`EXPECTED`: tests assert it against the vLLM that
is actually installed, and fail (never skip) on a release the table does not know.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

TINY = REPO / "vllm_minicpm_hotfix" / "data" / "tiny-minicpm-v46"
MAKE_CHECKPOINT = REPO / "scripts" / "make_tiny_checkpoint.py"

ATTN = "MiniCPMV4_6ViTWindowAttentionSelfAttn"
#: release -> (verdict of the decision, the error stock vLLM raises loading a 4.6 checkpoint or None if it loads).
EXPECTED: dict[str, tuple[str, str | None]] = {
    "0.24.0": ("correct", None),
    "0.26.0": ("broken", f"There is no module or parameter named 'qkqkv_proj' in {ATTN}"),
    "0.28.0": ("broken", f"There is no module or parameter named 'k_proj' in {ATTN}"),
    "0.30.0": ("correct", None),
    "0.32.0": ("correct", None),
    "0.33.0": ("correct", None),
}
#: What stock vLLM raised in the original report (case-01, a main build that stacked nothing).
SEED_ERA_ERROR = "There is no module or parameter named 'vit_merger.self_attn.k_proj' in MiniCPMV4_6ForConditionalGeneration"


def vllm_release() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


@pytest.fixture(scope="session")
def release() -> str:
    return vllm_release()


@pytest.fixture(scope="session")
def expected(release: str) -> tuple[str, str | None]:
    if release not in EXPECTED:
        pytest.fail(f"vLLM {release} is not in tests/conftest.py EXPECTED: measure it and add its row")
    return EXPECTED[release]


@pytest.fixture(scope="session")
def m46():
    """The real ``vllm.model_executor.models.minicpmv4_6`` module."""
    return importlib.import_module("vllm.model_executor.models.minicpmv4_6")


@pytest.fixture(scope="session")
def tiny() -> Path:
    assert (TINY / "model.safetensors").is_file(), f"bundled tiny checkpoint missing at {TINY}"
    return TINY


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory) -> Path:
    """The tiny model with untied embeddings (an ``lm_head.weight``), written by transformers for this session."""
    out = tmp_path_factory.mktemp("tiny-untied")
    subprocess.run([sys.executable, str(MAKE_CHECKPOINT), str(out), "--untied"], check=True, capture_output=True)
    return out


@pytest.fixture(params=["tied", "untied"])
def checkpoint(request, tiny: Path) -> Path:
    return tiny if request.param == "tied" else request.getfixturevalue("tiny_untied")


@contextlib.contextmanager
def hotfix(m46, mode: str):
    """Apply the q/k/v fix to the imported module as the post-import hook would under ``VLLM_MINICPM_HOTFIX=mode``;
    revert on exit so the next test sees stock vLLM again."""
    from vllm_minicpm_hotfix import patching, record

    old = os.environ.get("VLLM_MINICPM_HOTFIX")
    os.environ["VLLM_MINICPM_HOTFIX"] = mode
    record._STATUS = None
    try:
        yield patching.apply_qkv_fix(m46)
    finally:
        patching.revert(m46)
        record._STATUS = None
        if old is None:
            os.environ.pop("VLLM_MINICPM_HOTFIX", None)
        else:
            os.environ["VLLM_MINICPM_HOTFIX"] = old


@pytest.fixture(autouse=True)
def _stock_between_tests(m46):
    """Every test starts and ends with vLLM's classes exactly as vLLM defined them."""
    from vllm_minicpm_hotfix import patching, processor_fix

    def patched() -> bool:
        info = getattr(m46, processor_fix.INFO_CLASS, None)
        return patching.is_patched(getattr(m46, ATTN)) or (isinstance(info, type) and processor_fix.is_patched(info))

    assert not patched(), "a previous test left vLLM patched"
    yield
    assert not patched(), "this test left vLLM patched"


#: Test modules that start many fresh interpreters or servers (activation routes, the CLI, hostile environments,
#: bad checkpoints through vLLM's loader, tensor-parallel ranks).
#: scripts/test runs them on the releases in VLLM_MINICPM_HOTFIX_FULL_RELEASES (one broken, one correct) and
#: deselects them (``-m "not heavy"``) elsewhere, so CI stays inside its time; every other test runs on every release.
HEAVY_MODULES = {"test_activation", "test_cli", "test_reliability", "test_tensor_parallel"}


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: many fresh interpreters; run on a subset of releases by scripts/test")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)


def pytest_report_header(config):
    try:
        import torch
        import transformers
        import vllm

        return [f"vLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"]
    except Exception as exc:  # pragma: no cover
        return [f"vLLM not importable: {exc}"]


# --------------------------------------------------------------------------------------------------------------------
# Activation environments shared by test_activation.py and test_reliability.py (built once per session: a wheel of
# this repository, overlays of this environment with it pip-installed, a bundle). Helpers live in tests/e2e.
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("activation")


@pytest.fixture(scope="session")
def wheel(work) -> Path:
    from e2e import build_wheel

    return build_wheel(work / "wheel")


@pytest.fixture(scope="session")
def pip_env(work, wheel) -> Path:
    """An overlay of this environment with the wheel pip-installed (wrapt comes from the environment)."""
    from e2e import overlay_env, pip_install

    python = overlay_env(work / "pip-env", wrapt=True)
    pip_install(python, str(wheel))
    return python


@pytest.fixture(scope="session")
def bare_env(work) -> Path:
    """An overlay of this environment without wrapt and without the package: a vLLM image as shipped."""
    from e2e import overlay_env

    return overlay_env(work / "bare-env", wrapt=False)


@pytest.fixture(scope="session")
def bundle_dir(work) -> Path:
    from e2e import make_bundle

    return make_bundle(work / "bundle")


def pytest_sessionfinish(session, exitstatus):
    """For scripts/test's summary: which vLLM / torch / transformers ran, and the decision's verdict there."""
    report = os.environ.get("VLLM_MINICPM_HOTFIX_REPORT")
    if not report:
        return
    import json

    import torch
    import transformers
    import vllm

    from vllm_minicpm_hotfix import decision

    verdict = decision.probe_qkv_loading(importlib.import_module("vllm.model_executor.models.minicpmv4_6"))
    Path(report).write_text(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "verdict": verdict.state.value,
                "reason": verdict.reason,
            }
        )
    )
