"""One offline vLLM engine run for tests/e2e/test_tensor_parallel_engine.py; run as a script, not imported by pytest.

    python tests/e2e/tp_engine.py CHECKPOINT_DIR TENSOR_PARALLEL_SIZE

Starts ``LLM(model=CHECKPOINT_DIR, tensor_parallel_size=N, distributed_executor_backend="mp", ...)`` -- vLLM's own
engine path: EngineCore, and one worker process per rank that builds and loads the model -- with whatever activates
the hotfix in the interpreter that runs this (a pip-installed wheel, or a bundle on ``PYTHONPATH``); this file imports
nothing of the hotfix itself. Then it asks every rank, through vLLM's ``collective_rpc`` and the worker extension
:class:`RankReport` (``worker_extension_cls``: a mix-in vLLM adds to its worker class; it changes nothing about loading),
for its pid, tensor-parallel rank, the hotfix's status in that process and its vit_merger ``qkv_proj.bias`` (the weight
itself is repacked for the CPU kernels after loading and reads back empty), and generates 8 greedy tokens
(``temperature=0``, ``ignore_eos``) for a text chat and an image chat (a 64 x 64 PNG as a data URL). Prints one line
``RESULT {json}``.

Engine settings are those of the ``vllm serve`` tests (tests/e2e/test_serve.py ``SERVE_ARGS``): bfloat16 (the CPU GDN
kernels need it), float32 SSM cache state, eager mode, a small context.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time


class RankReport:
    """Worker extension (``worker_extension_cls="tp_engine.RankReport"``): what one rank holds after loading."""

    def rank_report(self) -> dict:
        from vllm.distributed import parallel_state

        try:
            import vllm_minicpm_hotfix

            status = vllm_minicpm_hotfix.status()
        except ImportError:
            status = None
        attn = self.model_runner.model.vit_merger.self_attn
        return {
            "pid": os.getpid(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
            "status": status,
            "qkv_bias": attn.qkv_proj.bias.detach().float().tolist(),
            "qkv_bias_dtype": str(attn.qkv_proj.bias.dtype),
        }


def image_url(variant: int = 0) -> str:
    """A 64 x 64 PNG as a data URL: a colour gradient (``variant`` 0) or its mirror image (1)."""
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata([(4 * (i % 64), 4 * (i // 64), 128) for i in range(64 * 64)])
    if variant:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main(checkpoint: str, tp: int) -> None:
    from vllm import LLM, SamplingParams

    t0 = time.monotonic()
    llm = LLM(
        model=checkpoint, tensor_parallel_size=tp, distributed_executor_backend="mp", dtype="bfloat16",
        max_model_len=256, enforce_eager=True, gpu_memory_utilization=0.1, max_num_seqs=2,
        limit_mm_per_prompt={"image": 1, "video": 0}, mamba_ssm_cache_dtype="float32",
        worker_extension_cls="tp_engine.RankReport",
    )
    started = time.monotonic() - t0
    ranks = llm.collective_rpc("rank_report")
    chats = [
        [{"role": "user", "content": "Hello, who are you?"}],
        *([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(v)}},
                                        {"type": "text", "text": "What is in the image?"}]}] for v in (0, 1)),
    ]
    outs = llm.chat(chats, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
    print("RESULT " + json.dumps({
        "tp": tp,
        "pid": os.getpid(),
        "engine_start_s": round(started, 1),
        "ranks": sorted(ranks, key=lambda r: r["tp_rank"]),
        "prompt_token_ids": [list(o.prompt_token_ids) for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        # per generated token: the 5 most likely token ids and their log-probabilities
        "logprobs": [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs],
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
