"""The MiniCPM-V 4.7 backport's shared test parts: the tiny checkpoints (dense, MoE), the requests the engine and
server tests send, and transformers' own answers for them (the reference: ``MiniCPMV4_7Processor`` for the prompt,
``MiniCPMV4_7ForConditionalGeneration`` in float32 for the first step's log-probabilities).

Items are seeded noise images (every pixel drawn), not one colour: a one-colour image moves these random tiny models
little, and the log-probability comparison must see the vision path.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from support import tiny_checkpoints

#: The prompt of the engine runs (the prompt tests' own).
PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"

#: name -> ((width, height), mm_processor_kwargs, image seed): the requests whose first-step log-probabilities are
#: compared with transformers' (every one's prompt must equal transformers' first). ``text`` has no image.
LOGPROB_REQUESTS: dict[str, tuple[tuple[int, int] | None, dict, int]] = {
    "text": (None, {}, 0),
    "449x448": ((449, 448), {}, 1),
    "640x480": ((640, 480), {}, 2),
    "300x200": ((300, 200), {}, 3),
    "640x480 slice_mode false": ((640, 480), {"slice_mode": False}, 4),
    "700x300 max_slice_nums 2": ((700, 300), {"max_slice_nums": 2}, 5),
}
#: The other seed each image request's reference is also computed with: how far another image of the same size moves
#: transformers' log-probabilities (the checkpoint's sensitivity, which the tolerance must stay below).
OTHER_SEED = 1000

#: Largest difference allowed between vLLM's first-step top-5 log-probabilities (bf16 engine) and transformers'
#: float32 model, per token of vLLM's top 5. Measured for the backport and for vLLM 0.32.0's own 4.7 classes on the
#: same checkpoints and requests (see tests/e2e/test_backport47.py's docstring); below every image request's
#: sensitivity.
LOGPROB_TOLERANCE = 0.035
#: A greedy token is compared with transformers' where transformers' top-2 margin is at least this.
CLEAR_MARGIN = 0.2


def noise_image(width: int, height: int, seed: int):
    """A ``width x height`` RGB image of seeded uniform noise (PIL)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng([width, height, seed])
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def write_checkpoint(dest: Path, *extra: str, member: str = "4.7") -> Path:
    """``scripts/make_tiny_checkpoint.py DEST --member MEMBER --scale-resolution 448 EXTRA...`` with this
    environment's transformers (the real processor geometry: patch 14, ``scale_resolution`` 448, ``max_slice_nums``
    9); ``member`` ``"ocr"`` for MiniCPM-OCR (transformers >= 5.24)."""
    return tiny_checkpoints.write(dest, "--member", member, "--scale-resolution", "448", *extra)


class Reference:
    """transformers' processor and float32 model of one checkpoint (``model_class``: the name of transformers'
    class, ``MiniCPMV4_7ForConditionalGeneration`` or ``MiniCPMOcrForConditionalGeneration``)."""

    def __init__(self, checkpoint: Path, model_class: str = "MiniCPMV4_7ForConditionalGeneration") -> None:
        import torch
        import transformers
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(checkpoint))
        model_cls = getattr(transformers, model_class)
        self.model = model_cls.from_pretrained(str(checkpoint), dtype=torch.float32).eval()

    def inputs(self, text: str, img: Any, kwargs: dict) -> Any:
        if img is None:
            return self.processor(text=[text], **kwargs)
        return self.processor(text=[text], images=[img], **kwargs)

    def ids(self, text: str, img: Any, kwargs: dict) -> list[int]:
        return self.inputs(text, img, kwargs)["input_ids"][0].tolist()

    def logprobs(self, text: str, img: Any, kwargs: dict) -> Any:
        """The first generated token's log-probabilities over the vocabulary (float32, 1-D)."""
        import torch

        batch = self.inputs(text, img, kwargs)
        batch.pop("image_sizes", None)
        with torch.no_grad():
            logits = self.model(**batch).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1)


def compare(got: dict[int, float], reference: Any) -> float:
    """The largest ``|vLLM - transformers|`` over vLLM's top tokens (``got``: token id -> log-probability)."""
    return max(abs(lp - float(reference[tok])) for tok, lp in got.items())


