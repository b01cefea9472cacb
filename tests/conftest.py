"""Shared fixtures. Every test here runs inside one CPU environment built by ``scripts/cpu-env RELEASE`` (real vLLM,
real torch, real transformers); ``scripts/test`` runs the suite once per release and names each one.

What stock vLLM does in each environment is recorded once, in tests/data/stock.json (``scripts/record-stock``), and read
through ``tests/support/expected.py``: the tests that pin it are marked ``stock_pin`` and fail (never skip), naming
what they observed, on an environment without a row; every other test runs there unchanged.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# hotfix_mode: a fixture for every module (support.environment); the rest is imported by the test modules themselves.
from support.environment import hotfix_mode  # noqa: E402,F401
from support.observed import RUN_FACTS  # noqa: E402
from support import tiny_checkpoints  # noqa: E402
from support.paths import TINY  # noqa: E402
from support.placement import EVERYWHERE_VAR, NARROW_ENVS, environment_spec, vllm_release  # noqa: E402


@pytest.fixture(scope="session")
def release() -> str:
    return vllm_release()


@pytest.fixture(scope="session")
def environment() -> tuple[str, str]:
    """``(vLLM release, transformers version)`` installed here, recorded in tests/data/stock.json or not (a test that
    pins a stock fact is marked ``stock_pin`` and fails where there is no row: tests/support/expected.py)."""
    from support import expected as table

    return table.installed_environment()


@pytest.fixture(scope="session")
def stock_facts(m46, environment) -> None:
    """Where tests/data/stock.json has no row for this environment (or the session records one): the stock facts
    observed once, first thing in the session, while vLLM's classes are as vLLM defined them."""
    from support import expected as table

    if table.needs_observing(environment):
        table.observe(m46, TINY)


@pytest.fixture(scope="session")
def expected(environment, stock_facts) -> tuple[str, str | None]:
    """``(the q/k/v probe's stock verdict, the error stock vLLM raises loading a 4.6 checkpoint or None)`` here:
    recorded in tests/data/stock.json, else as observed on stock vLLM in this session. (The tests that pin them,
    ``stock_pin``, read tests/support/expected.py themselves.)"""
    from support import expected as table

    try:
        return table.verdict("qkv_loader", environment), table.stock_load_error(environment)
    except table.UnknownEnvironment as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def m46():
    """The real ``vllm.model_executor.models.minicpmv4_6`` module, with every other family member's model module
    this vLLM has imported too (``minicpmv4_7`` on 0.32+), as in a process serving 4.7: the fixes applied in this
    process (:func:`hotfix`) probe and act for every member present."""
    from vllm_minicpm_hotfix.fixes import _base

    module = importlib.import_module("vllm.model_executor.models.minicpmv4_6")
    _base.member_modules(module)  # imports the other members' modules
    return module


@pytest.fixture(scope="session")
def tiny() -> Path:
    assert (TINY / "model.safetensors").is_file(), f"bundled tiny checkpoint missing at {TINY}"
    return TINY


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory) -> Path:
    """The tiny model with untied embeddings (an ``lm_head.weight``), written by transformers for this session."""
    out = tmp_path_factory.mktemp("tiny-untied")
    return tiny_checkpoints.write(out, "--untied")


@pytest.fixture(params=["tied", "untied"])
def checkpoint(request, tiny: Path) -> Path:
    return tiny if request.param == "tied" else request.getfixturevalue("tiny_untied")


@pytest.fixture(autouse=True)
def _stock_pin(request):
    """A ``stock_pin`` test reads tests/data/stock.json strictly: no recorded fact is a failure naming what it saw."""
    from support import expected as table

    table.STRICT = request.node.get_closest_marker("stock_pin") is not None
    yield
    table.STRICT = False


