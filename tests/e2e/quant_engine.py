"""One vLLM engine on a checkpoint: greedy text and image prompts, token ids and logprobs as JSON on the last line.

    python quant_engine.py CHECKPOINT_DIR

Run by tests/e2e/test_quantized_engine.py in an overlay environment with the package pip-installed (the hotfix
activates through its .pth in the engine's own processes). Everything runs under ``if __name__ == "__main__"``:
vLLM's spawned processes import this file again.
"""

import json
import os
import sys
import time

PROMPTS = ("Describe this image in one sentence.", "What color is the object on the left?")
MAX_TOKENS = 12


def main(ckpt: str) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from PIL import Image
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=ckpt, enforce_eager=True, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.1,
              mamba_ssm_cache_dtype="float32", limit_mm_per_prompt={"image": 1, "video": 0}, seed=0)
    started = time.time() - t0
    tok = llm.get_tokenizer()
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    image.paste((200, 30, 30), (4, 8, 28, 56))  # a red block on the left, a blue one on the right
    image.paste((30, 30, 200), (36, 16, 60, 40))

    def chat(text, with_image):
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]
        return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)

    requests = [{"prompt": chat(PROMPTS[0], False)},
                {"prompt": chat(PROMPTS[1], True), "multi_modal_data": {"image": image}}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate(requests, params)
    result = {"started_s": round(started, 1), "outputs": []}
    for out in outs:
        comp = out.outputs[0]
        chosen = [float(lp[t].logprob) for t, lp in zip(comp.token_ids, comp.logprobs)]
        # the margin of each greedy choice over the runner-up: how much arithmetic noise the token can take
        margin = [float(sorted((v.logprob for v in lp.values()), reverse=True)[0]
                        - sorted((v.logprob for v in lp.values()), reverse=True)[1]) for lp in comp.logprobs]
        result["outputs"].append({"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(comp.token_ids),
                                  "logprobs": chosen, "margins": margin, "text": comp.text})
    import vllm_minicpm_hotfix

    result["fixes"] = {k: v["applied"] for k, v in vllm_minicpm_hotfix.status()["fixes"].items()}
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
