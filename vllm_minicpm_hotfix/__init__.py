"""vllm-minicpm-hotfix: make MiniCPM-V 4.6 load bit-exact on the vLLM you already have.

Public API:

* :func:`install` -- register the post-import hook on ``vllm.model_executor.models.minicpmv4_6`` (idempotent).
* :func:`status` -- what the hotfix did in this process, as a JSON-serialisable dict.

Importing this package is cheap: it imports neither wrapt, torch nor vLLM.
"""

__version__ = "0.1.0"
__all__ = ["install", "status", "__version__"]


def install() -> bool:
    """Register the post-import hook (see :func:`vllm_minicpm_hotfix.hook.install`)."""
    from .hook import install as _install

    return _install()


def status() -> dict:
    """This process's record: ``pid``, ``mode``, ``hook_installed``, ``module_imported``, ``vllm_version`` and, once
    vLLM has imported the model module, every fix of :data:`vllm_minicpm_hotfix.fixes.REGISTRY` by ``NAME`` with its
    ``verdict``, ``reason``, ``applied``, ``why``, ``error``, ``label`` and ``first_use`` (probed at the first use
    of its code path; ``verdict`` is ``"deferred"`` until then)."""
    from .record import current

    return current().as_dict()
