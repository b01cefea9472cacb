"""Tests import the CPU model builder from here. It lives in the package (``vllm_minicpm_hotfix.cli.vllm_cpu``:
``verify``, the demo and benchmarks/ use it too); what only tests use is here."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from vllm_minicpm_hotfix.checkpoint import iter_tensors
from vllm_minicpm_hotfix.cli.vllm_cpu import (  # noqa: F401
    build_vllm_model,
    checkpoint_tensors,
    ensure_distributed,
    load_checkpoint,
    make_vllm_config,
)


def iter_checkpoint(checkpoint_dir: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, CPU tensor)`` over every safetensors file, a fresh tensor on each call (vLLM may tag them)."""
    return iter_tensors(checkpoint_dir)


def prepare_for_forward(model, part: str | None = None) -> None:
    """What vLLM's DefaultModelLoader does after ``load_weights``: ``process_weights_after_loading`` (on CPU this
    sets up the linear layers' kernels), so the model -- or only its submodule ``part``, e.g. ``"vit_merger"`` -- can
    run a forward pass. Processing only a part avoids CPU kernels the part does not need (0.30's causal-conv1d weight
    packing has no float32 kernel)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    target = model.get_submodule(part) if part else model
    with set_current_vllm_config(model.vllm_config):
        process_weights_after_loading(target, model.vllm_config.model_config, torch.device("cpu"))
