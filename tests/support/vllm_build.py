"""Tests import the CPU model builder from here; it lives in the package (the demo and ``verify`` use it too)."""

from vllm_minicpm_hotfix.cli.vllm_cpu import (  # noqa: F401
    build_vllm_model,
    checkpoint_files,
    checkpoint_tensors,
    ensure_distributed,
    iter_checkpoint,
    load_checkpoint,
    make_vllm_config,
    prepare_for_forward,
)
