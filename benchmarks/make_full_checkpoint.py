#!/usr/bin/env python
"""Write a full-size synthetic MiniCPM-V 4.6 checkpoint (bf16, seeded random values) with transformers' own classes.

    python benchmarks/make_full_checkpoint.py [OUT_DIR] [--seed N] [--force]

Default OUT_DIR: ``~/.cache/vllm-minicpm-hotfix/bench/minicpm-v46-full-seed<N>`` (``$VLLM_MINICPM_HOTFIX_BENCH``
replaces ``~/.cache/vllm-minicpm-hotfix/bench``). A folder that is complete (its stamp file matches this script's
configuration) is reused; the script then only prints its path. Never inside the repository: ~2.4 GB.

The configuration is the real model's where the real checkpoint fixes it (vision: hidden 1152, 27 layers, 16 heads,
intermediate 4304, patch 14, ``insert_layer_id`` 6; text ``qwen3_5_text``: hidden 1024, 24 layers, vocab 248094, tied
embeddings; 779 tensors). The rest is chosen for a Qwen3.5-0.8B-class text model and stated in :data:`TEXT_CHOSEN`:
8 attention heads / 2 KV heads of head_dim 256, intermediate 3584, linear attention (Gated DeltaNet) with 16 key and
16 value heads of dim 128, conv kernel 4, and the default layer pattern (every 4th layer full attention: 18 linear +
6 full). With the fixed layout (29 non-layer tensors, 16 per vision layer, 14 per linear-attention and 11 per
full-attention text layer) 18 linear layers are exactly what gives the real checkpoint's 779 tensors; the script
checks the count before it writes anything.

Values: the model is constructed directly in bf16 with transformers' weight initialisation switched off, then every
parameter is filled from one seeded ``torch.Generator`` in sorted-name order (weights N(0, 1/fan_in), 1-D tensors
N(0, 0.1^2), norm weights around 1) -- fast (~15 s for 1.2e9 values on one core) and reproducible for a given torch.
Written by ``save_pretrained`` (safetensors, one file: transformers 5's default shard size is 50 GB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

SEED = 0
EXPECTED_KEYS = 779
FORMAT = 2  # bump when the configuration or the filling below changes: a cached folder is then rebuilt

VISION = dict(  # the real checkpoint's
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_channels=3,
    image_size=980,  # 70 x 70 position embeddings, as MiniCPM-V's SigLIP-400M/14
    patch_size=14,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
    window_kernel_size=[2, 2],
)
INSERT_LAYER_ID = 6
TEXT_FIXED = dict(  # the real checkpoint's
    model_type="qwen3_5_text",
    hidden_size=1024,
    num_hidden_layers=24,
    vocab_size=248094,
    tie_word_embeddings=True,
)
TEXT_CHOSEN = dict(  # plausible for a ~0.8B Qwen3.5 text model; not read from the real checkpoint
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,  # the CPU GDN kernels need 64 or 128
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    attention_bias=False,
    # partial_rotary_factor 0.25 of head_dim 256 -> rotary dim 64 -> mrope sections sum to 32.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)
# Qwen3.5's special-token ids (all inside the vocabulary).
PAD_ID, EOS_ID, IMAGE_ID, VIDEO_ID = 248044, 248046, 248056, 248057


def default_root() -> Path:
    return Path(os.environ.get("VLLM_MINICPM_HOTFIX_BENCH", Path.home() / ".cache" / "vllm-minicpm-hotfix" / "bench"))


def default_dir(seed: int = SEED) -> Path:
    return default_root() / f"minicpm-v46-full-seed{seed}"


def stamp_text(seed: int) -> str:
    return json.dumps({"format": FORMAT, "seed": seed, "vision": VISION, "text": {**TEXT_FIXED, **TEXT_CHOSEN}},
                      sort_keys=True)


def is_complete(out: Path, seed: int) -> bool:
    stamp = out / ".bench-checkpoint-complete"
    try:
        return stamp.read_text() == stamp_text(seed) and (out / "config.json").is_file() and any(
            out.glob("*.safetensors")
        )
    except OSError:
        return False


def build_config():
    from transformers import MiniCPMV4_6Config

    text = {**TEXT_FIXED, **TEXT_CHOSEN, "pad_token_id": PAD_ID, "eos_token_id": EOS_ID, "bos_token_id": None}
    cfg = MiniCPMV4_6Config(
        text_config=text,
        vision_config=dict(VISION, insert_layer_id=INSERT_LAYER_ID),
        insert_layer_id=INSERT_LAYER_ID,
        image_size=448,
        drop_vision_last_layer=False,
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        tie_word_embeddings=True,
        downsample_mode="16x",
        merge_kernel_size=[2, 2],
        merger_times=1,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    cfg.architectures = ["MiniCPMV4_6ForConditionalGeneration"]
    return cfg


def saved_keys(model) -> list[str]:
    """The names ``save_pretrained`` writes: the state dict without tied duplicates (``lm_head.weight``)."""
    seen: dict[int, str] = {}
    keys = []
    for name, t in model.state_dict(keep_vars=True).items():
        if t.device.type != "meta" and t.data_ptr() in seen:
            continue
        if t.device.type != "meta":
            seen[t.data_ptr()] = name
        keys.append(name)
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in keys:
        keys.remove("lm_head.weight")
    return keys


def count_keys(cfg) -> int:
    import torch
    from transformers import MiniCPMV4_6ForConditionalGeneration

    with torch.device("meta"):
        model = MiniCPMV4_6ForConditionalGeneration(cfg)
    return len(saved_keys(model))


def fill_(model, seed: int) -> int:
    """Fill every parameter (and floating persistent buffer) from one seeded generator; returns the value count."""
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    done: set[int] = set()
    n = 0
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({k: v for k, v in model.named_buffers() if v.is_floating_point()})
        if getattr(model.config, "tie_word_embeddings", False):
            tensors.pop("lm_head.weight", None)  # the embeddings' tensor, filled under their name
        for name in sorted(tensors):
            t = tensors[name]
            if t.data_ptr() in done:
                continue
            done.add(t.data_ptr())
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                t.uniform_(0.0, math.log(16.0), generator=g)
            elif t.dim() == 1:
                centre = 1.0 if ("norm" in name and leaf == "weight") or leaf == "dt_bias" else 0.0
                t.normal_(centre, 0.1, generator=g)
            elif name.endswith("embed_tokens.weight"):
                t.normal_(0.0, 0.1, generator=g)
            else:
                t.normal_(0.0, 1.0 / math.sqrt(t[0].numel()), generator=g)
            n += t.numel()
    return n


def write(out: Path, seed: int) -> dict:
    import torch
    from transformers import MiniCPMV4_6ForConditionalGeneration
    from transformers.initialization import no_init_weights

    cfg = build_config()
    n_keys = count_keys(cfg)
    if n_keys != EXPECTED_KEYS:
        raise SystemExit(f"configuration gives {n_keys} tensors, the real checkpoint has {EXPECTED_KEYS}")
    t0 = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with no_init_weights():
            model = MiniCPMV4_6ForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(torch.bfloat16).eval()
    model.tie_weights()  # before filling, so the shared tensor is filled once
    t1 = time.perf_counter()
    n_values = fill_(model, seed)
    emb = model.get_input_embeddings().weight
    if model.lm_head.weight.data_ptr() != emb.data_ptr():
        raise SystemExit("lm_head.weight is not tied to the embeddings")
    t2 = time.perf_counter()

    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        del model
        from safetensors import safe_open

        keys: list[str] = []
        dtypes: set[str] = set()
        for f in sorted(tmp.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                names = list(sf.keys())
                keys += names
                dtypes |= {sf.get_slice(k).get_dtype() for k in names}
        if len(keys) != EXPECTED_KEYS or "lm_head.weight" in keys or dtypes != {"BF16"}:
            raise SystemExit(f"written checkpoint has {len(keys)} tensors ({dtypes}); expected {EXPECTED_KEYS} BF16")
        (tmp / ".bench-checkpoint-complete").write_text(stamp_text(seed))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    t3 = time.perf_counter()
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    return {"out_dir": str(out), "keys": len(keys), "values": n_values, "safetensors_bytes": size,
            "build_s": round(t1 - t0, 1), "fill_s": round(t2 - t1, 1), "save_s": round(t3 - t2, 1)}


def ensure(out: Path | None = None, seed: int = SEED, force: bool = False) -> Path:
    out = Path(out) if out is not None else default_dir(seed)
    repo = Path(__file__).resolve().parents[1]
    if out.resolve().is_relative_to(repo):
        raise SystemExit(f"{out} is inside the repository; write the checkpoint elsewhere")
    if force or not is_complete(out, seed):
        out.parent.mkdir(parents=True, exist_ok=True)
        print(json.dumps(write(out, seed)), file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", type=Path)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--force", action="store_true", help="rewrite even if a complete folder is there")
    ap.add_argument("--count-only", action="store_true", help="print the tensor count of the configuration and exit")
    args = ap.parse_args(argv)
    if args.count_only:
        print(count_keys(build_config()))
        return 0
    print(ensure(args.out_dir, args.seed, args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
