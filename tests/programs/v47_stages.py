"""MiniCPM-V 4.7 on vLLM against transformers, stage by stage: where a dense or MoE checkpoint's image prompts part.

    python tests/programs/v47_stages.py run CKPT OUT_DIR [--prompts NAME,...] [--seeds 0,1] [--max-tokens 4]
    python tests/programs/v47_stages.py vllm CKPT CAPTURE.pt [--prompts ...] [--seeds ...] [--max-tokens 4]
    python tests/programs/v47_stages.py compare CKPT CAPTURE.pt REPORT.json [--prompts ...] [--seeds ...]

Run with the Python of an environment that has vLLM's ``minicpmv4_7`` (0.32.0: ``scripts/cpu-env 0.32.0``) and
``OMP_NUM_THREADS=1``. ``run`` = ``vllm`` in a fresh interpreter (one engine, the only heavy part: ~1.5 GB, 60-110 s
to start), then ``compare`` in this one; it writes ``OUT_DIR/capture.pt`` and ``OUT_DIR/report.json`` and prints
the summary table.

``vllm``: one offline engine (``LLM``, bf16 as the CPU GDN kernel requires, the engine core in this process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no prefix caching, one prefill per prompt). Hooks installed through
``LLM.apply_model`` record, for each prompt's prefill only: the pixel values and ``tgt_sizes``
``embed_multimodal`` receives and the per-image embeddings it returns; ``embed_input_ids``' merged embeddings; the
M-RoPE ``positions`` ``Qwen3_5Model.forward`` receives (``get_mrope_input_positions``' output); per decoder layer its
input (``hidden_states + residual``, vLLM's fused residual form), the token mixer's output (``linear_attn`` /
``self_attn``), the MLP's input and output (for MoE: also the router logits and the shared expert's gated output),
and its output; ``compute_logits``' row. Also the engine's own first-step top-20 logprobs and greedy tokens.

``compare``: transformers' ``MiniCPMV4_7ForConditionalGeneration`` from the same folder, in float32 and bfloat16,
on the same prompt ids (checked equal to vLLM's) and the processor's pixel values, with forward hooks at the same
points (``get_image_features``' ``pooler_output``, the text model's ``inputs_embeds`` and ``position_ids``, each
``layers[i]``, ``layers[i].mlp``, the mixer). Per stage it reports the relative RMS error
``rms(x - ref) / rms(ref)`` of vLLM's bf16 tensor against transformers' bf16 and float32 ones, next to the dtype's own
noise (transformers bf16 against transformers float32), and:

* teacher-forced stages: transformers' text tower run on vLLM's merged embeddings and vLLM's positions, and each
  decoder layer run on vLLM's own input to that layer (so a layer's error is its own, not inherited);
* the MoE block on vLLM's recorded MLP input against a plain torch reference written here (a per-expert loop over
  the checkpoint's ``experts.E.{gate,up,down}_proj``: softmax over the router logits in float32, top-k, the top-k
  weights renormalised, SiLU(gate) * up, down, weighted sum, plus sigmoid(shared_expert_gate) * shared expert), in
  float32 and in bf16 (inputs and weights rounded to bf16, as vLLM holds them);
* positions: vLLM's against transformers' ``get_rope_index`` (canvas M-RoPE), and the logprobs transformers gives
  with vLLM's positions instead of its own;
* logprobs: the first step's, as ``max |lp(t) - lp_ref(t)|`` over the union of both top-5s, vLLM against
  transformers float32 (the tests' reference); the same distance between the reference on image seed 0 and on seed 1
  of the same size (its sensitivity to the image); the reference's top-1/top-2 margin; greedy tokens.

Prompts (``--prompts``): ``text`` (no image) and ``WxH`` or ``WxH-noslice`` (``slice_mode: false``) with a seeded
RGB image (``--seeds``, default 0,1; ``--image``: :func:`make_image`'s kinds, default ``blocks``). The prompt is
the tests' ChatML one (tests/support/prompt.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"
DEFAULT_PROMPTS = ("text", "448x448", "640x480", "448x448-noslice", "300x900", "224x224")
TOP = 5


# --------------------------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------------------------
def parse_prompt(name: str) -> tuple[int, int, dict] | None:
    """``"text"`` -> None; ``"640x480"`` -> (640, 480, {}); ``"640x480-noslice"`` -> (640, 480,
    {"slice_mode": False})."""
    if name == "text":
        return None
    size, _, flag = name.partition("-")
    w, h = (int(v) for v in size.split("x"))
    kwargs = {"noslice": {"slice_mode": False}, "": {}}[flag]
    return w, h, kwargs


IMAGE_KINDS = ("blocks", "noise", "flat")


def make_image(width: int, height: int, seed: int, kind: str = "blocks"):
    """A seeded RGB image of ``width`` x ``height`` pixels.

    * ``blocks``: a 4 x 4 grid of random colours (nearest-neighbour upsampled): large areas, so another seed changes
      what most patches see, and a spatial mix-up (slice order, W/H) changes it too;
    * ``noise``: uniform noise per pixel: every seed has the same statistics, so a network that averages over many
      patches barely tells two seeds apart;
    * ``flat``: one colour.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([width, height, seed, IMAGE_KINDS.index(kind)])
    if kind == "noise":
        return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    grid = 1 if kind == "flat" else 4
    cells = rng.integers(0, 256, (grid, grid, 3), dtype=np.uint8)
    return Image.fromarray(cells, "RGB").resize((width, height), Image.NEAREST)


