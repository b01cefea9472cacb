#!/usr/bin/env python
"""Measure stock vLLM's own MiniCPM-OCR classes against transformers' ``MiniCPMOcrProcessor`` (prompt ids) and the
checkpoint's tensors (the window-merger / vision load), with no hotfix anywhere in the process.

    python scripts/measure_ocr_stock.py CHECKPOINT [--hotfix] [--json OUT]

Run with an interpreter whose vLLM registers ``MiniCPMOcrForConditionalGeneration`` (0.33) and whose transformers
has ``minicpm_ocr`` (>= 5.24; vLLM 0.33 pins < 5.21, so this is transformers forced past vLLM's pin: what a user who
upgrades transformers to read an OCR checkpoint gets). ``CHECKPOINT`` is one ``scripts/make_tiny_checkpoint.py
--member ocr --scale-resolution 448`` wrote. Prints one line per case and a summary; ``--json`` writes every case.

What it compares, per image size of tests/support/prompt.py's seeded sweep and per request kwarg (none,
``max_slice_nums``, ``slice_mode``, ``scale_resolution``, ``downsample_mode``, ``use_image_id``): vLLM's processor
(``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...)).apply``, as its renderer calls it) against transformers'
processor on the same prompt text. (The load is ``vllm-minicpm-hotfix verify --model CHECKPOINT`` with
``VLLM_MINICPM_HOTFIX=off``.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

KWARGS = [{}, {"max_slice_nums": 1}, {"max_slice_nums": 4}, {"slice_mode": False}, {"scale_resolution": 224},
          {"downsample_mode": "16x"}, {"downsample_mode": "4x"}, {"use_image_id": False}]


def prompts(ckpt: Path, limit: int | None = None) -> list[dict]:
    from support.prompt import hf_ids, image, make_pair, seeded_sizes, vllm_ids

    pair = make_pair(ckpt, {})
    rows = []
    for kwargs in KWARGS:
        for kind, w, h in seeded_sizes()[:limit]:
            row = {"kwargs": kwargs, "size": [w, h], "kind": kind}
            items = [image(w, h)]
            try:
                want = hf_ids(pair, "image", items, kwargs)
            except Exception as exc:  # noqa: BLE001 - transformers refuses the case too: not compared
                row["hf_error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                continue
            try:
                got = vllm_ids(pair, "image", items, kwargs)
                row["equal"] = got == want
                if not row["equal"]:
                    pad = pair.tokenizer.convert_tokens_to_ids("<|image_pad|>")
                    row["pads"] = [got.count(pad), want.count(pad)]
                    row["len"] = [len(got), len(want)]
            except Exception as exc:  # noqa: BLE001 - stock's own error is the finding
                row["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--hotfix", action="store_true", help="install this repository's hotfix first")
    ap.add_argument("--limit", type=int, default=None, help="only the first N sizes of the sweep (44)")
    args = ap.parse_args(argv)
    if args.hotfix:
        sys.path.insert(0, str(REPO))
        import vllm_minicpm_hotfix

        vllm_minicpm_hotfix.install()
    import transformers
    import vllm

    print(f"vLLM {vllm.__version__}, transformers {transformers.__version__}, "
          f"{'hotfix installed' if args.hotfix else 'no hotfix'}")
    result = {"vllm": vllm.__version__, "transformers": transformers.__version__, "hotfix": args.hotfix}
    try:
        result["prompts"] = prompts(args.checkpoint, args.limit)
    except Exception:  # noqa: BLE001
        result["prompts_error"] = traceback.format_exc()[-2000:]
        print(result["prompts_error"])
    rows = result.get("prompts", [])
    for kw in KWARGS:
        mine = [r for r in rows if r["kwargs"] == kw]
        eq = sum(bool(r.get("equal")) for r in mine)
        err = [r for r in mine if "vllm_error" in r]
        ne = [r for r in mine if r.get("equal") is False]
        print(f"kwargs {json.dumps(kw)}: {len(mine)} sizes, equal {eq}, different {len(ne)}, vLLM error {len(err)}, "
              f"transformers refused {sum('hf_error' in r for r in mine)}")
        for r in (ne + err)[:4]:
            print(f"   {r['kind']} {r['size']}: {r.get('vllm_error') or ('pads vLLM/transformers ' + str(r['pads']))}")
    if args.hotfix:
        import vllm_minicpm_hotfix

        result["status"] = vllm_minicpm_hotfix.status()
        print("hotfix applied:", [n for n, f in (result["status"].get("fixes") or {}).items() if f.get("applied")])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
