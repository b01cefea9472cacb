"""The throwaway environments of the activation and serve tests: benchmarks/venvs.py, shared with the benchmarks
(one copy; tests import from benchmarks/, never the other way round)."""

from benchmarks.venvs import (  # noqa: F401 - re-exported for the tests
    PACKAGE,
    REPO,
    WRAPT_ENTRIES,
    build_wheel,
    clean_env,
    make_bundle,
    overlay_env,
    pip_install,
    run_uv,
    site_packages,
    source_copy,
    uv,
)
