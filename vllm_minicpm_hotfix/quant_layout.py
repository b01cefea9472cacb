"""How a quantized MiniCPM-V 4.6 checkpoint stores its layers, read from its safetensors headers alone.

Pure functions over a checkpoint folder (nothing here imports vLLM or torch at import time; no tensor data is read):
the post-import fix :mod:`vllm_minicpm_hotfix.fixes.quantized_vision` decides from them which vision layers vLLM
must build quantized, and ``doctor --model`` / ``verify --model`` report them next to what vLLM would build.

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

#: safetensors dtype strings of unquantized (floating) tensors.
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
#: Checkpoint prefixes of the vision side (transformers >= 5.7 names, and the older ``model.vpm`` ones).
VISION_PREFIXES = ("model.vision_tower.", "model.merger.", "model.vpm.", "model.vit_merger.")
#: Files vLLM reads a quantization config from besides ``config.json``'s ``quantization_config``.
QUANT_CONFIG_FILES = ("quantize_config.json", "quant_config.json")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    dtype: str  #: safetensors dtype string, e.g. "BF16", "I32", "U8"
    shape: tuple[int, ...]


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


class LayoutError(ValueError):
    """The checkpoint folder cannot be read as a safetensors checkpoint."""


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The folder's safetensors files: those ``model.safetensors.index.json`` names, else every ``*.safetensors``.

    Raises:
        LayoutError: no safetensors file in ``folder``.
    """
    d = Path(folder)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"no *.safetensors file in {d}")
    return files


def read_tensor_info(folder: str | os.PathLike) -> dict[str, TensorInfo]:
    """``{tensor name: TensorInfo}`` of every tensor in the folder, from the safetensors headers
    (``safetensors.safe_open(...).get_slice(name)``: dtype and shape only, no data is read).

    Raises:
        LayoutError: no safetensors file, or a tensor name in two files.
    """
    from safetensors import safe_open

    out: dict[str, TensorInfo] = {}
    for f in weight_files(folder):
        with safe_open(str(f), framework="numpy") as sf:
            for name in sf.keys():
                if name in out:
                    raise LayoutError(f"tensor {name} is in more than one file of {folder}")
                sl = sf.get_slice(name)
                out[name] = TensorInfo(str(sl.get_dtype()), tuple(int(x) for x in sl.get_shape()))
    return out


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
# Report rows (doctor --model, verify --model)
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


def summarize(rows: Iterable[LayerRow]) -> dict[str, Any]:
    """Counts for one line of a report, and the layers where vLLM's build disagrees with the checkpoint."""
    rows = list(rows)
    return {
        "layers": len(rows),
        "stored_quantized": sum(r.stored == "quantized" for r in rows),
        "built_quantized": sum(bool(r.built_quantized) for r in rows),
        "disagree": [r.layer for r in rows if r.agrees is False],
    }


def describe_rows(rows: Iterable[LayerRow]) -> list[str]:
    """Human lines: ``layer: checkpoint <kind>, vLLM builds <method>[  <-- DISAGREE]``."""
    out = []
    for r in rows:
        built = r.built or "?"
        flag = "  <-- DISAGREE" if r.agrees is False else ""
        out.append(f"{r.layer}: checkpoint {r.stored}, vLLM builds {built}{flag}")
    return out


# --------------------------------------------------------------------------------------------------------------------
# What vLLM builds for each vision layer (needs vLLM; imported inside the functions)
# --------------------------------------------------------------------------------------------------------------------

#: vLLM builds these vision layers as plain ``torch.nn.Linear`` in every release 0.22-0.33 (never quantized).
PLAIN_LINEAR_PREFIXES = ("merger.", "vit_merger.linear_")
PLAIN_LINEAR = "torch.nn.Linear"


def vision_linear_layers(storage: Mapping[str, ModuleStorage], to_vllm: Any, packed: Mapping[str, list[str]]) -> dict:
    """``{vLLM layer name: (checkpoint modules, (out, in) or None)}`` for the vision linear layers of a checkpoint:
    modules with a 2-D ``weight`` or stored quantized, not embeddings; q/k/v shards grouped under their fused name
    (``packed``, vLLM's ``packed_modules_mapping``); ``to_vllm`` maps a checkpoint module name to vLLM's."""
    shard_of = {s: fused for fused, shards in packed.items() for s in shards}
    layers: dict[str, list[str]] = {}
    for module, s in storage.items():
        if "embed" in module or not s.is_linear:
            continue
        name = to_vllm(module)
        if name is None:
            continue
        head, _, last = name.rpartition(".")
        if last in shard_of:
            name = f"{head}.{shard_of[last]}"
        layers.setdefault(name, []).append(module)
    return dict(sorted(layers.items()))


def _stand_in(layer_cls: Any, prefix: str) -> Any:
    from torch import nn

    layer = layer_cls.__new__(layer_cls)
    nn.Module.__init__(layer)
    sizes = dict(input_size=64, output_size=64, input_size_per_partition=64, output_size_per_partition=64,
                 output_partition_sizes=[64], prefix=prefix, tp_size=1, tp_rank=0, params_dtype=None)  # fmt: skip
    for k, v in sizes.items():
        object.__setattr__(layer, k, v)
    return layer


