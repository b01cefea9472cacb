#!/usr/bin/env python
"""One full-size load measurement, in this (fresh) process; prints one JSON line. Run by benchmarks/bench.py.

    VLLM_MINICPM_HOTFIX=auto|force python benchmarks/load_one.py CHECKPOINT_DIR

Builds vLLM's ``MiniCPMV4_6ForConditionalGeneration`` on CPU in bf16 (``build_vllm_model(dir, dtype="bfloat16",
load=False)``) after ``vllm_minicpm_hotfix.install()`` (in both modes, so both processes carry the same hook and
probe; ``auto`` on a release whose own loading is correct leaves vLLM unpatched, ``force`` patches), then times
``load_checkpoint`` -- ``model.load_weights`` over the safetensors iterator, the call vLLM's DefaultModelLoader makes.

Memory: ``ru_maxrss`` of the process (its whole-life peak), and around the load ``VmRSS`` before, ``VmHWM`` (peak)
after -- the kernel's peak is reset just before the load by writing ``5`` to ``/proc/self/clear_refs`` so it covers
the load only -- and ``VmRSS`` after, with its anonymous / file-backed split (mapped checkpoint pages count in RSS while mapped).
After the figures are taken it checks
that the vit_merger ``qkv_proj`` equals ``cat(q, k, v)`` of the checkpoint, so a fast but wrong load cannot pass.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> int:
    ckpt = Path(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    mode = os.environ.get("VLLM_MINICPM_HOTFIX", "auto")
    sys.path.insert(0, str(REPO))
    t_start = time.perf_counter()

    import torch

    import vllm_minicpm_hotfix
    from vllm_minicpm_hotfix.checkpoint import weight_files
    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, load_checkpoint

    vllm_minicpm_hotfix.install()
    model = build_vllm_model(ckpt, dtype="bfloat16", load=False)
    t_built = time.perf_counter()
    fix = vllm_minicpm_hotfix.status()["fixes"].get("qkv_loader") or {}

    gc.collect()
    before = proc_status()
    peak_reset = reset_peak()
    c0, t0 = time.process_time(), time.perf_counter()
    loaded = load_checkpoint(model, ckpt)
    t1, c1 = time.perf_counter(), time.process_time()
    after = proc_status()
    ru_maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    # Correctness, after the figures: the fused q/k/v equals the checkpoint's split tensors.
    from safetensors import safe_open

    attn = model.vit_merger.self_attn
    exact = True
    prefix = "model.vision_tower.vit_merger.self_attn."
    with safe_open(str(weight_files(ckpt)[0][0]), framework="pt") as sf:
        for suffix in ("weight", "bias"):
            want = torch.cat([sf.get_tensor(f"{prefix}{p}_proj.{suffix}") for p in "qkv"])
            exact &= bool(torch.equal(getattr(attn.qkv_proj, suffix).detach(), want.to(torch.bfloat16)))

    print(json.dumps({
        "mode": mode,
        "patched": bool(fix.get("applied")),
        "verdict": fix.get("verdict"),
        "exact": exact,
        "n_loaded": len(loaded) if loaded is not None else None,
        "load_s": t1 - t0,
        "load_cpu_s": c1 - c0,  # all threads of the process
        "build_s": t_built - t_start,
        "ru_maxrss_mib": ru_maxrss_kib / 1024,
        "rss_before_mib": before["VmRSS"] / 1024,
        "rss_after_mib": after["VmRSS"] / 1024,
        "load_peak_mib": after["VmHWM"] / 1024 if peak_reset else None,
        "load_peak_increase_mib": (after["VmHWM"] - before["VmRSS"]) / 1024 if peak_reset else None,
        "rss_increase_mib": (after["VmRSS"] - before["VmRSS"]) / 1024,
        "anon_increase_mib": (after["RssAnon"] - before["RssAnon"]) / 1024,
        "file_increase_mib": (after["RssFile"] - before["RssFile"]) / 1024,
        "peak_reset": peak_reset,
        "torch_threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
