#!/usr/bin/env python
"""The completeness guard's cost on a full-size load: stock and guarded loads alternating in one process.

    python benchmarks/guard_inproc.py CHECKPOINT_DIR LOADS      # with the vLLM 0.32.0 environment's interpreter

Like benchmarks/load_inproc.py, for ``fixes/qkv_completeness_guard.py`` instead of the q/k/v loader: one vLLM 0.32.0 model (a
release whose own loading is correct: under ``auto`` the guard is what applies there) is built once in bf16 from the
full-size synthetic checkpoint (benchmarks/make_full_checkpoint.py), loaded once to warm up, then ``LOADS`` times
through ``model.load_weights`` over the safetensors iterator, the guard applied before every second load and reverted
after it (``fixes.qkv_completeness_guard.apply`` / ``fixes._base.revert``, what the hook and the tests use), order A B B A A B ...
so drift cancels. After the last load the vit_merger ``qkv_proj`` is checked against ``cat(q, k, v)`` of the
checkpoint, and the guard's own work per load is timed alone (50 times: find the parameters in the whole model, wrap
and restore their weight loaders, judge completeness). Prints one JSON line: per load the mode, wall and CPU seconds;
the medians, their ratio B/A and a 95% bootstrap interval of the ratio (benchmarks/common.py); the guard's own time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def main() -> int:
    ckpt, loads = Path(sys.argv[1]), int(sys.argv[2])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_MINICPM_HOTFIX"] = "off"  # nothing from the hook: the guard is applied by hand below
    sys.path[:0] = [str(REPO), str(HERE)]

    import torch
    from common import compare
    from safetensors import safe_open

    from vllm_minicpm_hotfix.fixes import _base
    from vllm_minicpm_hotfix.fixes import qkv_completeness_guard as qkv_guard
    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, checkpoint_files, load_checkpoint

    model = build_vllm_model(ckpt, dtype="bfloat16", load=False)
    module = sys.modules[type(model).__module__]
    if not qkv_guard.probe(module).broken:
        raise SystemExit("expected a vLLM whose own loading lets a missing q/k/v shard through (e.g. 0.32.0)")
    load_checkpoint(model, ckpt)  # warm-up: parameters resident, page cache warm

    out = []
    for i in range(loads):
        guarded = (i % 4) in (1, 2)  # A B B A | A B B A ...
        if guarded:
            qkv_guard.apply(module)
        c0, t0 = time.process_time(), time.perf_counter()
        load_checkpoint(model, ckpt)
        t1, c1 = time.perf_counter(), time.process_time()
        if guarded != _base.is_patched(qkv_guard, module):
            raise SystemExit(f"load {i}: guarded={_base.is_patched(qkv_guard, module)}, expected {guarded}")
        if guarded:
            _base.revert(module)
        out.append({"guarded": guarded, "load_s": t1 - t0, "load_cpu_s": c1 - c0})

    attn = model.vit_merger.self_attn
    prefix = "model.vision_tower.vit_merger.self_attn."
    with safe_open(str(checkpoint_files(ckpt)[0]), framework="pt") as sf:
        exact = all(
            torch.equal(getattr(attn.qkv_proj, s).detach(),
                        torch.cat([sf.get_tensor(f"{prefix}{p}_proj.{s}") for p in "qkv"]).to(torch.bfloat16))
            for s in ("weight", "bias")
        )
    # The guard's own work per load, without the load around it: find the vit_merger qkv_proj parameters in the
    # whole model and wrap their weight loaders, put them back, judge completeness (the observers' per-call cost, six
    # calls per load, is not in here: a Python call and a set update each).
    from vllm_minicpm_hotfix.fixes.qkv_completeness_guard import _Watch

    attn_cls = type(model.vit_merger.self_attn)
    own = []
    for _ in range(50):
        t0 = time.perf_counter()
        watch = _Watch(model, attn_cls)
        watch.stop()
        watch.check()  # nothing arrived in this "load"; an earlier guarded load filled every shard: passes
        own.append(time.perf_counter() - t0)
    a = [x for x in out if not x["guarded"]]
    b = [x for x in out if x["guarded"]]
    print(json.dumps({
        "loads": out,
        "exact": exact,
        "wall": compare([x["load_s"] for x in a], [x["load_s"] for x in b]),
        "cpu": compare([x["load_cpu_s"] for x in a], [x["load_cpu_s"] for x in b]),
        "guard_own_ms_median": 1e3 * sorted(own)[len(own) // 2],
        "modules": sum(1 for _ in model.modules()),
        "loadavg": os.getloadavg(),
    }))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