def cases(prompts: list[str], seeds: list[int]) -> list[tuple[str, str, int | None]]:
    """``(key, prompt name, image seed)``; text prompts run once."""
    out = []
    for p in prompts:
        if parse_prompt(p) is None:
            out.append((p, p, None))
        else:
            out += [(f"{p}@{s}", p, s) for s in seeds]
    return out


# --------------------------------------------------------------------------------------------------------------------
# vLLM side
# --------------------------------------------------------------------------------------------------------------------
CAP: dict = {}  # the current prompt's records (the hooks write here while ARMED)
ARMED = {"on": False}


def _f32(t):
    import torch

    return t.detach().to("cpu", torch.float32).clone()


def _store(key, value):
    if ARMED["on"] and key not in CAP:
        CAP[key] = value


def _leaves(x, ndim: int) -> list:
    """The tensors of rank ``ndim`` in a nested list/tuple/tensor (a higher-rank tensor is split along dim 0)."""
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _leaves(item, ndim)]
    if x.ndim > ndim:
        return [t for item in x for t in _leaves(item, ndim)]
    return [x]


def install_vllm_hooks(model) -> str:
    """Runs in the worker (this process): wrap ``embed_multimodal``/``embed_input_ids``/``compute_logits`` on the
    instance and register forward (pre-)hooks on the text tower."""
    lm = model.language_model.model

    orig_mm, orig_embed, orig_logits = model.embed_multimodal, model.embed_input_ids, model.compute_logits

    def embed_multimodal(**kwargs):
        out = orig_mm(**kwargs)
        if kwargs.get("pixel_values") is not None:
            _store("pixel_values", [_f32(p) for p in _leaves(kwargs["pixel_values"], 3)])
            _store("tgt_sizes", [_f32(t) for t in _leaves(kwargs["tgt_sizes"], 1)])
        _store("vision", [_f32(e) for e in out])
        return out

    def embed_input_ids(input_ids, multimodal_embeddings=None, **kw):
        out = orig_embed(input_ids, multimodal_embeddings, **kw)
        if multimodal_embeddings is not None and len(multimodal_embeddings):
            _store("merged", _f32(out))
        return out

    def compute_logits(hidden_states):
        out = orig_logits(hidden_states)
        _store("logits", _f32(out))
        return out

    model.embed_multimodal, model.embed_input_ids, model.compute_logits = embed_multimodal, embed_input_ids, \
        compute_logits

    def lm_pre(_mod, args, kwargs):
        pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
        emb = kwargs.get("inputs_embeds")
        _store("positions", pos.detach().to("cpu").clone())
        if emb is not None:
            _store("inputs_embeds", _f32(emb))
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            _store("input_ids", ids.detach().to("cpu").clone())

    lm.register_forward_pre_hook(lm_pre, with_kwargs=True)

    for i, layer in enumerate(lm.layers):
        def pre(_m, args, kwargs, i=i):
            h, r = kwargs.get("hidden_states"), kwargs.get("residual")
            _store(f"L{i}.in", _f32(h) if r is None else _f32(h) + _f32(r))
            if i == 0:  # Qwen3_5Model's own hooks never fire (support_torch_compile calls forward directly)
                _store("positions", kwargs["positions"].detach().to("cpu").clone())
                _store("inputs_embeds", _f32(h))

        def post(_m, _args, _kwargs, out, i=i):
            h, r = out
            _store(f"L{i}.out", _f32(h) + _f32(r))

        layer.register_forward_pre_hook(pre, with_kwargs=True)
        layer.register_forward_hook(post, with_kwargs=True)
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
        mixer.register_forward_hook(lambda _m, _a, out, i=i: _store(f"L{i}.mixer", _f32(
            out[0] if isinstance(out, tuple) else out)))
        mlp = layer.mlp

        def mlp_pre(_m, args, kwargs, i=i):
            x = kwargs.get("hidden_states", args[0] if args else None)
            _store(f"L{i}.mlp_in_raw", x.detach().to("cpu").clone())  # the exact bf16 input
            _store(f"L{i}.mlp_in", _f32(x))

        mlp.register_forward_pre_hook(mlp_pre, with_kwargs=True)
        mlp.register_forward_hook(lambda _m, _a, out, i=i: _store(f"L{i}.mlp_out", _f32(out)))
        if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
            mlp.gate.register_forward_hook(lambda _m, _a, out, i=i: _store(f"L{i}.router_logits", _f32(
                out[0] if isinstance(out, tuple) else out)))
            if getattr(mlp, "shared_expert", None) is not None:
                mlp.shared_expert.register_forward_hook(lambda _m, _a, out, i=i: _store(f"L{i}.shared_out", _f32(
                    out[0] if isinstance(out, tuple) else out)))
    return f"{type(model).__name__}: hooks on {len(lm.layers)} layers"


