#!/usr/bin/env python
"""Stock and patched full-size loads alternating in one process: the load-time difference without process noise.

    python benchmarks/load_inproc.py CHECKPOINT_DIR LOADS

A companion to benchmarks/load_one.py (one load per fresh process, the headline figures). Here one vLLM 0.32.0 model
is built once (``auto``: vLLM's own loading is correct there, nothing patched), then loaded ``LOADS`` times, the q/k/v
fix applied before every second load and reverted after it (``fixes.qkv_loader.apply`` / ``fixes._base.revert``, the
same functions the hook uses), order A B B A A B ... so drift cancels. Every load copies the whole checkpoint into
the same, already resident parameters, with the page cache warm, so what is left between A and B is the loader.
Prints one JSON line: per load the mode, wall and CPU seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ckpt, loads = Path(sys.argv[1]), int(sys.argv[2])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_MINICPM_HOTFIX"] = "auto"
    sys.path.insert(0, str(REPO))

    import vllm_minicpm_hotfix
    from vllm_minicpm_hotfix.fixes import _base, qkv_loader
    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, load_checkpoint

    vllm_minicpm_hotfix.install()
    model = build_vllm_model(ckpt, dtype="bfloat16", load=False)
    module = sys.modules[type(model).__module__]
    attn_cls = type(model.vit_merger.self_attn)
    if _base.is_patched(qkv_loader, module):
        raise SystemExit("expected an unpatched model (run on a release whose own loading is correct, e.g. 0.32.0)")
    load_checkpoint(model, ckpt)  # warm-up: parameters resident, page cache warm

    out = []
    for i in range(loads):
        patched = (i % 4) in (1, 2)  # A B B A | A B B A ...
        if patched:
            qkv_loader.apply(module)
        c0, t0 = time.process_time(), time.perf_counter()
        load_checkpoint(model, ckpt)
        t1, c1 = time.perf_counter(), time.process_time()
        if patched != _base.is_patched(qkv_loader, module):
            raise SystemExit(f"load {i}: patched={_base.is_patched(qkv_loader, module)}, expected {patched}")
        if patched:
            _base.revert(module)
        out.append({"patched": patched, "load_s": t1 - t0, "load_cpu_s": c1 - c0})
    print(json.dumps({"loads": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
