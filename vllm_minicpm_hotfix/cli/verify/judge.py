"""What ``verify`` concludes: vLLM's loaded vit_merger tensors against the checkpoint's, bit for bit.

* :func:`compare` -- one :class:`Row` per vLLM parameter (``qkv_proj.{weight,bias}`` against ``cat(q, k, v)`` of the
  checkpoint, ``out_proj.{weight,bias}`` against the checkpoint's), after the dtype cast vLLM itself applies on copy.
* :func:`verdict` -- the last line, ``PASS: ...`` or ``FAIL: ...``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...fixes.qkv_loader import FUSED
from .checkpoint import QKV, SUFFIXES, Checkpoint
from .build import Built

#: Where vLLM keeps the window-merger attention.
PARAM_PREFIX = "vit_merger.self_attn."


@dataclasses.dataclass
class Row:
    tensor: str
    shape: str
    dtype: str
    ok: bool
    result: str


def _compare(got: Any, parts: list[tuple[str, Any]]) -> tuple[bool, str]:
    """``got`` (vLLM's parameter) against the checkpoint tensors ``parts`` stacked on dim 0."""
    import torch

    for name, t in parts:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return False, f"FAIL checkpoint tensor {name} holds {bad} non-finite value(s) (NaN/Inf): corrupt"
    want_shape = [sum(t.shape[0] for _, t in parts), *parts[0][1].shape[1:]]
    if list(got.shape) != want_shape:
        return False, f"MISMATCH shape {list(got.shape)} != {want_shape} from {', '.join(n for n, _ in parts)}"
    start, bad_parts = 0, []
    for name, t in parts:
        rows = t.shape[0]
        mine = got[start:start + rows]
        ref = t.to(got.dtype)
        if not torch.equal(mine, ref):
            differ = int((mine != ref).sum())
            diff = (mine.double() - ref.double()).abs()
            diff = diff[torch.isfinite(diff)]
            worst = f", max |diff| {float(diff.max()):.3g}" if diff.numel() else ""
            where = f"rows {start}:{start + rows} " if len(parts) > 1 else ""
            bad_parts.append(f"{where}!= checkpoint {name} ({differ}/{mine.numel()} values differ{worst})")
        start += rows
    if bad_parts:
        return False, "MISMATCH " + "; ".join(bad_parts)
    what = "cat(" + ", ".join(n.rsplit(".", 2)[-2] for n, _ in parts) + ")" if len(parts) > 1 else "checkpoint"
    return True, f"OK == {what}"


def compare(built: Built, ckpt: Checkpoint, reference: dict[str, Any]) -> list[Row]:
    params = dict(built.model.named_parameters())
    rows = []
    targets = [(FUSED, QKV), ("out_proj", ("out_proj",))]
    for fused, sources in targets:
        for suffix in SUFFIXES:
            pname = f"{PARAM_PREFIX}{fused}.{suffix}"
            parts = [(ckpt.attn(p, suffix), reference[ckpt.attn(p, suffix)]) for p in sources]
            ck_dtype = str(parts[0][1].dtype).replace("torch.", "")
            param = params.get(pname)
            if param is None:
                rows.append(Row(pname, "-", "-", False, f"FAIL vLLM's model has no parameter {pname}"))
                continue
            got = param.detach()
            if got.device.type == "meta":
                rows.append(Row(pname, str(list(got.shape)), "-", False, "FAIL parameter is on the meta device"))
                continue
            got = got.to("cpu")
            dtype = str(got.dtype).replace("torch.", "")
            if dtype != ck_dtype:
                dtype = f"{dtype} (checkpoint {ck_dtype})"
            ok, result = _compare(got, parts)
            rows.append(Row(pname, str(list(got.shape)), dtype, ok, result))
    return rows


def verdict(rows: list[Row], *, active: bool, version: str) -> tuple[bool, str]:
    """``(ok, the last line)``: every row matches, or the first that does not."""
    state = "hotfix active" if active else "hotfix not active"
    bad = [r for r in rows if not r.ok]
    if not bad:
        return True, (f"PASS: all {len(rows)} vit_merger qkv_proj/out_proj tensors equal the checkpoint bit for bit "
                      f"through vLLM {version}'s own load_weights ({state})")
    return False, (f"FAIL: {len(bad)} of {len(rows)} vit_merger tensors do not match the checkpoint ({state}); "
                   f"{bad[0].tensor}: {bad[0].result}")
