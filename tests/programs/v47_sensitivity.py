"""How well can a first-step logprob test of MiniCPM-V 4.7 tell a wrong image from arithmetic noise? transformers only.

    python tests/programs/v47_sensitivity.py OUT.json CKPT [CKPT ...] [--prompts 448x448,640x480,300x900]
        [--seeds 0,1,2] [--image blocks]

For each checkpoint folder (``scripts/make_tiny_checkpoint.py --member 4.7 [--moe] [--init-std S] [--seed N]``) and
each image prompt of tests/programs/v47_stages.py (same prompt, same seeded images), transformers'
``MiniCPMV4_7ForConditionalGeneration`` gives the first step's logprobs in float32 (the tests' reference) and in
bfloat16, and in float32 with sequential positions instead of its canvas M-RoPE (what vLLM 0.32/0.33 serve for a
transformers-written config, tests/programs/v47_stages.py). Distances are v47_stages' ``top_dev`` (max over the union
of both top-5s):

* ``noise``: bf16 against float32, the arithmetic a bf16 engine adds (vLLM's bf16 engine measured at or below it
  once its positions are right: docs/moe.md);
* ``sens``: float32 on image seed a against seed b of the same size (every pair of ``--seeds``): what a wrong image
  moves;
* ``pos``: float32 with sequential positions against float32: what the positions defect moves;
* ``margin``: the reference's top-1 minus top-2 logprob.

Printed per checkpoint: the worst case of each (largest noise, smallest sens and pos, smallest margin) and
``sens/noise``; the JSON holds every value.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import v47_stages as st  # noqa: E402


def measure(ckpt: str, prompts: list[str], seeds: list[int], image_kind: str) -> dict:
    import torch
    from transformers import AutoProcessor, MiniCPMV4_7ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(ckpt)
    models = {d: MiniCPMV4_7ForConditionalGeneration.from_pretrained(ckpt, dtype=d).eval()
              for d in (torch.float32, torch.bfloat16)}

    def lp(inputs, dtype, positions=None):
        kw = dict(inputs)
        if "pixel_values" in kw:
            kw["pixel_values"] = kw["pixel_values"].to(dtype)
        if positions is not None:
            kw["position_ids"] = positions
        with torch.no_grad():
            return st.logprobs(models[dtype](**kw, use_cache=False).logits[0, -1].float())

    out: dict = {"checkpoint": ckpt, "image": image_kind, "prompts": {}}
    text = st.hf_inputs(processor, "text", None, image_kind)
    out["text_noise"] = st.top_dev(lp(text, torch.bfloat16), lp(text, torch.float32))
    for name in prompts:
        ref, row = {}, {"noise": {}, "pos": {}, "margin": {}, "sens": {}}
        for seed in seeds:
            inputs = st.hf_inputs(processor, name, seed, image_kind)
            n = inputs["input_ids"].shape[1]
            ref[seed] = lp(inputs, torch.float32)
            row["noise"][seed] = st.top_dev(lp(inputs, torch.bfloat16), ref[seed])
            seq = torch.arange(n).view(1, 1, -1).expand(3, 1, -1)
            row["pos"][seed] = st.top_dev(lp(inputs, torch.float32, seq), ref[seed])
            row["margin"][seed] = st.margin(ref[seed])
            row["tokens"] = n
        for a, b in itertools.combinations(seeds, 2):
            row["sens"][f"{a}-{b}"] = st.top_dev(ref[a], ref[b])
        out["prompts"][name] = row
    rows = out["prompts"].values()
    out["worst"] = {
        "noise": max([out["text_noise"]] + [v for r in rows for v in r["noise"].values()]),
        "sens": min(v for r in rows for v in r["sens"].values()),
        "pos": min(v for r in rows for v in r["pos"].values()),
        "margin": min(v for r in rows for v in r["margin"].values()),
    }
    out["worst"]["sens/noise"] = out["worst"]["sens"] / out["worst"]["noise"]
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--prompts", default="448x448,640x480,300x900")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--image", choices=st.IMAGE_KINDS, default="blocks")
    a = ap.parse_args(argv)
    prompts, seeds = a.prompts.split(","), [int(s) for s in a.seeds.split(",")]
    results = []
    print(f"{'checkpoint':48} {'noise':>6} {'sens':>6} {'pos':>6} {'margin':>6} {'sens/noise':>10}", flush=True)
    for ck in a.checkpoints:
        r = measure(ck, prompts, seeds, a.image)
        results.append(r)
        w = r["worst"]
        print(f"{ck[-48:]:48} {w['noise']:6.3f} {w['sens']:6.3f} {w['pos']:6.3f} {w['margin']:6.3f} "
              f"{w['sens/noise']:10.2f}", flush=True)
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