def run_vllm(ckpt: str, out_path: str, prompts: list[str], seeds: list[int], max_tokens: int,
             image_kind: str = "blocks") -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=ckpt, dtype="bfloat16", enforce_eager=True, max_model_len=2048, max_num_batched_tokens=2048,
              gpu_memory_utilization=0.1, mamba_ssm_cache_dtype="float32", limit_mm_per_prompt={"image": 1},
              max_num_seqs=1, enable_prefix_caching=False, seed=0)
    print(llm.apply_model(install_vllm_hooks), file=sys.stderr, flush=True)
    uses_canvas = llm.apply_model(lambda m: bool(getattr(m, "_uses_canvas_mrope", False)))[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=20, ignore_eos=True)
    results = {"_meta": {"uses_canvas_mrope": uses_canvas, "checkpoint": ckpt, "image": image_kind}}
    for key, name, seed in cases(prompts, seeds):
        spec = parse_prompt(name)
        if spec is None:
            req = {"prompt": PROMPT.format(mm="")}
        else:
            w, h, kw = spec
            req = {"prompt": PROMPT.format(mm="<|image_pad|>"),
                   "multi_modal_data": {"image": make_image(w, h, seed, image_kind)}}
            if kw:
                req["mm_processor_kwargs"] = kw
        CAP.clear()
        ARMED["on"] = True
        try:
            (out,) = llm.generate([req], params, use_tqdm=False)
        except Exception as exc:  # recorded: a prompt the stock engine refuses is part of what is measured
            ARMED["on"] = False
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
            print(f"{key}: {results[key]['error']}", file=sys.stderr, flush=True)
            continue
        ARMED["on"] = False
        comp = out.outputs[0]
        rec = dict(CAP)
        rec["prompt_token_ids"] = list(out.prompt_token_ids)
        rec["tokens"] = list(comp.token_ids)
        rec["engine_logprobs"] = [{int(t): float(v.logprob) for t, v in lp.items()} for lp in comp.logprobs]
        results[key] = rec
        print(f"{key}: {len(out.prompt_token_ids)} prompt tokens, greedy {rec['tokens']}", file=sys.stderr,
              flush=True)
    torch.save(results, out_path)