def vllm_vision_rows(folder: str | os.PathLike, quant_config: Any, model_cls: type, *, hotfix: bool) -> list[LayerRow]:
    """For each vision linear layer of the checkpoint in ``folder``: how it is stored and the quant method vLLM's
    ``quant_config`` (configured for ``model_cls`` as vLLM's ``configure_quant_config`` does) gives it -- stock, or
    with the ``quantized_vision`` fix's decision when ``hotfix``. A decision that raises is reported as
    ``error: <message>``. Layers vLLM builds as plain ``nn.Linear`` are reported as such."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear

    from .fixes import quantized_vision as qv

    storage = vision_storage(folder)
    plan = qv.VisionPlan.build(storage, model_cls, str(folder))
    rows = []
    for name, modules in vision_linear_layers(storage, qv._rename(model_cls), plan.packed).items():
        kind = stored_kind(modules, storage)
        if name.startswith(PLAIN_LINEAR_PREFIXES):
            rows.append(LayerRow(name, kind, tuple(modules), PLAIN_LINEAR))
            continue
        layer = _stand_in(QKVParallelLinear if name.endswith("qkv_proj") else ColumnParallelLinear, name)
        try:
            if hotfix:
                method = qv.decide(plan, quant_config, layer, name, lambda: quant_config.get_quant_method(layer, name))
            else:
                method = quant_config.get_quant_method(layer, prefix=name)
            built = type(method).__name__ if method is not None else "None"
        except Exception as exc:  # noqa: BLE001 - the report says what vLLM would do, errors included
            built = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        rows.append(LayerRow(name, kind, tuple(modules), built))
    return rows


def report(folder: str | os.PathLike, *, hotfix: bool | None = None) -> dict[str, Any]:
    """Everything ``doctor --model`` / ``verify --model`` print about a quantized checkpoint's vision side, from vLLM's
    own ``ModelConfig`` / ``VllmConfig`` for ``folder``: the rows stock vLLM's quant config gives (``"stock"``) and the
    rows with the ``quantized_vision`` fix's decision (``"hotfix"``); ``"active"`` says which one a vLLM started
    here uses (``hotfix``; None: the installed hotfix's status). ``{"quant_method": None}`` for an unquantized
    checkpoint; ``{"quant_method", "error"}`` if vLLM cannot make a config for it (e.g. a method it lacks)."""
    method = quant_method(folder)
    if method is None:
        return {"quant_method": None}
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.config import DeviceConfig, ModelConfig, VllmConfig
        from vllm.model_executor.model_loader.utils import configure_quant_config, get_model_architecture

        model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
        vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))
        model_cls, _ = get_model_architecture(model_config)
        configure_quant_config(vllm_config.quant_config, model_cls)
    except Exception as exc:  # noqa: BLE001
        return {"quant_method": method, "error": f"{type(exc).__name__}: {str(exc)[:600]}"}
    if hotfix is None:
        try:
            import vllm_minicpm_hotfix

            from .fixes import _deferred

            _deferred.resolve("quantized_vision")  # probed at first use: this report is a use
            hotfix = bool(vllm_minicpm_hotfix.status().get("fixes", {}).get("quantized_vision", {}).get("applied"))
        except Exception:  # noqa: BLE001
            hotfix = False
    stock = vllm_vision_rows(folder, vllm_config.quant_config, model_cls, hotfix=False)
    fixed = vllm_vision_rows(folder, vllm_config.quant_config, model_cls, hotfix=True)
    return {"quant_method": method, "quant_config": type(vllm_config.quant_config).__name__, "stock": stock,
            "hotfix": fixed, "active": "hotfix" if hotfix else "stock"}  # fmt: skip


def _as_rows(rows: Iterable[Any]) -> list[LayerRow]:
    return [r if isinstance(r, LayerRow) else LayerRow(r["layer"], r["stored"], tuple(r["checkpoint"]), r["built"])
            for r in rows]  # fmt: skip


def report_lines(rep: Mapping[str, Any]) -> tuple[bool, list[str]]:
    """:func:`report` (or its JSON form) as ``(agrees, text lines)``; ``agrees`` is False when the vLLM started here
    would build a vision layer differently from how the checkpoint stores it."""
    if rep.get("quant_method") is None:
        return True, ["checkpoint not quantized"]
    if "error" in rep:
        return False, [f"quant_method {rep['quant_method']!r}: vLLM cannot configure it: {rep['error']}"]
    stock, fixed = _as_rows(rep["stock"]), _as_rows(rep["hotfix"])
    s, f = summarize(stock), summarize(fixed)
    active = fixed if rep.get("active") == "hotfix" else stock
    bad = summarize(active)["disagree"]
    out = [f"quant_method {rep['quant_method']!r} ({rep['quant_config']}): {s['stored_quantized']} of {s['layers']} "
           f"vision linear layers stored quantized; stock vLLM builds {s['built_quantized']} quantized "
           f"({len(s['disagree'])} disagree), with the hotfix {f['built_quantized']} ({len(f['disagree'])} disagree); "
           f"this environment: {rep.get('active')}"]  # fmt: skip
    if bad:
        out.append(f"DISAGREE ({rep.get('active')}): {', '.join(bad[:6])}" + (" ..." if len(bad) > 6 else ""))
    return not bad, out + ["  " + line for line in describe_rows(active)]


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_minicpm_hotfix.quant_layout DIR``: :func:`report` as JSON (what doctor's child prints)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    rep = report(args[0])
    for key in ("stock", "hotfix"):
        if rep.get(key) is not None:
            rep[key] = [dataclasses.asdict(r) | {"agrees": r.agrees} for r in rep[key]]
    print(json.dumps(rep))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
