"""Start vLLM engines (``LLM(...)``, EngineCore in its own process) for MiniCPM-V 4.7 checkpoints one after the other
and send each its requests; print what vLLM answered as one JSON line.

    python tests/programs/backport_engine.py SPEC.json

``SPEC.json``: ``{"engines": [{"name", "checkpoint", "limits": {"image": N, "video": N}, "requests": [{"name",
"modality": "image" | "video" | "text", "size": [w, h], "frames": N, "seed": N, "kwargs": {...}}]}]}``. Nothing here
activates the hotfix: the environment's own route does (its ``.pth``, or vLLM's ``vllm.general_plugins`` entry point),
in this process and in every process vLLM starts. Everything runs under ``if __name__ == "__main__"``: EngineCore is
spawned and imports this file as ``__mp_main__``.

Output, last line: ``{"pid", "status": this process's status(), "engines": {name: {"seconds": start-up,
"startup_error": ..., "results": {request: {"prompt_token_ids", "token_ids", "logprobs": {token id: log-probability}
(the first step's top 5)} | {"error"}}}}}``.
"""

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared items (support.backport47)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    from support.backport47 import PROMPT, noise_image
    from support.prompt import video as video_frames
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(sys.argv[1]).read_text())
    out = {"pid": os.getpid(), "engines": {}}
    for engine in spec["engines"]:
        row = out["engines"][engine["name"]] = {"results": {}}
        t0 = time.monotonic()
        try:
            llm = LLM(model=engine["checkpoint"], dtype="bfloat16", enforce_eager=True, max_model_len=2048,
                      gpu_memory_utilization=0.1, mamba_ssm_cache_dtype="float32", max_num_seqs=2, seed=0,
                      limit_mm_per_prompt=engine["limits"])
        except Exception as exc:  # stock vLLM: the architecture is not supported
            row["startup_error"] = f"{type(exc).__name__}: {exc}"[:3000]
            continue
        row["seconds"] = round(time.monotonic() - t0, 1)
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5)
        for req in engine["requests"]:
            modality = req["modality"]
            prompt = {"prompt": PROMPT.format(mm={"image": "<|image_pad|>", "video": "<|video_pad|>"}.get(modality, ""))}
            if modality == "image":
                prompt["multi_modal_data"] = {"image": noise_image(*req["size"], req["seed"])}
            elif modality == "video":
                prompt["multi_modal_data"] = {"video": video_frames(*req["size"], req["frames"], req["seed"])}
            if req.get("kwargs"):
                prompt["mm_processor_kwargs"] = req["kwargs"]
            try:
                (res,) = llm.generate([prompt], params, use_tqdm=False)
                first = res.outputs[0].logprobs[0]
                row["results"][req["name"]] = {
                    "prompt_token_ids": list(res.prompt_token_ids), "token_ids": list(res.outputs[0].token_ids),
                    "logprobs": {str(t): lp.logprob for t, lp in first.items() if lp.rank is not None and lp.rank <= 5},
                }
            except Exception as exc:  # recorded; the test names it
                row["results"][req["name"]] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
        del llm  # shuts EngineCore down before the next engine starts (one engine at a time)
        import gc

        gc.collect()
    hotfix = sys.modules.get("vllm_minicpm_hotfix")
    out["status"] = hotfix.status() if hotfix is not None else None
    print(json.dumps(out, default=str), flush=True)