# --------------------------------------------------------------------------------------------------------------------
# Measures
# --------------------------------------------------------------------------------------------------------------------
def rel(x, ref) -> float:
    """rms(x - ref) / rms(ref), both taken in float64."""
    import torch

    x, ref = x.double(), ref.double()
    if x.shape != ref.shape:
        raise ValueError(f"shape {tuple(x.shape)} against {tuple(ref.shape)}")
    den = ref.pow(2).mean().sqrt().item()
    return float((x - ref).pow(2).mean().sqrt().item() / den) if den else float("nan")


def logprobs(logits_row):
    import torch

    return torch.log_softmax(logits_row.double().reshape(-1), dim=-1)


def top_dev(lp, ref, k: int = TOP) -> float:
    """max |lp(t) - ref(t)| over the union of both top-k token sets."""
    toks = set(ref.topk(k).indices.tolist()) | set(lp.topk(k).indices.tolist())
    return max(abs(float(lp[t] - ref[t])) for t in toks)


def margin(lp) -> float:
    v = lp.topk(2).values
    return float(v[0] - v[1])


# --------------------------------------------------------------------------------------------------------------------
# transformers side
# --------------------------------------------------------------------------------------------------------------------
class HF:
    """transformers' model in one dtype with capture hooks, and optional teacher forcing of the text tower."""

    def __init__(self, ckpt: str, dtype):
        import torch
        from transformers import MiniCPMV4_7ForConditionalGeneration

        self.dtype = dtype
        self.model = MiniCPMV4_7ForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).eval()
        self.text = self.model.model.language_model
        self.cap: dict = {}
        self.force: dict = {}  # layer index -> tensor fed as that layer's input instead of its real one
        self.force_lm: dict = {}  # "inputs_embeds"/"position_ids" -> replacement at the text model's entry
        t = self.text
        m = self.model.model
        orig = m.get_image_features

        def get_image_features(*a, **kw):
            out = orig(*a, **kw)
            po = out.pooler_output
            self.cap["vision"] = [x.detach().float().reshape(-1, x.shape[-1]).clone()
                                  for x in (po if isinstance(po, (list, tuple)) else [po])]
            self.cap["pixel_values"] = a[0].detach().float().clone() if a else kw["pixel_values"].detach().float()
            return out

        m.get_image_features = get_image_features

        def lm_pre(_m, args, kwargs):
            if "inputs_embeds" in self.force_lm:
                kwargs["inputs_embeds"] = self.force_lm["inputs_embeds"].to(self.dtype).reshape(
                    kwargs["inputs_embeds"].shape)
            if "position_ids" in self.force_lm:
                kwargs["position_ids"] = self.force_lm["position_ids"]
            self.cap["inputs_embeds"] = kwargs["inputs_embeds"].detach().float().reshape(
                -1, kwargs["inputs_embeds"].shape[-1]).clone()
            self.cap["position_ids"] = kwargs.get("position_ids")
            return args, kwargs

        t.register_forward_pre_hook(lm_pre, with_kwargs=True)
        for i, layer in enumerate(t.layers):
            def pre(_m, args, kwargs, i=i):
                h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
                if i in self.force:
                    h = self.force[i].to(h.dtype).reshape(h.shape)
                    if "hidden_states" in kwargs:
                        kwargs["hidden_states"] = h
                    else:
                        args = (h, *args[1:])
                self.cap[f"L{i}.in"] = h.detach().float().reshape(-1, h.shape[-1]).clone()
                return args, kwargs

            layer.register_forward_pre_hook(pre, with_kwargs=True)
            layer.register_forward_hook(lambda _m, _a, out, i=i: self._put(f"L{i}.out", out))
            mixer = getattr(layer, "linear_attn", None) or getattr(layer, "self_attn", None)
            mixer.register_forward_hook(lambda _m, _a, out, i=i: self._put(f"L{i}.mixer", out))
            layer.mlp.register_forward_pre_hook(lambda _m, a, i=i: self._put(f"L{i}.mlp_in", a[0]))
            layer.mlp.register_forward_hook(lambda _m, _a, out, i=i: self._put(f"L{i}.mlp_out", out))
        self.n_layers = len(t.layers)
        del torch

    def _put(self, key, out):
        x = out[0] if isinstance(out, tuple) else out
        self.cap[key] = x.detach().float().reshape(-1, x.shape[-1]).clone()

    def run(self, inputs: dict, force: dict | None = None, force_lm: dict | None = None) -> dict:
        import torch

        self.cap, self.force, self.force_lm = {}, dict(force or {}), dict(force_lm or {})
        kw = {k: v for k, v in inputs.items()}
        if "pixel_values" in kw:
            kw["pixel_values"] = kw["pixel_values"].to(self.dtype)
        with torch.no_grad():
            out = self.model(**kw, use_cache=False)
        self.cap["logits"] = out.logits[0, -1].detach().float().clone()
        self.force, self.force_lm = {}, {}
        return dict(self.cap)


