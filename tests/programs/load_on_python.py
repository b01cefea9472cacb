"""Runs in another Python (tests/activation/test_pythons.py): imports vLLM's model module (the route armed at start-up applies
the fix), loads the checkpoint ``argv[1]`` through vLLM's ``load_weights``, compares the vit_merger q/k/v with the
checkpoint's tensors, then reverts the fixes and loads stock; prints what happened."""

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch  # noqa: E402

import vllm.model_executor.models.minicpmv4_6 as m  # noqa: E402
import vllm_minicpm_hotfix as h  # noqa: E402
from vllm_minicpm_hotfix import _bootstrap  # noqa: E402
from vllm_minicpm_hotfix.cli.vllm_cpu import build_vllm_model, checkpoint_tensors, load_checkpoint  # noqa: E402
from vllm_minicpm_hotfix.fixes._base import revert  # noqa: E402

ckpt = sys.argv[1]
P = "model.vision_tower.vit_merger.self_attn."
t = checkpoint_tensors(ckpt)
model = build_vllm_model(ckpt, load=False)
loaded = sorted(load_checkpoint(model, ckpt))
attn = model.vit_merger.self_attn
exact = {s: bool(torch.equal(getattr(attn.qkv_proj, s).detach(),
                             torch.cat([t[f"{P}{p}_proj.{s}"] for p in "qkv"]).to(attn.qkv_proj.weight.dtype)))
         for s in ("weight", "bias")}
distinct = not torch.equal(t[P + "q_proj.weight"], t[P + "k_proj.weight"])
reverted = revert(m)
try:
    stock = build_vllm_model(ckpt, load=False)
    load_checkpoint(stock, ckpt)
    stock_error = None
except Exception as exc:
    stock_error = f"{type(exc).__name__}: {exc}"
w = sys.modules.get("wrapt")
print(json.dumps({"python": sys.version.split()[0], "pid": os.getpid(), "activations": _bootstrap.activations,
                  "package": h.__file__, "wrapt": getattr(w, "__file__", None), "exact": exact,
                  "distinct": distinct, "qkv_loaded": [n for n in loaded if "vit_merger.self_attn.qkv_proj" in n],
                  "reverted": reverted, "stock_error": stock_error}))
