"""Run MiniCPM-V 4.6 requests through a real vLLM engine (``LLM.generate``) with the hotfix active; print the prompt
token ids vLLM built for each request as one JSON line.

    python tests/programs/prompt_engine_run.py SPEC.json

``SPEC.json``: ``{"checkpoint": DIR, "requests": [{"name", "modality": "image"|"video", "sizes": [[w, h], ...],
"frames": N, "kwargs": {...}}, ...], "revert": [fix NAME, ...], "limits": {...}}``; ``revert`` (optional, for showing
stock vLLM on an engine) undoes those fixes right after the hook applied them (for every family member: the
member modules are imported first); ``limits`` (optional) is the engine's
``limit_mm_per_prompt`` (default ``{"image": 2, "video": 1}``). Run by tests/prompt/test_prompt_engine.py in a fresh interpreter of the test
environment; the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the post-import hook
installed here covers the API-side processor and the model alike. Each request is generated on its own (greedy, one
token); a request that fails is recorded with its error and the next one still runs.

Output line: ``RESULT {"status": status()["fixes"], "results": {name: {"prompt_token_ids": [...]} | {"error": "..."}}}``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from cpu_engine_env import use_cpu_engine_env  # noqa: E402 - this folder is on sys.path

use_cpu_engine_env()
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"


def make_llm(spec: dict, LLM: type):
    return LLM(
        model=spec["checkpoint"],
        dtype="bfloat16",  # the CPU GDN attention kernels require BF16
        enforce_eager=True,
        max_model_len=2048,  # the real geometry: up to ~700 tokens per image or video
        gpu_memory_utilization=0.1,  # CPU: the KV cache comes from VLLM_CPU_KVCACHE_SPACE
        mamba_ssm_cache_dtype="float32",
        limit_mm_per_prompt=spec.get("limits") or {"image": 2, "video": 1},
        max_num_seqs=2,
        seed=0,
    )


def main(spec_path: str) -> None:
    import vllm_minicpm_hotfix

    vllm_minicpm_hotfix.install()

    from support.prompt import image, video  # the same items as the processor sweep
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("revert"):
        import importlib

        from vllm_minicpm_hotfix.fixes import _base

        m46 = importlib.import_module("vllm.model_executor.models.minicpmv4_6")
        _base.member_modules(m46)  # minicpmv4_7 too, where vLLM has it: the hook has then run for every member
        for name in spec["revert"]:
            _base.revert_fix(name)
    try:
        llm = make_llm(spec, LLM)
    except Exception as exc:  # stock 0.23.0: start-up profiling dies
        print("RESULT " + json.dumps({"status": vllm_minicpm_hotfix.status()["fixes"],
                                      "startup_error": f"{type(exc).__name__}: {exc}"[:2000]}), flush=True)
        return
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    results = {}
    for req in spec["requests"]:
        if req["modality"] == "image":
            items = [image(w, h) for w, h in req["sizes"]]
            pad = "<|image_pad|>"
        else:
            items = [video(w, h, req["frames"]) for w, h in req["sizes"]]
            pad = "<|video_pad|>"
        prompt = {
            "prompt": PROMPT.format(mm=pad * len(items)),
            "multi_modal_data": {req["modality"]: items if len(items) > 1 else items[0]},
        }
        if req["kwargs"]:
            prompt["mm_processor_kwargs"] = req["kwargs"]
        try:
            (out,) = llm.generate([prompt], greedy, use_tqdm=False)
            results[req["name"]] = {"prompt_token_ids": list(out.prompt_token_ids)}
        except Exception as exc:  # recorded; the test names it
            results[req["name"]] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"REQUEST {req['name']!r}: {'error' if 'error' in results[req['name']] else 'answered'}",
              file=sys.stderr, flush=True)
    status = vllm_minicpm_hotfix.status()["fixes"]
    print("RESULT " + json.dumps({"status": status, "results": results}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
