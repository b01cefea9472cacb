"""Where a test runs (``pytest.mark.placed``, tests/conftest.py): the environment's spec and the shared placements."""

from __future__ import annotations

import os

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