def judge_first_step(ref: "Reference", name: str, prompt: str, img: Any, kwargs: dict, got: dict[int, float],
                     greedy: int, tolerance: float) -> tuple[str, list[str]]:
    """One request's first step against transformers' float32 model: ``(a report row, problems)``. Problems: vLLM's
    top-5 log-probabilities (``got``: token id -> log-probability) differ from transformers' by more than
    ``tolerance``; another noise image of the same size (seed :data:`OTHER_SEED`) moves transformers' top 5 by no
    more than ``tolerance`` (the comparison could not see a wrong image); the greedy token differs from transformers'
    where its top-2 margin is at least :data:`CLEAR_MARGIN`."""
    want = ref.logprobs(prompt, img, kwargs)
    diff = compare(got, want)
    problems, sensitivity = [], None
    if img is not None:
        other = ref.logprobs(prompt, noise_image(*img.size, OTHER_SEED), kwargs)
        sensitivity = max(abs(float(other[t]) - float(want[t])) for t in want.topk(5).indices.tolist())
        if sensitivity <= tolerance:
            problems.append(f"{name}: another image moves transformers by {sensitivity:.3f}, not more than the "
                            f"tolerance {tolerance}: the tolerance could not see a wrong image")
    if diff > tolerance:
        problems.append(f"{name}: vLLM's top-5 log-probabilities differ by {diff:.3f} from transformers'")
    clear = margin(want) >= CLEAR_MARGIN
    if clear and greedy != int(want.argmax()):
        problems.append(f"{name}: greedy token {greedy}, transformers' {int(want.argmax())} (margin "
                        f"{margin(want):.3f})")
    row = (f"{name}: diff {diff:.3f}, sensitivity {'-' if sensitivity is None else round(sensitivity, 3)}, margin "
           f"{margin(want):.3f}{' (greedy compared)' if clear else ''}")
    return row, problems


def margin(reference: Any) -> float:
    """transformers' top-1 minus top-2 log-probability."""
    top = reference.topk(2).values
    return float(top[0] - top[1])


#: What vLLM's CPU fused-MoE fallback raises in an engine where it cannot run (see :func:`cpu_moe_unusable`).
CPU_MOE_ERROR = "Current vLLM config is not set"


def cpu_moe_unusable() -> str | None:
    """Why the installed vLLM's CPU fused-MoE layer cannot run a forward pass on this machine, or None where it can.

    vLLM 0.24's ``CPUFusedMOE`` (``model_executor/layers/fused_moe/cpu_fused_moe.py``) uses its grouped-GEMM kernel
    only where the CPU build has ``torch.ops._C.prepack_moe_weight`` (not in the AVX2 build this project's CPU
    machines load); otherwise ``forward_torch``, whose SiLU (``_CPU_MOE_ACT_FN``) constructs a ``SiluAndMul``
    CustomOp at every forward pass, where vLLM has no current config: ``AssertionError: Current vLLM config is not
    set``. Every MoE model dies on it at the engine's first (profiling) forward pass -- a property of vLLM and the
    machine, not of MiniCPM-V: shown here on vLLM's own function, outside any model."""
    try:
        import torch
        import vllm._custom_ops  # noqa: F401 - loads vLLM's CPU ops (torch.ops._C)
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.config import MoEActivation
    except ImportError:  # another layout (0.28+): its CPU MoE runs (the engine tests show it)
        return None
    if hasattr(torch.ops._C, "prepack_moe_weight") or not hasattr(cpu_fused_moe, "_CPU_MOE_ACT_FN"):
        return None
    try:
        cpu_fused_moe._CPU_MOE_ACT_FN[MoEActivation.SILU](torch.zeros(1, 2))
    except AssertionError as exc:
        return (f"vLLM's CPU fused MoE has no grouped-GEMM kernel here (no torch.ops._C.prepack_moe_weight) and its "
                f"torch fallback raises outside a config: {exc}")
    return None


# --------------------------------------------------------------------------------------------------------------------
# The load: every vLLM parameter against the checkpoint's tensors (the backports' load tests)
# --------------------------------------------------------------------------------------------------------------------

#: vLLM's prefix -> the checkpoint's (MiniCPMV4_6ForConditionalGeneration.hf_to_vllm_mapper, inverted).
PREFIXES = {"vit_merger.": "model.vision_tower.vit_merger.", "vpm.": "model.vision_tower.",
            "merger.": "model.merger.", "language_model.model.": "model.language_model.",
            "language_model.lm_head.": "lm_head."}
#: vLLM's fused parameter -> the checkpoint's parts, concatenated along dim 0 in this order (vLLM's stacked params).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"), "in_proj_ba": ("in_proj_b", "in_proj_a")}


def expected_tensor(name: str, ckpt: dict, tied: bool) -> tuple[Any, list[str]]:
    """The checkpoint's value of vLLM's parameter ``name`` and the checkpoint names it is made of. Raises
    ``KeyError`` for a parameter the checkpoint has nothing for."""
    import torch

    if name == "language_model.lm_head.weight" and tied:
        src = "model.language_model.embed_tokens.weight"
        return ckpt[src], [src]
    prefix = next(p for p in PREFIXES if name.startswith(p))
    hf = PREFIXES[prefix] + name[len(prefix):]
    stem, _, leaf = hf.rpartition(".")
    head, _, module = stem.rpartition(".")
    if leaf in ("w13_weight", "w2_weight"):  # FusedMoE: ``mlp.experts.`` (0.22) or ``mlp.experts.routed_experts.``
        stem = stem.removesuffix(".routed_experts")
        n = len({k.split(f"{stem}.")[1].split(".")[0] for k in ckpt if k.startswith(f"{stem}.")})
        parts = [[f"{stem}.{e}.{p}_proj.weight" for p in (("gate", "up") if leaf == "w13_weight" else ("down",))]
                 for e in range(n)]
        return torch.stack([torch.cat([ckpt[p] for p in ps]) for ps in parts]), [p for ps in parts for p in ps]
    if module in FUSED and hf not in ckpt:
        srcs = [f"{head}.{part}.{leaf}" for part in FUSED[module]]
        return torch.cat([ckpt[s] for s in srcs]), srcs
    return ckpt[hf], [hf]


