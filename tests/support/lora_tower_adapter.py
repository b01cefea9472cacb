"""Write a LoRA adapter of a tiny MiniCPM-V checkpoint's vision tower with peft. Run in a fresh interpreter with peft
on ``PYTHONPATH`` (tests/support/peft_site.py); prints one JSON object on its last line.

``python lora_tower_adapter.py CHECKPOINT OUT``

``OUT``: ``LoraConfig(target_modules=TOWER_TARGETS)`` + ``get_peft_model`` + ``save_pretrained`` on transformers' own
model: rank 8 on every vision-encoder layer's ``self_attn.q_proj/k_proj/v_proj/out_proj`` and ``mlp.fc1/fc2`` (what a
user fine-tuning the vision tower writes), ``lora_B`` seeded nonzero (peft initialises it to zero) so that the adapter
would change the output if it were applied. The JSON: ``modules``, the wrapped module names as peft reports them.
"""

from __future__ import annotations

import json
import sys

RANK = 8
TOWER_TARGETS = r".*vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.(fc1|fc2))"


def main(checkpoint: str, out: str) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32)
    torch.manual_seed(0)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0,
                                                  target_modules=TOWER_TARGETS))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    peft_model.save_pretrained(out)
    modules = sorted({n.split(".lora_")[0] for n, _ in peft_model.named_parameters() if ".lora_" in n})
    return {"modules": modules}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