def moe_reference(x, weights: dict, layer: int, n_experts: int, top_k: int, dtype):
    """The MoE block written out in plain torch: ``x`` ``(tokens, hidden)``; ``weights`` the checkpoint's tensors by
    name; every product in ``dtype`` (the router's softmax and the top-k renormalisation in float32, as
    transformers' ``Qwen3_5MoeTopKRouter`` does). Returns ``(output, router_logits, routed_part, shared_part)``."""
    import torch
    import torch.nn.functional as F

    p = f"model.language_model.layers.{layer}.mlp."
    w = {k[len(p):]: v.to(dtype) for k, v in weights.items() if k.startswith(p)}
    x = x.to(dtype)
    router_logits = x @ w["gate.weight"].T
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = (top_w / top_w.sum(-1, keepdim=True)).to(dtype)
    routed = torch.zeros_like(x)
    for e in range(n_experts):
        tok, slot = torch.where(top_i == e)
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = (F.silu(h @ w[f"experts.{e}.gate_proj.weight"].T) * (h @ w[f"experts.{e}.up_proj.weight"].T)) \
            @ w[f"experts.{e}.down_proj.weight"].T
        routed.index_add_(0, tok, (y * top_w[tok, slot, None]).to(dtype))
    shared = (F.silu(x @ w["shared_expert.gate_proj.weight"].T) * (x @ w["shared_expert.up_proj.weight"].T)) \
        @ w["shared_expert.down_proj.weight"].T
    shared = torch.sigmoid(x @ w["shared_expert_gate.weight"].T) * shared
    return routed + shared, router_logits, routed, shared


def greedy(hf: HF, inputs: dict, steps: int) -> tuple[list[int], list[float]]:
    """``steps`` greedy tokens and the top-1/top-2 logprob margin of each, each step a full forward pass over the
    prompt plus the tokens so far (no cache: the canvas positions of the prompt, then text positions after it, as
    ``get_rope_index`` lays out any sequence)."""
    import torch

    kw = dict(inputs)
    out: list[int] = []
    margins: list[float] = []
    for _ in range(steps):
        lp = logprobs(hf.run(kw)["logits"])
        t = int(lp.argmax())
        out.append(t)
        margins.append(margin(lp))
        one = torch.ones((1, 1), dtype=kw["input_ids"].dtype)
        kw["input_ids"] = torch.cat([kw["input_ids"], one * t], dim=1)
        kw["attention_mask"] = torch.cat([kw["attention_mask"], torch.ones_like(one)], dim=1)
        if "mm_token_type_ids" in kw:
            kw["mm_token_type_ids"] = torch.cat([kw["mm_token_type_ids"], torch.zeros_like(
                one, dtype=kw["mm_token_type_ids"].dtype)], dim=1)
    return out, margins


def hf_inputs(processor, name: str, seed: int | None, image_kind: str) -> dict:
    spec = parse_prompt(name)
    if spec is None:
        out = processor(text=[PROMPT.format(mm="")])
        return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}
    w, h, kw = spec
    out = processor(text=[PROMPT.format(mm=processor.image_token)], images=[make_image(w, h, seed, image_kind)],
                    **kw)
    keep = ("input_ids", "attention_mask", "pixel_values", "target_sizes", "mm_token_type_ids")
    return {k: out[k] for k in keep if k in out}