def assert_every_parameter_equals(model: Any, ckpt: dict) -> tuple[dict, set, list]:
    """Every parameter of the vLLM ``model`` equals the checkpoint tensors it is made of (``torch.equal``; fused ones
    as vLLM fuses them: :func:`expected_tensor`), every parameter has checkpoint tensors and every checkpoint tensor
    (but ``mtp.*``) is used. Returns ``(parameters by name, checkpoint names used, names aliasing a parameter)``."""
    import torch

    used, wrong, unknown = set(), [], []
    params = dict(model.named_parameters())  # each tensor once, under its first name (vLLM's MoE layers alias some)
    ids = {id(t) for t in params.values()}
    aliases = [n for n, t in model.named_parameters(remove_duplicate=False) if n not in params]
    assert all(id(t) in ids for n, t in model.named_parameters(remove_duplicate=False)), aliases
    for name, param in params.items():
        try:
            want, srcs = expected_tensor(name, ckpt, False)
        except (KeyError, StopIteration):
            unknown.append(name)
            continue
        used.update(srcs)
        if want.shape != param.shape:  # a layout vLLM keeps differently (e.g. conv1d's (C, 1, K) as (C, K))
            if want.numel() != param.numel():
                wrong.append(f"{name}: shape {tuple(param.shape)} vs checkpoint {tuple(want.shape)}")
                continue
            want = want.reshape(param.shape)
        if not torch.equal(param.detach(), want.to(param.dtype)):
            wrong.append(f"{name} differs from {srcs}")
    assert not unknown, f"parameters with no checkpoint tensor: {unknown}"
    assert not wrong, wrong
    left = sorted(set(ckpt) - used - {k for k in ckpt if k.startswith("mtp.")})
    assert not left, f"checkpoint tensors no parameter holds: {left}"
    return params, used, aliases


# --------------------------------------------------------------------------------------------------------------------
# vLLM's registries around a backport (the backports' light tests)
# --------------------------------------------------------------------------------------------------------------------


def importable_package(folder: Path) -> str:
    """``folder`` holding only the package (a link to it), as a string for ``PYTHONPATH``: there it lets vLLM's
    registry-inspection subprocess (``python -m vllm.model_executor.models.registry``) import a backport's model
    module, as a pip install does, without activating anything."""
    from support.paths import REPO

    (folder / "vllm_minicpm_hotfix").symlink_to(REPO / "vllm_minicpm_hotfix")
    return str(folder)


@contextlib.contextmanager
def registered_as_the_hook_does(backport: Any, registry_module: Any, importable: str, monkeypatch: Any) -> Any:
    """A block with the backports registered as the hook registers them (``auto``; ``importable`` on ``PYTHONPATH``:
    :func:`importable_package`), yielding ``backport``'s status row; every backport unregistered after."""
    from support.environment import hotfix_mode_set
    from vllm_minicpm_hotfix import backports

    monkeypatch.setenv("PYTHONPATH", importable)
    forget_resolved()
    with hotfix_mode_set("auto"):
        rows = backports.run(registry_module)
        assert rows[backport.NAME].registered, rows
        try:
            yield rows[backport.NAME]
        finally:
            unregister_all(registry_module)
            forget_resolved()


def unregister_all(registry_module: Any) -> None:
    """Undo every backport the hook's ``backports.run`` registered (it runs them all)."""
    from vllm_minicpm_hotfix import backports

    for backport in backports.BACKPORTS:
        backport.unregister(registry_module)


def forget_resolved() -> None:
    """Empty vLLM's per-process memo of resolved model classes (``model_loader.utils._MODEL_ARCH_BY_HASH``, keyed
    by the checkpoint path): vLLM resolves a checkpoint once per process, after every registration; the tests
    resolve the same one with and without a backport."""
    from vllm.model_executor.model_loader import utils

    getattr(utils, "_MODEL_ARCH_BY_HASH", {}).clear()


def model_config(checkpoint: Path, **kwargs: Any) -> Any:
    """vLLM's ``ModelConfig`` of ``checkpoint`` (float32, eager): what ``LLM(...)`` and ``vllm serve`` build first."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(checkpoint), dtype="float32", enforce_eager=True, **kwargs)
