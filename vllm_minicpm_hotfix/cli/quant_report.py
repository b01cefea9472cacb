"""What ``doctor --model`` / ``verify --model`` report about a quantized checkpoint's vision side: for each vision
linear layer, how the checkpoint stores it (:mod:`vllm_minicpm_hotfix.quant_layout`, from the safetensors headers)
and the quant method vLLM's own quant config gives it, stock and with the ``quantized_vision`` fix's decision.

Importing this module imports neither vLLM nor torch; :func:`report` does. ``doctor --model`` runs it, with the stop
tokens, in a fresh vLLM process (:mod:`vllm_minicpm_hotfix.cli.model_report`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..quant_layout import LayerRow, ModuleStorage, quant_method, stored_kind, vision_storage


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

    from ..fixes import quantized_vision as qv

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

            from ..fixes._base import deferred

            deferred.resolve("quantized_vision")  # probed at first use: this report is a use
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


def as_json(rep: dict[str, Any]) -> dict[str, Any]:
    """:func:`report` with its rows as plain dicts (``agrees`` included): what :func:`report_lines` reads back."""
    rep = dict(rep)
    for key in ("stock", "hotfix"):
        if rep.get(key) is not None:
            rep[key] = [dataclasses.asdict(r) | {"agrees": r.agrees} for r in rep[key]]
    return rep

