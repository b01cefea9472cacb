"""The environment of a one-process CPU engine, for the programs here that start ``LLM(...)`` in their own
interpreter (``prompt_engine_run.py``, ``stop_engine_run.py``): set before vLLM is imported. Importable because a
program's own folder is first on ``sys.path``."""

import os

#: No EngineCore subprocess, vLLM's CPU platform, 1 GiB of KV cache, no thread pinning, no network.
CPU_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def use_cpu_engine_env() -> None:
    """Put :data:`CPU_ENGINE_ENV` into ``os.environ`` (over what the parent passed)."""
    os.environ.update(CPU_ENGINE_ENV)
