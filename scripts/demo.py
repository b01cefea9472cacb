"""Demo body, run by scripts/demo inside a vLLM CPU environment. See scripts/demo."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

PREFIX = "model.vision_tower.vit_merger.self_attn."


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="minicpm-demo-"))
    ckpt = workdir / "tiny-minicpm-v46"
    step(f"writing the tiny MiniCPM-V 4.6 checkpoint with transformers' save_pretrained -> {ckpt}")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), str(ckpt)], check=True)
    bundled = REPO / "vllm_minicpm_hotfix" / "data" / "tiny-minicpm-v46" / "model.safetensors"
    digest = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    same = digest == hashlib.sha256(bundled.read_bytes()).hexdigest()
    print(f"model.safetensors sha256 {digest[:16]}... ({'identical to' if same else 'DIFFERS from'} the bundled copy)")

    t0 = time.time()
    import vllm

    from vllm_minicpm_hotfix.vllm_cpu import build_vllm_model, checkpoint_tensors, load_checkpoint

    print(f"vLLM {vllm.__version__} imported in {time.time() - t0:.0f} s")

    step("stock vLLM: build MiniCPMV4_6ForConditionalGeneration on CPU, load the checkpoint with its own load_weights")
    model = build_vllm_model(ckpt, load=False)
    try:
        load_checkpoint(model, ckpt)
        print("stock vLLM loaded it (this release is not broken)")
    except ValueError as exc:
        print(f"stock vLLM FAILED, as users saw it:\n  ValueError: {str(exc)[:200]}...")

    step("with the hotfix: vllm_minicpm_hotfix.install()")
    import vllm_minicpm_hotfix

    vllm_minicpm_hotfix.install()
    fix = vllm_minicpm_hotfix.status()["fixes"]["qkv_loader"]
    print(f"verdict: {fix['verdict']}; applied: {fix['applied']}\n  {fix['why'][:160]}")
    model = build_vllm_model(ckpt, load=False)
    load_checkpoint(model, ckpt)
    print("loaded.")

    step("check: vLLM's tensors against the checkpoint (torch.equal)")
    t = checkpoint_tensors(ckpt)
    attn = model.vit_merger.self_attn
    rows = []
    for suffix in ("weight", "bias"):
        want = torch.cat([t[f"{PREFIX}{p}_proj.{suffix}"] for p in "qkv"])
        rows.append((f"vit_merger.self_attn.qkv_proj.{suffix}", "cat(q, k, v)", getattr(attn.qkv_proj, suffix), want))
    for suffix in ("weight", "bias"):
        rows.append((f"vit_merger.self_attn.out_proj.{suffix}", "out_proj", getattr(attn.out_proj, suffix),
                     t[f"{PREFIX}out_proj.{suffix}"]))
    ok = True
    print(f"{'vLLM parameter':42} {'checkpoint':13} {'shape':12} {'dtype':14} result")
    for name, src, got, want in rows:
        equal = torch.equal(got.detach(), want)
        ok &= equal
        print(f"{name:42} {src:13} {str(list(got.shape)):12} {str(got.dtype):14} {'EXACT' if equal else 'MISMATCH'}")
    print("\nPASS: the hotfix loads MiniCPM-V 4.6 bit-exact" if ok else "\nFAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
