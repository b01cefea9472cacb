"""Where a test runs (``pytest.mark.placed``, tests/conftest.py): the environment's spec and the shared placements."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: The environment variable scripts/test sets to the environment's spec ("0.28.0", "0.28.0:tf5.20.0",
#: "0.28.0:unpinned"); run by hand, the spec is the installed vLLM release.
ENV_SPEC_VAR = "VLLM_MINICPM_HOTFIX_ENV"
#: Set to 1 to run every test in this environment, wherever it is placed.
EVERYWHERE_VAR = "VLLM_MINICPM_HOTFIX_EVERYWHERE"
#: Where the modules that start many fresh interpreters (activation routes, the CLI, hostile environments, tensor
#: parallel ranks) run: one release whose own q/k/v loading is broken and one where it is correct.
FULL_ENVS = ("0.28.0", "0.32.0")
#: Where tests of the package's own logic that reach no vLLM and no transformers code run (one environment is enough:
#: the same code and the same inputs everywhere).
LOGIC_ENV = ("0.30.0",)
#: Environments that run only the tests placed there by name, none of the unplaced ones: a release with a library
#: forced past the release's own pin for one family member (vLLM 0.33 with transformers 5.24; transformers has
#: ``minicpm_ocr``: tests/prompt/test_ocr_vllms_own.py), where the rest of the suite shows nothing 0.33.0 does not.
NARROW_ENVS = ("0.33.0:tf5.24.0",)


def vllm_release() -> str:
    import vllm

    return vllm.__version__.split("+")[0]


def environment_spec() -> str:
    return os.environ.get(ENV_SPEC_VAR) or vllm_release()


def _package_file(package: str, relative: str) -> bool:
    """Whether the installed ``package`` ships ``relative`` (a path inside it), found without importing it."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None and (Path(spec.origin).parent / relative).exists()


def own_member_envs(vllm_module: str, transformers_model: str, *specs: str) -> tuple[str, ...]:
    """Where the tests of a family member on vLLM's *own* classes run: ``specs`` (the environments measured for it),
    plus this environment wherever the installed vLLM ships the member's model module
    (``vllm/model_executor/models/<vllm_module>.py``) and the installed transformers the member's model
    (``transformers/models/<transformers_model>/``), unless it is narrow. So a release no list names (the newest on
    the index, the canary's) runs the member's comparisons with transformers unchanged."""
    spec = environment_spec()
    if (spec not in specs and spec not in NARROW_ENVS
            and _package_file("vllm", f"model_executor/models/{vllm_module}.py")
            and _package_file("transformers", f"models/{transformers_model}/__init__.py")):
        return (*specs, spec)
    return specs


def newest_envs(*specs: str) -> tuple[str, ...]:
    """``specs``, plus this environment wherever its vLLM is at least the newest release tests/data/stock.json records
    (today's newest, the canary's newest on the index tomorrow), unless it is narrow: where a release first meets the
    suite, the checks a user of it runs first (doctor, verify) run too."""
    import json

    spec = environment_spec()
    if spec in specs or spec in NARROW_ENVS:
        return specs
    data = Path(__file__).resolve().parents[1] / "data" / "stock.json"
    recorded = [k.split(":tf")[0] for k in json.loads(data.read_text())["environments"]]

    def key(version: str) -> tuple[int, ...]:
        return tuple(int(p) for p in version.split(".")[:3] if p.isdigit())

    return (*specs, spec) if key(vllm_release()) >= max(map(key, recorded)) else specs
