"""Tiny quantized MiniCPM-V 4.6 checkpoints, written by the tests from the bundled bf16 tiny checkpoint.

Nothing here imports vLLM. Every quantized tensor is built from integer codes chosen here (round-to-nearest of the
tiny checkpoint's own weight, with power-of-two scales), so

* the packing is bit-exact and can be checked independently: :func:`unpack_gptq` / :func:`unpack_awq` read the
  nibbles back with plain shifts and masks, and ``(code - zero) * scale`` is exactly representable in bf16
  (|code - zero| <= 15 needs 4 significant bits, a power-of-two scale none), so the dequantized weight of every
  layer is a bf16 tensor with no rounding at all;
* a bf16 twin (:func:`write_dequantized_twin`) holding exactly those dequantized weights computes the same function
  as the packed checkpoint, up to the kernel's arithmetic.

Layouts (what GPTQModel 5.x / AutoAWQ write; tensor names are transformers' own, ``model.language_model.…``):

GPTQ (``checkpoint_format`` "gptq", v1), for a linear layer with weight ``W[out, in]``, group size ``g``:
    ``qweight`` int32 ``[in / 8, out]``: ``qweight[r, o] = sum_j code[o, 8 r + j] << 4 j`` (j = 0..7, low nibble first);
    ``qzeros``  int32 ``[in / g, out / 8]``: ``qzeros[G, c] = sum_j (zero[G, 8 c + j] - 1) << 4 j`` (v1 stores zero - 1);
    ``scales``  fp16  ``[in / g, out]``;  ``g_idx`` int32 ``[in]`` = ``i // g``;
    ``W[o, i] = (code[o, i] - zero[i // g, o]) * scales[i // g, o]``; symmetric 4-bit: ``zero = 8``.
AWQ (GEMM, "version": "gemm"):
    ``qweight`` int32 ``[in, out / 8]``: ``qweight[i, c] = sum_j code[8 c + ORDER[j], i] << 4 j`` with
    ``ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``; ``qzeros`` int32 ``[in / g, out / 8]`` the same interleave, zero not offset;
    ``scales`` fp16 ``[in / g, out]``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

BITS = 4
PACK = 32 // BITS  # 8 codes per int32
GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

#: The language-model linear layers GPTQModel's MiniCPM-V 4.6 definition quantizes (``module_tree`` of
#: ``gptqmodel/models/definitions/minicpmv_4_6.py``: ``in_proj_b`` / ``in_proj_a`` are marked ``:!``, not quantized).
LM_QUANTIZED = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)  # fmt: skip
LM_PREFIX = "model.language_model.layers."
VIT_MERGER_QKV = tuple(f"model.vision_tower.vit_merger.self_attn.{p}_proj" for p in "qkv")


def is_lm_quantized(module: str) -> bool:
    """``module`` (a checkpoint module name, no suffix) is a language-model linear layer GPTQModel quantizes."""
    return module.startswith(LM_PREFIX) and module.split(".", 4)[-1] in LM_QUANTIZED


# --------------------------------------------------------------------------------------------------------------------
# Codes
# --------------------------------------------------------------------------------------------------------------------


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), as float32."""
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0**-20))))


def choose_codes(weight: torch.Tensor, *, sym: bool, group: int = GROUP):
    """Round-to-nearest 4-bit codes for ``weight[out, in]`` (float): ``(codes[out, in], zeros[G, out], scales[G, out])``.

    codes / zeros are int64 in 0..15, scales float16 powers of two; ``G = in / group``. Symmetric: zero 8.
    """
    out, inp = weight.shape
    if inp % group or out % PACK:
        raise ValueError(f"weight {tuple(weight.shape)}: in must be a multiple of {group}, out of {PACK}")
    w = weight.detach().float().reshape(out, inp // group, group)  # [out, G, g]
    if sym:
        scale = _pow2_at_least(w.abs().amax(-1) / 7.0)  # [out, G]
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = w.amin(-1).clamp_max(0), w.amax(-1).clamp_min(0)
        scale = _pow2_at_least((hi - lo) / 15.0)
        zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)
    return (
        codes.reshape(out, inp).to(torch.int64),
        zero.t().contiguous().to(torch.int64),
        scale.t().contiguous().to(torch.float16),
    )


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """``W[o, i] = (codes[o, i] - zeros[i // group, o]) * scales[i // group, o]`` as float32 (exact)."""
    g_idx = torch.arange(codes.shape[1]) // group
    return (codes - zeros[g_idx].t()).to(torch.float32) * scales[g_idx].t().to(torch.float32)


