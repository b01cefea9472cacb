#!/usr/bin/env python
"""Write a tiny, reproducible MiniCPM-V 4.6 checkpoint in Hugging Face format.

    python scripts/make_tiny_checkpoint.py OUT_DIR [--untied] [--seed N] [--member 4.7|ocr [--moe] [--scale-resolution 448]]

The model is built with transformers' own classes (transformers >= 5.7: ``MiniCPMV4_6Config``,
``MiniCPMV4_6ForConditionalGeneration``, ``MiniCPMV4_6Processor``), so its weight names are exactly the real
checkpoint's (``model.vision_tower.vit_merger.self_attn.{q,k,v,out}_proj.*``, ``model.vision_tower.encoder.layers.N.*``,
``model.language_model.*``, ``model.merger.*``).  Every tensor -- biases and norm weights included -- is filled with
seeded random values (HF's default init leaves biases at 0 and norms at 1, which would hide a swapped bias).  Each
tensor gets its own generator seeded from ``(seed, tensor name)``, so the output does not depend on parameter order
and ``model.safetensors`` is byte-identical from run to run.

Besides config + weights the folder holds what vLLM needs to run the vision path end to end: a tiny byte-level BPE
``tokenizer.json`` (256 ids, the special tokens at the config's ids), ``tokenizer_config.json`` naming the MiniCPM-V
special tokens, the processor's config (as written by ``MiniCPMV4_6Processor.save_pretrained``) and a ChatML
``chat_template.jinja`` that emits one ``<|image_pad|>`` per image part (the processor expands it).

Default: tied word embeddings (no ``lm_head.weight``), like the real checkpoint.  ``--untied`` writes
``tie_word_embeddings=False`` and an ``lm_head.weight``.

``--member 4.7`` writes a MiniCPM-V 4.7 checkpoint instead (transformers >= 5.19: ``MiniCPMV4_7Config``,
``MiniCPMV4_7ForConditionalGeneration``, ``MiniCPMV4_7Processor`` over 4.6's image and video processors, as
transformers' auto classes pair them), same sizes and tokenizer, with the canvas M-RoPE ids (``image_start_id``,
``image_end_id``, ``slice_start_id``, ``slice_end_id``, ``newline_id``) resolved from the tokenizer as transformers'
conversion script does.  ``--scale-resolution`` sets the processor's (default 112; the real checkpoints' is 448).

``--member ocr`` writes a MiniCPM-OCR checkpoint (transformers >= 5.24: ``MiniCPMOcrConfig``,
``MiniCPMOcrForConditionalGeneration``, ``MiniCPMOcrProcessor`` over ``MiniCPMOcrImageProcessor`` and
``MiniCPMOcrVideoProcessor``): the 4.6 layout with OCR's ``"4x"`` default downsample mode and the image processor's
``small_image_upsize`` at its default (``"always"``); same sizes and tokenizer.

``--moe`` (with ``--member 4.7`` only) gives that checkpoint a ``qwen3_5_moe_text`` text tower, the layout of the
35B-A3B member: every decoder layer's MLP is a sparse MoE block of ``TEXT_MOE["num_experts"]`` (4) routed experts,
top-``num_experts_per_tok`` (2) with the top-k probabilities renormalised (transformers' ``Qwen3_5MoeTopKRouter``
always divides by their sum; vLLM's ``Qwen3NextSparseMoeBlock`` does so when ``norm_topk_prob``, default True, which
``config.json`` states), plus a sigmoid-gated shared expert.  transformers saves the experts unfused:
``model.language_model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.gate.weight``,
``mlp.shared_expert.{gate,up,down}_proj.weight``, ``mlp.shared_expert_gate.weight`` (checked after saving).  The
expert and shared-expert widths (64) are multiples of 32, as vLLM's CPU fused-MoE kernel requires of the hidden and
intermediate dimensions.  Random values as for every other tensor; the router (``mlp.gate.weight``) is a plain
matrix, N(0, 1/fan_in).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

# --------------------------------------------------------------------------------------------------------------------
# Sizes.  Kept in one place so tests can read them from config.json instead of hard-coding.
# --------------------------------------------------------------------------------------------------------------------
PATCH_SIZE = 14  # same as the real checkpoint
VISION = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_channels=3,
    image_size=112,  # 8 x 8 position embeddings
    patch_size=PATCH_SIZE,
    hidden_act="gelu_pytorch_tanh",
    layer_norm_eps=1e-6,
    window_kernel_size=[2, 2],
)
INSERT_LAYER_ID = 1  # vit_merger runs after vision layer 1 (of 0..1)
VOCAB_SIZE = 256
TEXT = dict(
    model_type="qwen3_5_text",
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    layer_types=["linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    attention_bias=False,
    # partial_rotary_factor 0.25 of head_dim 64 -> rotary dim 16 -> mrope sections sum to 8.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,  # CPU GDN kernels need 64 or 128
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
)
# The MoE text tower of ``--moe`` (transformers' ``Qwen3_5MoeTextConfig``, which has no ``intermediate_size``):
# same attention/GDN sizes as TEXT, each MLP replaced by 4 routed experts (top-2) plus a shared expert.
TEXT_MOE = {k: v for k, v in TEXT.items() if k != "intermediate_size"}
TEXT_MOE.update(
    model_type="qwen3_5_moe_text",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,  # vLLM's CPU fused-MoE kernel: hidden and intermediate dims divisible by 32
    shared_expert_intermediate_size=64,
    # transformers 5.19-5.24 always renormalise the top-k weights (the field is removed from their config class);
    # vLLM reads getattr(config, "norm_topk_prob", True).  Stated so that both read the same routing.
    norm_topk_prob=True,
)
SCALE_RESOLUTION = 112  # processor slice resolution (a multiple of 4 * PATCH_SIZE)
MAX_SLICE_NUMS = 9

# --------------------------------------------------------------------------------------------------------------------
# Tokenizer: printable ASCII + \t \n as byte-level base tokens, BPE merges learned (deterministically) from a fixed
# corpus, and the special tokens in the last 16 ids.
# --------------------------------------------------------------------------------------------------------------------
SPECIAL_TOKENS = [  # id = SPECIAL_BASE + index
    "<|endoftext|>",  # pad
    "<|im_start|>",
    "<|im_end|>",  # eos
    "<|image_pad|>",  # image_token_id
    "<|video_pad|>",  # video_token_id
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
    "<unk>",
    "<think>",
    "</think>",
    "<|vision_start|>",
    "<|vision_end|>",
]
SPECIAL_BASE = VOCAB_SIZE - len(SPECIAL_TOKENS)  # 240
SPECIAL_ID = {tok: SPECIAL_BASE + i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
EXTRA_SPECIAL_TOKENS = {  # what MiniCPMV4_6Processor reads off the tokenizer
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}

CORPUS = """\
You are a helpful assistant. Describe this image in one sentence. What is shown in the picture?
The image shows a small red square on a white background, next to a blue circle and a green line.
There is a cat sitting on the table and a dog standing in the garden under the tree.
Please answer the question about the image and the text. What color is the object on the left?
This is a test of the tiny model. It reads images, slices and video frames, and writes short text.
The quick brown fox jumps over the lazy dog. Hello world! How are you today? I am fine, thank you.
def main(): return 0 # numbers 0 1 2 3 4 5 6 7 8 9 10 100 2024 and symbols ( ) [ ] { } < > = + - * / : ;
"""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}\n"
    "{%- if message['content'] is string -%}\n"
    "{{- message['content'] -}}\n"
    "{%- elif message['content'] is not none -%}\n"
    "{%- for part in message['content'] -%}\n"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part -%}\n"
    "{{- '<|image_pad|>' -}}\n"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' or 'video' in part -%}\n"
    "{{- '<|video_pad|>' -}}\n"
    "{%- elif part['type'] == 'text' -%}\n"
    "{{- part['text'] -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{%- if not (loop.last and continue_final_message is defined and continue_final_message) -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (what the ByteLevel pre-tokenizer emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _train_bpe(words: list[str], base: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Plain, deterministic BPE training (ties broken by the pair's text)."""
    counts: dict[tuple[str, ...], int] = {}
    for w in words:
        key = tuple(w)
        counts[key] = counts.get(key, 0) + 1
    known = set(base)
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pairs: dict[tuple[str, str], int] = {}
        for word, c in counts.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        pairs = {p: c for p, c in pairs.items() if p[0] + p[1] not in known}
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        known.add(best[0] + best[1])
        new_counts: dict[tuple[str, ...], int] = {}
        for word, c in counts.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_counts[tuple(out)] = new_counts.get(tuple(out), 0) + c
        counts = new_counts
    return merges