def compare(ckpt: str, capture_path: str, report_path: str, prompts: list[str], seeds: list[int]) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoProcessor

    cap = torch.load(capture_path, weights_only=False)
    meta = cap.get("_meta", {})
    processor = AutoProcessor.from_pretrained(ckpt)
    ckpt_w = load_file(str(Path(ckpt) / "model.safetensors"))
    cfg = json.loads((Path(ckpt) / "config.json").read_text())["text_config"]
    is_moe = cfg.get("model_type") == "qwen3_5_moe_text"
    hf32, hf16 = HF(ckpt, torch.float32), HF(ckpt, torch.bfloat16)
    n_layers = hf32.n_layers
    report: dict = {"checkpoint": ckpt, "moe": is_moe, "vllm_uses_canvas_mrope": meta.get("uses_canvas_mrope"),
                    "image": meta.get("image", "noise"), "cases": {}}
    ref_lp: dict = {}
    for key, name, seed in cases(prompts, seeds):
        v = cap.get(key)
        row: dict = {}
        report["cases"][key] = row
        if v is None or "error" in v:
            row["vllm_error"] = None if v is None else v["error"]
            continue
        inputs = hf_inputs(processor, name, seed, meta.get("image", "noise"))
        ids = inputs["input_ids"][0].tolist()
        row["prompt_tokens"] = len(ids)
        row["ids_equal"] = ids == v["prompt_token_ids"]
        if not row["ids_equal"]:
            continue
        r32, r16 = hf32.run(inputs), hf16.run(inputs)
        lp32, lp16, lpv = logprobs(r32["logits"]), logprobs(r16["logits"]), logprobs(v["logits"][-1])
        ref_lp[key] = lp32
        eng = v["engine_logprobs"][0]
        row["engine_vs_captured_logprobs"] = max(abs(eng[t] - float(lpv[t])) for t in eng)
        row["logprobs"] = {"vllm_vs_hf32": top_dev(lpv, lp32), "vllm_vs_hf16": top_dev(lpv, lp16),
                           "hf16_vs_hf32": top_dev(lp16, lp32)}
        row["margin_hf32"] = margin(lp32)
        row["top1"] = {"hf32": int(lp32.argmax()), "vllm": int(lpv.argmax())}
        stages: dict = {}
        if "pixel_values" in inputs:
            pv = torch.cat([p.reshape(3, p.shape[-2], -1) for p in v["pixel_values"]], dim=-1)
            hp = r32["pixel_values"]
            stages["pixel_values"] = ({"vllm_vs_hf": rel(pv, hp.reshape(pv.shape))} if hp.numel() == pv.numel()
                                      else {"shapes": [list(pv.shape), list(hp.shape)]})
            ve = torch.cat(v["vision"], dim=0)
            h32, h16 = torch.cat(r32["vision"], 0), torch.cat(r16["vision"], 0)
            stages["vision"] = {"vllm_vs_hf16": rel(ve, h16), "vllm_vs_hf32": rel(ve, h32),
                                "hf16_vs_hf32": rel(h16, h32), "tokens": int(ve.shape[0])}
            mv = v["merged"]
            stages["merged"] = {"vllm_vs_hf16": rel(mv, r16["inputs_embeds"]),
                                "vllm_vs_hf32": rel(mv, r32["inputs_embeds"]),
                                "hf16_vs_hf32": rel(r16["inputs_embeds"], r32["inputs_embeds"])}
        # positions: vLLM's (3, S) against transformers' (3, 1, S) canvas positions
        vpos = v["positions"].reshape(3, -1) if v["positions"].ndim == 2 else v["positions"].expand(3, -1)
        hpos = r32["position_ids"]
        hpos = torch.arange(len(ids)).expand(3, -1) if hpos is None else hpos.reshape(-1, len(ids))[-3:]
        stages["positions"] = {"equal": bool(torch.equal(vpos, hpos)), "differ": int((vpos != hpos).sum()),
                               "vllm_max": int(vpos.max()), "hf_max": int(hpos.max())}
        for i in range(n_layers):
            for part in ("mixer", "mlp_in", "mlp_out", "out"):
                k = f"L{i}.{part}"
                stages[k] = {"vllm_vs_hf16": rel(v[k], r16[k]), "vllm_vs_hf32": rel(v[k], r32[k]),
                             "hf16_vs_hf32": rel(r16[k], r32[k])}
        # teacher forcing 1: transformers' text tower on vLLM's merged embeddings and vLLM's positions
        emb = v.get("merged", v.get("inputs_embeds"))
        forced_lm = {"position_ids": vpos.unsqueeze(1).clone()}
        if emb is not None:
            forced_lm["inputs_embeds"] = emb.unsqueeze(0)
        f32, f16 = hf32.run(inputs, force_lm=forced_lm), hf16.run(inputs, force_lm=forced_lm)
        lpf32, lpf16 = logprobs(f32["logits"]), logprobs(f16["logits"])
        row["logprobs"]["vllm_vs_hf32_on_vllm_inputs"] = top_dev(lpv, lpf32)
        row["logprobs"]["vllm_vs_hf16_on_vllm_inputs"] = top_dev(lpv, lpf16)
        row["logprobs"]["hf32_vllm_positions_vs_hf32"] = top_dev(
            logprobs(hf32.run(inputs, force_lm={"position_ids": vpos.unsqueeze(1).clone()})["logits"]), lp32)
        # teacher forcing 2: each layer on vLLM's own input to it (its local error)
        local: dict = {}
        for i in range(n_layers):
            g32 = hf32.run(inputs, force={i: v[f"L{i}.in"].unsqueeze(0)}, force_lm=forced_lm)
            g16 = hf16.run(inputs, force={i: v[f"L{i}.in"].unsqueeze(0)}, force_lm=forced_lm)
            for part in ("mixer", "out"):
                k = f"L{i}.{part}"
                local[k] = {"vllm_vs_hf16": rel(v[k], g16[k]), "vllm_vs_hf32": rel(v[k], g32[k]),
                            "hf16_vs_hf32": rel(g16[k], g32[k])}
        stages["local"] = local
        # the MLP / MoE block on vLLM's exact input
        moe: dict = {}
        for i in range(n_layers):
            x = v[f"L{i}.mlp_in_raw"]
            y = v[f"L{i}.mlp_out"]
            mlp32 = hf32.model.model.language_model.layers[i].mlp
            mlp16 = hf16.model.model.language_model.layers[i].mlp
            with torch.no_grad():
                t32 = mlp32(x.float().unsqueeze(0))
                t16 = mlp16(x.to(torch.bfloat16).unsqueeze(0))
            t32 = (t32[0] if isinstance(t32, tuple) else t32).reshape(y.shape).float()
            t16 = (t16[0] if isinstance(t16, tuple) else t16).reshape(y.shape).float()
            entry = {"vllm_vs_hf16": rel(y, t16), "vllm_vs_hf32": rel(y, t32), "hf16_vs_hf32": rel(t16, t32)}
            if is_moe:
                n_e, k_e = cfg["num_experts"], cfg["num_experts_per_tok"]
                o32, rl32, routed32, shared32 = moe_reference(x.float(), ckpt_w, i, n_e, k_e, torch.float32)
                o16, rl16, _, _ = moe_reference(x.float(), ckpt_w, i, n_e, k_e, torch.bfloat16)
                entry.update(vllm_vs_torch32=rel(y, o32), vllm_vs_torch16=rel(y, o16.float()),
                             torch16_vs_torch32=rel(o16.float(), o32), hf32_vs_torch32=rel(t32, o32))
                if f"L{i}.router_logits" in v:
                    entry["router_logits_vllm_vs_torch32"] = rel(v[f"L{i}.router_logits"], rl32)
                    sel_v = v[f"L{i}.router_logits"].topk(k_e, -1).indices.sort(-1).values
                    sel_t = rl32.topk(k_e, -1).indices.sort(-1).values
                    entry["selection_differs_tokens"] = int((sel_v != sel_t).any(-1).sum())
                    srt = torch.softmax(rl32, -1).sort(-1, descending=True).values
                    entry["min_gap_kth"] = float((srt[:, k_e - 1] - srt[:, k_e]).min())
                if f"L{i}.shared_out" in v:
                    entry["shared_vllm_vs_torch32"] = rel(v[f"L{i}.shared_out"], shared32)
                    entry["routed_vllm_vs_torch32"] = rel(y - v[f"L{i}.shared_out"], routed32)
                entry["rms"] = {"routed": float(routed32.pow(2).mean().sqrt()),
                                "shared": float(shared32.pow(2).mean().sqrt()),
                                "input": float(x.float().pow(2).mean().sqrt())}
            moe[f"L{i}"] = entry
        stages["mlp_block"] = moe
        row["stages"] = stages
        toks, margins = greedy(hf32, inputs, len(v["tokens"]))
        first = next((j for j, (a, b) in enumerate(zip(v["tokens"], toks)) if a != b), None)
        row["greedy"] = {"vllm": v["tokens"], "hf32": toks, "hf32_margins": margins, "first_difference": first,
                         "margin_there": None if first is None else margins[first]}
    # sensitivity: the reference on seed s against seed 0 of the same prompt
    for key, name, seed in cases(prompts, seeds):
        if seed is None or seed == seeds[0] or key not in ref_lp:
            continue
        base = f"{name}@{seeds[0]}"
        if base in ref_lp:
            report["cases"][base].setdefault("sensitivity", {})[str(seed)] = top_dev(ref_lp[key], ref_lp[base])
            report["cases"][key].setdefault("sensitivity", {})[str(seeds[0])] = top_dev(ref_lp[key], ref_lp[base])
    Path(report_path).write_text(json.dumps(report, indent=1))
    return report


