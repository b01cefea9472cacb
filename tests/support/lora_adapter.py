"""Write a LoRA adapter for a tiny MiniCPM-V checkpoint with peft, and the independent greedy reference: transformers'
own model with the adapter applied by peft. Run in a fresh interpreter with peft on ``PYTHONPATH``
(tests/support/peft_site.py); prints one JSON object on its last line.

``python lora_adapter.py CHECKPOINT OUT PROMPT MAX_TOKENS``

* ``OUT/lm``: an adapter of the language model (``LoraConfig`` + ``get_peft_model`` + ``save_pretrained``): rank
  :data:`RANK` on the full-attention ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and every MLP's ``gate_proj``/
  ``up_proj``/``down_proj`` (what vLLM's LoRA layers wrap in the Qwen3.5 text model: its packed ``qkv_proj`` and
  ``gate_up_proj``, and ``o_proj``/``down_proj``); its ``lora_B`` matrices (peft initialises them to zero) are seeded
  normal * :data:`B_SCALE`, so the adapter changes the output (``lora_A`` keeps peft's initialisation, under
  ``torch.manual_seed`` of the same seed). The seed is the first from :data:`SEED` whose greedy choices with the
  adapter all lead the runner-up by at least :data:`MIN_MARGIN` (float32 logits): the served model runs in
  bfloat16, and a near-tie would let rounding, not the adapter, pick the token.

The JSON: ``prompt_ids`` (transformers' processor, the checkpoint's chat template on one user text message with
the generation prompt), ``base`` and ``lora`` (greedy ``generate`` token ids of ``MAX_TOKENS`` new tokens, EOS
ignored, without and with the LM adapter), ``base_margin`` / ``lora_margin`` (per step, the greedy logit minus the
runner-up's: float32 logits, so how much arithmetic noise each choice can take).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

RANK = 8
ALPHA = 16
B_SCALE = 0.5
SEED = 0
#: Smallest lead of every greedy logit over the runner-up that the adapter's seed must give (logits of the tiny
#: model are O(1); bfloat16 weights move them by O(0.01)).
MIN_MARGIN = 0.15
MAX_SEEDS = 8
LM_TARGETS = r".*language_model\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"


def write_adapter(model, targets: str, out: str, seed: int):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # peft's own initialisation of lora_A (Kaiming uniform) draws from the global generator
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                  target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * B_SCALE)
    peft_model.save_pretrained(out)
    return peft_model


def greedy(model, ids, max_tokens: int, eos: int) -> tuple[list[int], list[float]]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, suppress_tokens=None, pad_token_id=eos)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    margins = []
    for step in out.logits:
        top = torch.topk(step[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def main(checkpoint: str, out: str, prompt: str, max_tokens: int) -> dict:
    import torch
    import transformers
    from peft import PeftModel

    processor = transformers.AutoProcessor.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = processor(text=[text], return_tensors="pt")["input_ids"]

    def load():
        return transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()

    base_model = load()
    eos = base_model.config.text_config.eos_token_id
    base, base_margin = greedy(base_model, ids, max_tokens, eos)
    for seed in range(SEED, SEED + MAX_SEEDS):
        candidate = write_adapter(load(), LM_TARGETS, f"{out}/lm-{seed}", seed)
        if min(greedy(candidate, ids, max_tokens, eos)[1]) >= MIN_MARGIN:
            break
    else:
        raise SystemExit(f"no seed in {SEED}..{SEED + MAX_SEEDS - 1} gives greedy margins >= {MIN_MARGIN}")
    os.rename(f"{out}/lm-{seed}", f"{out}/lm")
    for stale in os.listdir(out):
        if stale.startswith("lm-"):
            shutil.rmtree(f"{out}/{stale}")
    # The adapter as saved, applied by peft's own loader (not the in-memory model that wrote it).
    lora_model = PeftModel.from_pretrained(load(), f"{out}/lm").eval()
    lora, lora_margin = greedy(lora_model, ids, max_tokens, eos)
    return {"prompt_ids": ids[0].tolist(), "seed": seed, "base": base, "lora": lora, "base_margin": base_margin,
            "lora_margin": lora_margin, "eos": eos}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))))