def build_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    b2u = _bytes_to_unicode()
    base_bytes = [0x09, 0x0A] + list(range(0x20, 0x7F))
    base = [b2u[b] for b in base_bytes]  # 97 tokens
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = [w for w, _ in pre.pre_tokenize_str(CORPUS)]
    merges = _train_bpe(words, base, SPECIAL_BASE - len(base))
    vocab = {tok: i for i, tok in enumerate(base)}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) > SPECIAL_BASE:
        raise AssertionError("BPE vocabulary overflows into the special-token ids")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    # Fill any ids left between the merges and the specials so the specials land exactly at SPECIAL_BASE.
    filler = [f"<|reserved_{i}|>" for i in range(len(vocab), SPECIAL_BASE)]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in filler]
        + [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    for t, i in SPECIAL_ID.items():
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        extra_special_tokens=dict(EXTRA_SPECIAL_TOKENS),
        model_max_length=4096,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    return hf_tok


# --------------------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------------------
def build_config(tied: bool, member: str = "4.6", tokenizer=None, moe: bool = False):
    import transformers

    if moe and member != "4.7":
        raise ValueError(f"--moe needs --member 4.7 (got {member})")
    text = dict(TEXT_MOE if moe else TEXT)
    text.update(
        tie_word_embeddings=tied,
        pad_token_id=SPECIAL_ID[PAD_TOKEN],
        eos_token_id=SPECIAL_ID[EOS_TOKEN],
        bos_token_id=None,
    )
    extra = {}
    if member == "4.7":
        extra = dict(
            image_start_id=SPECIAL_ID["<image>"], image_end_id=SPECIAL_ID["</image>"],
            slice_start_id=SPECIAL_ID["<slice>"], slice_end_id=SPECIAL_ID["</slice>"],
            newline_id=tokenizer.encode("\n", add_special_tokens=False)[0],
        )
    else:
        extra = dict(drop_vision_last_layer=False)
    if member == "ocr":  # MiniCPMOcrConfig has neither drop_vision_last_layer nor image_size
        extra = {}
    prefix = _class_prefix(member)
    cfg = getattr(transformers, f"{prefix}Config")(
        text_config=text,
        vision_config=dict(VISION, insert_layer_id=INSERT_LAYER_ID),
        insert_layer_id=INSERT_LAYER_ID,
        **({} if member == "ocr" else {"image_size": SCALE_RESOLUTION}),
        **extra,
        image_token_id=SPECIAL_ID["<|image_pad|>"],
        video_token_id=SPECIAL_ID["<|video_pad|>"],
        tie_word_embeddings=tied,
        downsample_mode=_mode(member),
        merge_kernel_size=[2, 2],
        merger_times=1,
        pad_token_id=SPECIAL_ID[PAD_TOKEN],
        eos_token_id=SPECIAL_ID[EOS_TOKEN],
    )
    cfg.architectures = [f"{prefix}ForConditionalGeneration"]
    return cfg


def _class_prefix(member: str) -> str:
    """transformers' class-name prefix of a member: ``MiniCPMV4_6``, ``MiniCPMV4_7``, ``MiniCPMOcr``."""
    return "MiniCPMOcr" if member == "ocr" else f"MiniCPMV{member.replace('.', '_')}"


def _mode(member: str) -> str:
    """The default downsample mode the checkpoint states: OCR reads documents at ``"4x"``, 4.6/4.7 at ``"16x"``."""
    return "4x" if member == "ocr" else "16x"


def _generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def randomize_(model, seed: int, init_std: float | None = None) -> None:
    """Fill every parameter with seeded random values, scaled so forward passes stay sane.

    * weight matrices / convolutions / MoE experts (each expert's own matrix): N(0, 1/fan_in) (unit gain, so the
      image actually moves the logits: with N(0, 0.02) everywhere, swapping the vit_merger q/k weights changed the
      last logits by ~2e-4 of their spread -- below bf16 noise -- and greedy output ignored the image);
    * token embeddings and lm_head: N(0, 0.1^2); biases: N(0, 0.1^2) (a swapped q/k bias moves the logits ~7%);
    * norm weights: 1 + N(0, 0.1^2), or N(0, 0.1^2) for zero-centred norms (Qwen3.5 RMSNorm computes x * (1 + w));
    * GatedDeltaNet: dt_bias 1 + N(0, 0.1^2), A_log = log(U(1, 16)).
    ``init_std`` (``--init-std``) replaces the first two rules: every weight matrix, convolution, MoE expert, token
    embedding and bias N(0, init_std^2), whatever its fan-in (norms, dt_bias, A_log as above).
    Each tensor has its own generator seeded from (seed, name); tied tensors are filled once.
    """
    import torch

    seen: set[int] = set()
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            cls = type(module).__name__
            is_norm = isinstance(module, torch.nn.LayerNorm) or "Norm" in cls
            for p_name, p in module.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                g = _generator(seed, name)
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
                if p_name == "A_log":
                    u = torch.rand(p.shape, generator=g, dtype=torch.float32)
                    val = torch.log(1.0 + 15.0 * u)
                elif p_name == "dt_bias":
                    val = 1.0 + 0.1 * noise
                elif is_norm and p_name == "weight":
                    centre = 0.0 if bool(torch.all(p == 0)) else 1.0
                    val = centre + 0.1 * noise
                elif init_std is not None:
                    val = init_std * noise
                elif p.dim() == 1:  # biases
                    val = 0.1 * noise
                elif isinstance(module, torch.nn.Embedding) or name == "lm_head.weight":
                    val = 0.1 * noise
                else:
                    # A row's size for (out, in[, kernel]) weights; transformers keeps MoE experts stacked as one
                    # (experts, out, in) tensor, whose fan-in is the last dimension's.
                    fan_in = p.shape[-1] if "Experts" in cls else p[0].numel()
                    val = noise / math.sqrt(fan_in)
                p.copy_(val.to(p.dtype))


def build_model(seed: int, tied: bool, member: str = "4.6", tokenizer=None, moe: bool = False,
                init_std: float | None = None):
    import torch
    import transformers

    torch.manual_seed(seed)  # only affects HF's own init, which randomize_ overwrites entirely
    cfg = build_config(tied, member, tokenizer, moe)
    cls = getattr(transformers, f"{_class_prefix(member)}ForConditionalGeneration")
    model = cls(cfg).to(torch.float32).eval()
    randomize_(model, seed, init_std)
    if tied:
        model.tie_weights()
    return model


def build_processor(tokenizer, member: str = "4.6", scale_resolution: int = SCALE_RESOLUTION):
    import transformers
    from transformers.models.minicpmv4_6 import image_processing_minicpmv4_6 as ipm

    try:
        from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
    except ImportError:  # pragma: no cover - torchvision missing
        MiniCPMV4_6VideoProcessor = None

    common = dict(
        patch_size=PATCH_SIZE,
        scale_resolution=scale_resolution,
        max_slice_nums=MAX_SLICE_NUMS,
        slice_mode=True,
        downsample_mode=_mode(member),
        use_image_id=True,
    )
    if member == "ocr":  # OCR's own image and video processors (its grid alignment and small-image upsize)
        image_processor = transformers.MiniCPMOcrImageProcessor(**common)
        video_processor = transformers.MiniCPMOcrVideoProcessor(**common)
    else:
        image_processor = ipm.MiniCPMV4_6ImageProcessor(**common)
        video_processor = MiniCPMV4_6VideoProcessor(**common) if MiniCPMV4_6VideoProcessor else None
    return getattr(transformers, f"{_class_prefix(member)}Processor")(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def _normalize_tokenizer_config(path: Path) -> None:
    """Name the MiniCPM-V tokens under ``extra_special_tokens`` (a dict).

    transformers 5.x flattens them to top-level keys on save (and writes ``extra_special_tokens: []``); both 5.19 and
    5.24 read the dict form back as tokenizer attributes (``tokenizer.image_token`` / ``image_token_id``).
    """
    cfg = json.loads(path.read_text())
    extra = {k: cfg.pop(k, v) for k, v in EXTRA_SPECIAL_TOKENS.items()}
    cfg["extra_special_tokens"] = extra
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2, ensure_ascii=False) + "\n")