def summary(report: dict) -> str:
    lines = [f"{report['checkpoint']}  moe={report['moe']}  vLLM canvas M-RoPE={report['vllm_uses_canvas_mrope']}  "
             f"images={report.get('image')}",
             f"{'case':22} {'tok':>4} {'v-hf32':>7} {'v-hf16':>7} {'16-32':>6} {'v-hf32|vin':>10} {'pos->':>6} "
             f"{'sens':>6} {'margin':>6} {'vision v16/h16-32':>18} {'L1out v16/h16-32':>17} greedy v | hf"]
    for key, row in report["cases"].items():
        if "logprobs" not in row:
            lines.append(f"{key:22} {row.get('vllm_error') or 'ids differ'}")
            continue
        lp, st = row["logprobs"], row["stages"]
        vis = st.get("vision")
        vis_s = f"{vis['vllm_vs_hf16']:.4f}/{vis['hf16_vs_hf32']:.4f}" if vis else "-"
        last = f"L{max(int(k[1]) for k in st if k.startswith('L') and k[1].isdigit())}.out"
        lo = st[last]
        sens = max(row.get("sensitivity", {}).values(), default=float("nan"))
        lines.append(
            f"{key:22} {row['prompt_tokens']:4} {lp['vllm_vs_hf32']:7.3f} {lp['vllm_vs_hf16']:7.3f} "
            f"{lp['hf16_vs_hf32']:6.3f} {lp['vllm_vs_hf32_on_vllm_inputs']:10.3f} "
            f"{lp['hf32_vllm_positions_vs_hf32']:6.3f} {sens:6.3f} {row['margin_hf32']:6.3f} {vis_s:>18} "
            f"{lo['vllm_vs_hf16']:.4f}/{lo['hf16_vs_hf32']:.4f} {row['greedy']['vllm']} | {row['greedy']['hf32']}"
            + ("" if row["greedy"]["first_difference"] is None else
               f" (step {row['greedy']['first_difference'] + 1}, hf margin {row['greedy']['margin_there']:.3f})"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("run", "vllm", "compare"))
    ap.add_argument("checkpoint")
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--prompts", default=",".join(DEFAULT_PROMPTS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--image", choices=IMAGE_KINDS, default="blocks", help="the kind of seeded image (make_image)")
    a = ap.parse_args(argv)
    prompts, seeds = a.prompts.split(","), [int(s) for s in a.seeds.split(",")]
    if a.mode == "vllm":
        run_vllm(a.checkpoint, a.paths[0], prompts, seeds, a.max_tokens, a.image)
        return 0
    if a.mode == "compare":
        print(summary(compare(a.checkpoint, a.paths[0], a.paths[1], prompts, seeds)))
        return 0
    out = Path(a.paths[0])
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "vllm", a.checkpoint, str(out / "capture.pt"), "--prompts", a.prompts,
                    "--seeds", a.seeds, "--max-tokens", str(a.max_tokens), "--image", a.image], check=True)
    print(summary(compare(a.checkpoint, str(out / "capture.pt"), str(out / "report.json"), prompts, seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
