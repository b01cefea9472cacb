"""Which token ids a real vLLM engine stops a chat answer on, for one checkpoint: print one JSON line.

    python tests/programs/stop_engine_run.py SPEC.json

``SPEC.json``: ``{"checkpoint": DIR, "candidates": [token id, ...], "max_tokens": N, "with_stop_token_ids":
[[token id, [stop ids]], ...]}``. One engine (``LLM(...)``, text only: every multimodal limit 0), the hotfix as the
environment activates it (tests/cli/test_stop_tokens.py puts the repository's ``sitecustomize.py`` on
``PYTHONPATH``). For each candidate id, one chat request (``LLM.chat``: vLLM's own chat template and request path)
whose sampling is confined to that one id (``allowed_token_ids=[id]``, greedy, ``max_tokens`` N): vLLM stops after
the first token exactly when the id is one of the request's stop ids (``eos_token_id`` or ``stop_token_ids``, which
vLLM fills from the checkpoint's files), and otherwise runs on to N tokens. ``with_stop_token_ids``: the same for an
id with ``stop_token_ids`` passed in the request (the fix a WARN line gives).

Output line: ``RESULT {"candidates": {id: {"token_ids", "finish_reason", "stop_reason"}}, "with_stop_token_ids":
[{"id", "stop_token_ids", "token_ids", "finish_reason", "stop_reason"}], "vllm": version}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cpu_engine_env import use_cpu_engine_env  # noqa: E402 - this folder is on sys.path

use_cpu_engine_env()

CHAT = [{"role": "user", "content": "Hi"}]


def one(out) -> dict:
    c = out.outputs[0]
    return {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def main(spec_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["checkpoint"],
        dtype="bfloat16",  # the CPU GDN attention kernels require BF16
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.1,  # CPU: the KV cache comes from VLLM_CPU_KVCACHE_SPACE
        mamba_ssm_cache_dtype="float32",
        limit_mm_per_prompt={"image": 0, "video": 0},  # text only: no vision work at start-up
        max_num_seqs=2,
        seed=0,
    )
    n = int(spec["max_tokens"])
    candidates = {}
    for token_id in spec["candidates"]:
        params = SamplingParams(max_tokens=n, temperature=0.0, allowed_token_ids=[token_id])
        (out,) = llm.chat(CHAT, params, use_tqdm=False)
        candidates[str(token_id)] = one(out)
    fixed = []
    for token_id, stop_ids in spec.get("with_stop_token_ids", []):
        params = SamplingParams(max_tokens=n, temperature=0.0, allowed_token_ids=[token_id], stop_token_ids=stop_ids)
        (out,) = llm.chat(CHAT, params, use_tqdm=False)
        fixed.append({"id": token_id, "stop_token_ids": stop_ids, **one(out)})
    print("RESULT " + json.dumps({"candidates": candidates, "with_stop_token_ids": fixed,
                                  "vllm": vllm.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
