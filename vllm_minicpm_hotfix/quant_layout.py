"""How a quantized MiniCPM-V 4.6 checkpoint stores its layers, read from its safetensors headers alone.

Pure functions over a checkpoint folder (the headers come from :mod:`vllm_minicpm_hotfix.checkpoint`; nothing here
imports vLLM or torch, and no tensor data is read):
the post-import fix :mod:`vllm_minicpm_hotfix.fixes.quantized_vision` decides from them which vision layers vLLM
must build quantized, and ``doctor --model`` / ``verify --model`` report them next to what vLLM would build
(:mod:`vllm_minicpm_hotfix.cli.quant_report`).

A *module* is a checkpoint tensor name without its last component (``model.vision_tower.encoder.layers.0.mlp.fc1``
for ``….fc1.weight`` / ``….fc1.qweight``); bitsandbytes' nested names (``….weight.absmax``,
``….weight.quant_state.bitsandbytes__nf4``) belong to the module before ``.weight``. A module is stored *quantized*
when any of its tensors has a non-floating dtype (GPTQ/AWQ ``qweight``/``qzeros``/``g_idx`` are int32, bitsandbytes'
``weight`` uint8, FP8 ``F8_*``), *float* when all of them are ``F16``/``BF16``/``F32``/``F64``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# The quantized_vision fix reads TensorInfo and read_tensor_info from here too: one lazy import for the fix.
from .checkpoint import TensorInfo, read_tensor_info

#: safetensors dtype strings of unquantized (floating) tensors.
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
#: Checkpoint prefixes of the vision side (transformers >= 5.7 names, and the older ``model.vpm`` ones).
VISION_PREFIXES = ("model.vision_tower.", "model.merger.", "model.vpm.", "model.vit_merger.")
#: Files vLLM reads a quantization config from besides ``config.json``'s ``quantization_config``.
QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


@dataclasses.dataclass(frozen=True)
class ModuleStorage:
    """How the checkpoint stores one module: ``quantized``, the tensor suffixes (``weight``, ``bias``, ``qweight``,
    ``qzeros``, ``scales``, ``g_idx``, ``weight.absmax`` …) and their dtypes, in name order."""

    module: str
    quantized: bool
    suffixes: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def is_linear(self) -> bool:
        """Stored quantized, or holds a 2-D ``weight`` (a linear layer's, or an embedding's)."""
        if self.quantized:
            return True
        return any(s == "weight" and len(sh) == 2 for s, sh in zip(self.suffixes, self.shapes))

    def describe(self) -> str:
        kind = "quantized" if self.quantized else "float"
        return f"{kind} ({', '.join(f'{s} {d}' for s, d in zip(self.suffixes, self.dtypes))})"


def split_name(name: str) -> tuple[str, str]:
    """``(module, suffix)`` of a tensor name; bitsandbytes' ``….weight.<state>`` keeps ``weight.<state>`` as suffix."""
    head, sep, tail = name.partition(".weight.")
    if sep:
        return head, "weight." + tail
    module, _, suffix = name.rpartition(".")
    return module, suffix


def module_storage(tensors: Mapping[str, TensorInfo]) -> dict[str, ModuleStorage]:
    """Group tensors by module: ``{module: ModuleStorage}``."""
    grouped: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for name, info in sorted(tensors.items()):
        module, suffix = split_name(name)
        grouped.setdefault(module, []).append((suffix, info.dtype, tuple(info.shape)))
    return {
        m: ModuleStorage(m, any(d not in FLOAT_DTYPES for _, d, _ in items), tuple(s for s, _, _ in items),
                         tuple(d for _, d, _ in items), tuple(sh for _, _, sh in items))
        for m, items in grouped.items()
    }  # fmt: skip


def quantization_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint's quantization config: ``config.json``'s ``quantization_config`` (or its ``text_config``'s),
    else ``quantize_config.json`` / ``quant_config.json``; None for an unquantized checkpoint."""
    d = Path(folder)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}
    qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
    if qc:
        return dict(qc)
    for name in QUANT_CONFIG_FILES:
        try:
            return dict(json.loads((d / name).read_text()))
        except (OSError, ValueError):
            continue
    return None


def quant_method(folder: str | os.PathLike) -> str | None:
    qc = quantization_config(folder)
    return None if qc is None else str(qc.get("quant_method", "") or "") or None


def is_vision(module: str) -> bool:
    return module.startswith(VISION_PREFIXES)


def vision_storage(folder: str | os.PathLike) -> dict[str, ModuleStorage]:
    """``{module: ModuleStorage}`` of the vision tower, vit_merger and merger modules that hold a ``weight`` (or a
    quantized form of one): the linear, convolution, embedding and norm layers."""
    return {
        m: s
        for m, s in module_storage(read_tensor_info(folder)).items()
        if is_vision(m) and (s.quantized or "weight" in s.suffixes)
    }


# --------------------------------------------------------------------------------------------------------------------
# Layer rows (the fix's decisions; doctor --model, verify --model)
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerRow:
    """One vision linear layer: what the checkpoint stores, what vLLM builds (None: not known), whether they agree."""

    layer: str  #: vLLM's module name, e.g. ``vpm.encoder.layers.0.self_attn.qkv_proj``
    stored: str  #: "float" | "quantized" | "mixed" | "absent"
    checkpoint: tuple[str, ...]  #: the checkpoint modules the layer loads from
    built: str | None  #: vLLM's quant method class name, e.g. "UnquantizedLinearMethod", "AutoAWQMarlinLinearMethod"

    @property
    def built_quantized(self) -> bool | None:
        if self.built is None or self.built.startswith("error"):
            return None
        return not (self.built.startswith("Unquantized") or self.built == "torch.nn.Linear")

    @property
    def agrees(self) -> bool | None:
        if self.stored == "mixed" or (self.built or "").startswith("error"):
            return False
        if self.built_quantized is None or self.stored not in ("float", "quantized"):
            return None
        return self.built_quantized == (self.stored == "quantized")


def stored_kind(modules: Iterable[str], storage: Mapping[str, ModuleStorage]) -> str:
    """``"float"`` / ``"quantized"`` if every present module is stored so, ``"mixed"`` if they differ, ``"absent"``
    if none is in the checkpoint."""
    kinds = {storage[m].quantized for m in modules if m in storage}
    if not kinds:
        return "absent"
    if len(kinds) > 1:
        return "mixed"
    return "quantized" if kinds.pop() else "float"