def _check_keys(out_dir: Path, tied: bool, moe: bool = False) -> int:
    from safetensors import safe_open

    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    needed = [
        f"model.vision_tower.vit_merger.self_attn.{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")
    ] + ["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight", "model.language_model.embed_tokens.weight"]
    missing = [k for k in needed if k not in keys]
    if missing:
        raise AssertionError(f"checkpoint lacks expected keys: {missing}")
    if ("lm_head.weight" in keys) == tied:
        raise AssertionError(f"lm_head.weight present={'lm_head.weight' in keys} but tied={tied}")
    if not any(k.startswith("model.merger.") for k in keys):
        raise AssertionError("checkpoint lacks model.merger.*")
    mlp = "model.language_model.layers.{}.mlp."
    if moe:  # the unfused expert layout vLLM's Qwen3_5 loader maps onto w13_weight / w2_weight
        experts = range(TEXT_MOE["num_experts"])
        per_layer = [f"experts.{e}.{p}_proj.weight" for e in experts for p in ("gate", "up", "down")]
        per_layer += ["gate.weight", "shared_expert_gate.weight"]
        per_layer += [f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    else:
        per_layer = [f"{p}_proj.weight" for p in ("gate", "up", "down")]
    missing = [mlp.format(i) + k for i in range(TEXT["num_hidden_layers"]) for k in per_layer
               if mlp.format(i) + k not in keys]
    if missing:
        raise AssertionError(f"checkpoint lacks expected MLP keys: {missing}")
    return len(keys)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--untied", action="store_true", help="tie_word_embeddings=False, write lm_head.weight")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--member", choices=("4.6", "4.7", "ocr"), default="4.6", help="the MiniCPM-V family member to write")
    ap.add_argument("--scale-resolution", type=int, default=SCALE_RESOLUTION, help="the processor's slice resolution")
    ap.add_argument("--moe", action="store_true", help="4.7 only: a qwen3_5_moe_text text tower (4 experts, top-2)")
    ap.add_argument("--init-std", type=float, default=None,
                    help="every matrix, embedding and bias N(0, STD^2) instead of N(0, 1/fan_in) (see randomize_)")
    args = ap.parse_args(argv)
    if args.moe and args.member != "4.7":
        ap.error("--moe needs --member 4.7")

    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    tied = not args.untied
    for stale in [*out.glob("*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous run's weights (e.g. untied) must not linger

    tokenizer = build_tokenizer()  # the processor reads the tokenizer's attributes, so build it first
    model = build_model(args.seed, tied, args.member, tokenizer, args.moe, args.init_std)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    processor = build_processor(tokenizer, args.member, args.scale_resolution)
    processor.save_pretrained(out)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # same text the processor wrote; make it explicit
    _normalize_tokenizer_config(out / "tokenizer_config.json")
    for f in out.iterdir():
        if f.is_file():
            f.chmod(0o644)  # save_pretrained writes the weights 0600

    n_keys = _check_keys(out, tied, args.moe)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        json.dumps(
            {
                "out_dir": str(out),
                "tied": tied,
                "seed": args.seed,
                "keys": n_keys,
                "parameters": sum(p.numel() for p in model.parameters()),
                "folder_bytes": size,
                "model.safetensors sha256": digest,
                **({"moe": TEXT_MOE["num_experts"]} if args.moe else {}),
                **({"init_std": args.init_std} if args.init_std is not None else {}),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
