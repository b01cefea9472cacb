"""One rank of the tensor-parallel test (tests/loading/test_tensor_parallel.py); run as a script, one process per rank.

    python tests/support/tp_rank.py RANK WORLD_SIZE PORT CHECKPOINT_DIR OUT_FILE

Initialises vLLM's distributed state on CPU (gloo), builds vLLM's real ``MiniCPMV4_6ViTWindowAttentionSelfAttn``
twice -- once with the default ``mm_encoder_tp_mode="weights"`` (head-sharded ``QKVParallelLinear`` /
``RowParallelLinear``) and once with ``mm_encoder_tp_mode="data"`` (``is_vit_use_data_parallel()``: replicated) --
loads the checkpoint's ``model.vision_tower.vit_merger.self_attn.*`` tensors into each with the hotfix's loader
(``vllm_minicpm_hotfix.fixes.qkv_loader.load_weights``, prefix-stripped names as vLLM hands them to a child module), runs
``process_weights_after_loading`` (what vLLM's loader does before any forward; on CPU it sets up the linear kernels)
and a forward pass on a fixed input, and saves every rank-local parameter and the output with ``torch.save``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PREFIX = "model.vision_tower.vit_merger.self_attn."


def fixed_input(hidden: int) -> torch.Tensor:
    import torch

    # 3 windows of 2x2 tokens, as MiniCPMV4_6ViTWindowAttentionMerger._apply_window_attention hands them over
    return torch.randn(3, 4, hidden, generator=torch.Generator().manual_seed(1234))


def main(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import torch
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models import minicpmv4_6 as m46
    from vllm.model_executor.models.vision import is_vit_use_data_parallel

    from vllm_minicpm_hotfix.fixes.qkv_loader import load_weights
    from vllm_minicpm_hotfix.cli.vllm_cpu import checkpoint_tensors

    # What vLLM's CPU worker sets before initialising (vllm/v1/worker/cpu_worker.py): the CPU communicator names its
    # shared-memory group after it; the same value on every rank of this run, unique per run.
    os.environ["VLLM_DIST_IDENT"] = f"vllm-minicpm-hotfix-tp-{port}"
    init_distributed_environment(
        world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
        backend="gloo",
    )
    tensors = {k[len(PREFIX):]: v for k, v in checkpoint_tensors(ckpt).items() if k.startswith(PREFIX)}
    result: dict = {"rank": rank}
    torch.set_default_dtype(torch.float32)
    for tp_mode in ("weights", "data"):
        model_config = ModelConfig(
            model=ckpt, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, mm_encoder_tp_mode=tp_mode
        )
        vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        with set_current_vllm_config(vllm_config):
            if tp_mode == "weights":
                initialize_model_parallel(world, 1)
            vision_config = model_config.hf_config.vision_config
            attn = m46.MiniCPMV4_6ViTWindowAttentionSelfAttn(vision_config, prefix=f"vit_merger.self_attn.{tp_mode}")
            loaded = load_weights(attn, iter(sorted(tensors.items())))
            # Snapshot before post-processing: on CPU it repacks the linear weights for its kernels and leaves
            # ``weight`` an empty tensor.
            params = {n: p.detach().clone() for n, p in attn.named_parameters()}
            with torch.no_grad():
                try:
                    attn(fixed_input(vision_config.hidden_size))
                    unprocessed = "ok"
                except Exception as exc:  # noqa: BLE001 - what a forward before post-processing does on CPU
                    unprocessed = f"{type(exc).__name__}: {str(exc)[:300]}"
            process_weights_after_loading(attn, model_config, torch.device("cpu"))
            with torch.no_grad():
                output = attn(fixed_input(vision_config.hidden_size))
            result[tp_mode] = {
                "data_parallel": is_vit_use_data_parallel(),
                "tp_rank": get_tensor_model_parallel_rank(),
                "tp_size": get_tensor_model_parallel_world_size(),
                "loaded": sorted(loaded),
                "params": params,
                "forward_without_processing": unprocessed,
                "output": output.detach().clone(),
            }
    torch.save(result, out)


if __name__ == "__main__":
    r, w, p, c, o = sys.argv[1:6]
    main(int(r), int(w), int(p), c, o)