@pytest.fixture(autouse=True)
def _stock_between_tests(m46, stock_facts):
    """Every test starts and ends with vLLM's classes exactly as vLLM defined them."""
    from vllm_minicpm_hotfix.fixes import REGISTRY, _base

    def patched() -> list[str]:
        return [fix.NAME for fix in REGISTRY if _base.is_patched(fix, m46)]

    from vllm_minicpm_hotfix.fixes import request_kwargs

    from vllm_minicpm_hotfix.backports import BACKPORTS

    def registered() -> list[str]:
        return [b.NAME for b in BACKPORTS if b.registered()]

    assert not patched(), f"a previous test left vLLM patched: {patched()}"
    assert not registered(), f"a previous test left a backport registered: {registered()}"
    # request_kwargs keeps the encoder cache size of the last MultiModalBudget built in the process (one engine per
    # process in vLLM); a test that builds one with a small budget must not bound a later test's requests.
    request_kwargs.ENCODER_CACHE_SIZE.clear()
    yield
    request_kwargs.ENCODER_CACHE_SIZE.clear()
    assert not patched(), f"this test left vLLM patched: {patched()}"
    assert not registered(), f"this test left a backport registered: {registered()}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "placed(*specs): run only in these environments (scripts/test specs, e.g. '0.28.0'); elsewhere the tests are "
        "deselected -- not skipped -- and the module's docstring says why it runs where it does",
    )
    config.addinivalue_line("markers", "ray: starts a Ray cluster (tests/e2e/test_ray.py); `-m 'not ray'` leaves it out")
    config.addinivalue_line(
        "markers",
        "stock_pin: pins a per-release fact of stock vLLM recorded in tests/data/stock.json (scripts/record-stock); "
        "fails, naming what it observed, on an environment without a row; `-m 'not stock_pin'` leaves them out "
        "(scripts/canary)",
    )


def pytest_collection_modifyitems(config, items):
    """Deselect the tests ``placed`` elsewhere (``VLLM_MINICPM_HOTFIX_EVERYWHERE=1`` keeps them all); in a narrow
    environment (:data:`support.placement.NARROW_ENVS`) every test that does not name it, placed or not."""
    if os.environ.get(EVERYWHERE_VAR) == "1":
        return
    spec = environment_spec()
    keep, drop = [], []
    for item in items:
        placed = item.get_closest_marker("placed")
        here = spec in placed.args if placed is not None else spec not in NARROW_ENVS
        (keep if here else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_header(config):
    try:
        import torch
        import transformers
        import vllm

        return [f"vLLM {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}"]
    except Exception as exc:  # pragma: no cover
        return [f"vLLM not importable: {exc}"]


# --------------------------------------------------------------------------------------------------------------------
# Activation environments shared by the activation and reliability tests (built once per session: a wheel of this
# repository, overlays of this environment with it pip-installed, a bundle). Helpers live in tests/support/venvs.py.
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("activation")


@pytest.fixture(scope="session")
def wheel(work) -> Path:
    from support.venvs import build_wheel

    return build_wheel(work / "wheel")


@pytest.fixture(scope="session")
def pip_env(work, wheel) -> Path:
    """An overlay of this environment with the wheel pip-installed (wrapt comes from the environment)."""
    from support.venvs import overlay_env, pip_install

    python = overlay_env(work / "pip-env", wrapt=True)
    pip_install(python, str(wheel))
    return python


@pytest.fixture(scope="session")
def bare_env(work) -> Path:
    """An overlay of this environment without wrapt and without the package: a vLLM image as shipped."""
    from support.venvs import overlay_env

    return overlay_env(work / "bare-env", wrapt=False)


@pytest.fixture(scope="session")
def bundle_dir(work) -> Path:
    from support.venvs import make_bundle

    return make_bundle(work / "bundle")


def pytest_sessionfinish(session, exitstatus):
    """For scripts/test's summary: which vLLM / torch / transformers / Python ran, and every fix's verdict there (its
    probe on stock vLLM: every test leaves vLLM unpatched, see ``_stock_between_tests``)."""
    report = os.environ.get("VLLM_MINICPM_HOTFIX_REPORT")
    if not report:
        return
    import json
    import platform

    import torch
    import transformers
    import vllm

    from vllm_minicpm_hotfix.fixes import REGISTRY, _base

    module = importlib.import_module("vllm.model_executor.models.minicpmv4_6")
    members = {m: view for m, view in _base.member_modules(module).items() if view is not module}
    verdicts = {}
    for fix in REGISTRY:
        v = fix.probe(module)
        verdicts[fix.NAME] = {"verdict": v.state.value, "applicable": v.applicable, "reason": v.reason,
                              "label": fix.LABEL}
        # Every other family member here: the fix's probe on that member's own classes ("n/a": not declared).
        verdicts[fix.NAME]["models"] = {
            m: (fix.probe(view).state.value if m in _base.models_of(fix) else "n/a") for m, view in members.items()
        }
    # Every backport's probe here (on stock vLLM: nothing is left registered between tests): which family members
    # this vLLM lacks and the hotfix registers ("missing"), has itself ("correct") or cannot be given ("unrecognised").
    from vllm_minicpm_hotfix.backports import BACKPORTS

    backports = {}
    for backport in BACKPORTS:
        v = backport.probe()
        backports[backport.NAME] = {"member": backport.MEMBER, "verdict": v.state.value, "reason": v.reason}
    Path(report).write_text(
        json.dumps(
            {
                "backports": backports,
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "fixes": verdicts,
                "observed": RUN_FACTS,
            }
        )
    )