# --------------------------------------------------------------------------------------------------------------------
# Packing (int64 arithmetic, then the low 32 bits reinterpreted as int32)
# --------------------------------------------------------------------------------------------------------------------


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_rows(values: torch.Tensor, order=tuple(range(PACK))) -> torch.Tensor:
    """Pack 8 consecutive entries of dim 0 into one int32: ``out[r] = sum_j values[8 r + order[j]] << 4 j``."""
    v = values.to(torch.int64).reshape(values.shape[0] // PACK, PACK, *values.shape[1:])
    acc = torch.zeros_like(v[:, 0])
    for j, src in enumerate(order):
        acc |= (v[:, src] & 0xF) << (BITS * j)
    return _to_int32(acc)


def _unpack_rows(packed: torch.Tensor, order=tuple(range(PACK))) -> torch.Tensor:
    p = packed.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(p.shape[0], PACK, *p.shape[1:], dtype=torch.int64)
    for j, dst in enumerate(order):
        out[:, dst] = (p >> (BITS * j)) & 0xF
    return out.reshape(p.shape[0] * PACK, *p.shape[1:])


def pack_gptq(codes, zeros, scales, group: int = GROUP) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors for one layer (see the module docstring)."""
    inp = codes.shape[1]
    return {
        "qweight": _pack_rows(codes.t()),  # [in/8, out]
        "qzeros": _pack_rows((zeros - 1).t()).t().contiguous(),  # [G, out/8]
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": (torch.arange(inp) // group).to(torch.int32),
    }


def unpack_gptq(t: dict[str, torch.Tensor]):
    """Inverse of :func:`pack_gptq`: ``(codes[out, in], zeros[G, out], scales[G, out])``."""
    codes = _unpack_rows(t["qweight"]).t()
    zeros = _unpack_rows(t["qzeros"].t()).t() + 1
    return codes.contiguous(), zeros.contiguous(), t["scales"]


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors for one layer (see the module docstring)."""
    return {
        "qweight": _pack_rows(codes, AWQ_ORDER).t().contiguous(),  # [in, out/8]
        "qzeros": _pack_rows(zeros.t(), AWQ_ORDER).t().contiguous(),  # [G, out/8]
        "scales": scales.to(torch.float16).contiguous(),
    }


def unpack_awq(t: dict[str, torch.Tensor]):
    """Inverse of :func:`pack_awq`: ``(codes[out, in], zeros[G, out], scales[G, out])``."""
    codes = _unpack_rows(t["qweight"].t(), AWQ_ORDER)
    zeros = _unpack_rows(t["qzeros"].t(), AWQ_ORDER).t()
    return codes.contiguous(), zeros.contiguous(), t["scales"]


# --------------------------------------------------------------------------------------------------------------------
# Checkpoint folders
# --------------------------------------------------------------------------------------------------------------------

GPTQ_CONFIG = {  # what GPTQModel writes (no module list), trimmed of its "meta" block
    "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True, "lm_head": False,
    "quant_method": "gptq", "checkpoint_format": "gptq", "pack_dtype": "int32",
}  # fmt: skip
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def _copy_side_files(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def write_checkpoint(
    src: Path,
    dst: Path,
    *,
    method: str | None,
    quantize: Callable[[str], bool] = lambda m: False,
    quantization_config: dict | None = None,
    float_dtype: torch.dtype = torch.bfloat16,
    transform: Callable[[dict[str, torch.Tensor], dict], None] | None = None,
    sym: bool | None = None,
) -> dict[str, dict]:
    """Write ``dst``: ``src``'s side files and tensors, float tensors cast to ``float_dtype``, and every linear layer
    whose module name satisfies ``quantize`` replaced by its packed form (``method`` "gptq" or "awq"; None: keep the
    dequantized weight as float -- the exact bf16 twin). ``transform(tensors, config)`` may edit both first.
    ``sym``: symmetric codes (zero 8); default: symmetric unless ``method`` is "awq".

    Returns ``{module: {"codes", "zeros", "scales"}}`` of every quantized layer (the chosen integer codes).
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    tensors = read_tensors(src)
    if transform is not None:
        transform(tensors, config)
    chosen: dict[str, dict] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and t.dim() == 2 and quantize(module):
            codes, zeros, scales = choose_codes(t, sym=(method != "awq") if sym is None else sym)
            chosen[module] = {"codes": codes, "zeros": zeros, "scales": scales}
            if method == "gptq":
                out.update({f"{module}.{k}": v for k, v in pack_gptq(codes, zeros, scales).items()})
            elif method == "awq":
                out.update({f"{module}.{k}": v for k, v in pack_awq(codes, zeros, scales).items()})
            else:
                out[name] = dequantize(codes, zeros, scales).to(float_dtype)
        else:
            out[name] = t.to(float_dtype) if t.is_floating_point() else t
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    config["dtype"] = str(float_dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, str(dst / "model.safetensors"), {"format": "pt"})
    return chosen


# --------------------------------------------------------------------------------------------------------------------
# bitsandbytes NF4 (as transformers serializes a 4-bit model; written by hand: bitsandbytes is not needed to write it)
# --------------------------------------------------------------------------------------------------------------------

#: bitsandbytes' NF4 code book.
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)  # fmt: skip
BNB_BLOCK = 64
BNB_CONFIG = {
    "quant_method": "bitsandbytes", "_load_in_4bit": True, "_load_in_8bit": False, "load_in_4bit": True,
    "load_in_8bit": False, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_use_double_quant": False, "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["lm_head"],
}  # fmt: skip


def pack_nf4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight``, ``weight.absmax``, ``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4`` of one layer:
    row-major blocks of 64, absmax per block, nearest NF4 code, two codes per byte (first in the high nibble)."""
    flat = weight.detach().float().reshape(-1)
    blocks = flat.reshape(-1, BNB_BLOCK)
    absmax = blocks.abs().amax(1).clamp_min(1e-12)
    table = torch.tensor(NF4)
    codes = (blocks / absmax[:, None])[..., None].sub(table).abs().argmin(-1).reshape(-1)
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).reshape(-1, 1)
    state = {"quant_type": "nf4", "blocksize": BNB_BLOCK, "dtype": "bfloat16", "shape": list(weight.shape)}
    return {
        "weight": packed,
        "weight.absmax": absmax.to(torch.float32),
        "weight.quant_map": table.to(torch.float32),
        "weight.quant_state.bitsandbytes__nf4": torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8),
    }


def write_bnb(src: Path, dst: Path) -> None:
    """An NF4 twin of ``src``: every 2-D linear weight (vision and merger too, as transformers quantizes every
    ``nn.Linear`` not in ``llm_int8_skip_modules``) packed, embeddings and the rest bf16."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = _copy_side_files(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in read_tensors(src).items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and t.dim() == 2 and "embed" not in module and t.numel() % BNB_BLOCK == 0:
            out.update({f"{module}.{k}": v for k, v in pack_nf4(t).items()})
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    config["quantization_config"] = dict(BNB_CONFIG)
    config["dtype"] = "bfloat16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(out.items())}, str(dst / "model.safetensors"), {"format": "pt"})
