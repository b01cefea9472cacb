"""Activation by vLLM's plugin system: the ``vllm.general_plugins`` entry point ``minicpm_hotfix``.

``pip install vllm-minicpm-hotfix`` declares (pyproject.toml)::

    [project.entry-points."vllm.general_plugins"]
    minicpm_hotfix = "vllm_minicpm_hotfix.plugin:register"

vLLM's ``vllm.plugins.load_general_plugins()`` calls :func:`register` once in every process it starts -- API server,
EngineCore, workers, Ray workers -- before it resolves model classes, so the post-import hook is in place when
``vllm.model_executor.models.minicpmv4_6`` is imported. ``VLLM_PLUGINS`` is an allowlist: with one that leaves
``minicpm_hotfix`` out, the ``.pth`` bootstrap (:mod:`vllm_minicpm_hotfix._bootstrap`) still activates the hotfix.

vLLM lets an exception raised by a plugin function propagate (only a failing *import* of the plugin is logged and
swallowed), so :func:`register` never raises: a failure is logged and vLLM runs unpatched.
"""

#: The entry-point group vLLM's ``load_general_plugins()`` reads, and our entry point's name in it (pyproject.toml
#: declares them; tests/activation/test_names.py keeps the two equal).
GROUP = "vllm.general_plugins"
NAME = "minicpm_hotfix"


def register() -> None:
    """vLLM general-plugin entry point: register the post-import hook in this process (idempotent; nothing if
    ``VLLM_MINICPM_HOTFIX=off``). Never raises."""
    try:
        from ._bootstrap import install_now

        install_now("plugin")
    except Exception:  # noqa: BLE001, S110 # pragma: no cover - install_now catches already; vLLM must never see one
        pass
