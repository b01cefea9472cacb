"""The MiniCPM-V 4.7 backport's shared test parts: the tiny checkpoints (dense, MoE), the requests the engine and
server tests send, and transformers' own answers for them (the reference: ``MiniCPMV4_7Processor`` for the prompt,
``MiniCPMV4_7ForConditionalGeneration`` in float32 for the first step's log-probabilities).

Items are seeded noise images (every pixel drawn), not one colour: a one-colour image moves these random tiny models
little, and the log-probability comparison must see the vision path.
"""

from __future__ import annotations

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
    """transformers' 4.7 processor and float32 model of one checkpoint."""

    def __init__(self, checkpoint: Path) -> None:
        import torch
        from transformers import AutoProcessor, MiniCPMV4_7ForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(str(checkpoint))
        self.model = MiniCPMV4_7ForConditionalGeneration.from_pretrained(str(checkpoint), dtype=torch.float32).eval()

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
