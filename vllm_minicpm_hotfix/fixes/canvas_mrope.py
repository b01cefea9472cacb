"""MiniCPM-V 4.7's canvas M-RoPE positions for a checkpoint whose config transformers wrote.

What breaks
-----------
MiniCPM-V 4.7 places an image's tokens on a 2-D canvas (rows and columns of the thumbnail and of its slices) in its
M-RoPE positions: transformers' ``MiniCPMV4_7Model.get_rope_index`` always does so for an image or video. vLLM
0.32-0.33's ``MiniCPMV4_7ForConditionalGeneration._init_canvas_mrope`` (``vllm/model_executor/models/
minicpmv4_7.py``, the same in both) turns the canvas on only where the config says ``uses_mrope_canvas`` or names an
``mrope_mode`` containing ``"canvas"``; transformers' ``MiniCPMV4_7Config`` (5.19-5.24) has neither field. A
checkpoint written by ``save_pretrained`` is then served with sequential positions: on a 448x448 prompt 242 of 267
position entries differ from transformers', the first full-attention layer differs from transformers' bf16 by 0.10
against a bf16 noise of 0.009, and the first step's logprobs by up to 0.16 (dense and 35B-A3B MoE alike: measured
stage by stage in docs/moe.md; every other stage, the MoE block included, agrees within its dtype's noise).

What the fix does
-----------------
It wraps ``_init_canvas_mrope`` on vLLM's 4.7 model class (set when vLLM imports ``minicpmv4_7``): after vLLM's own,
a config that states neither field (``uses_mrope_canvas`` absent, ``mrope_mode`` absent or None) and carries the five
ids transformers' config requires for images (``image_start_id``, ``image_end_id``, ``slice_start_id``,
``slice_end_id``, ``newline_id``) gets the canvas, as transformers' model lays it out: ``_uses_canvas_mrope`` true and
``_canvas_special_ids`` as vLLM's own code sets them for a canvas config. A config that states a mode keeps vLLM's
reading of it. vLLM's ``get_mrope_input_positions`` then computes the positions itself.

The decision
------------
:func:`probe` runs the installed ``get_mrope_input_positions`` on a stand-in of the member's model class (made
without ``__init__``, no weights; its canvas state set by the class's ``_init_canvas_mrope`` as it now stands, from a
transformers ``MiniCPMV4_7Config`` without ``mrope_mode``) for two one-image prompts (a thumbnail alone, a thumbnail
with 2 x 2 slices) and compares each with :func:`reference_positions`, the layout rules of transformers'
``get_rope_index`` in plain torch (pinned equal to transformers' own by tests/fixes/test_canvas_mrope.py):
``broken`` where a position differs (stock 0.32-0.33), ``correct`` where all are equal; ``correct`` and not
applicable for a model class without canvas M-RoPE (4.6; the hotfix's own 4.7 backport computes transformers'
positions itself); ``undetermined`` where the stand-in cannot run.

Upstream
--------
none known.

Remove when
-----------
its probe sees stock ``get_mrope_input_positions`` of vLLM's own ``MiniCPMV4_7ForConditionalGeneration`` give
transformers' canvas positions, for a config without ``mrope_mode``, on every release the hotfix supports that has
vLLM's own 4.7 (0.32-0.34 differ).
"""

from __future__ import annotations

import types
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import MODEL_CLASS, V47, V47_MODEL_CLASS, V47_MODULE, on_import, wrap

NAME = "canvas_mrope"
LABEL = "MiniCPM-V 4.7 canvas M-RoPE positions (transformers' layout)"
MODELS = (V47,)

#: vLLM's names of the five ids -> transformers' config fields.
SPECIAL_IDS = {"im_start_id": "image_start_id", "im_end_id": "image_end_id", "slice_start_id": "slice_start_id",
               "slice_end_id": "slice_end_id", "newline_id": "newline_id"}


def canvas_like_transformers(model: Any) -> bool:
    """Turn canvas M-RoPE on for ``model`` (vLLM's 4.7 model after its own ``_init_canvas_mrope``) where its config
    states no M-RoPE mode and carries the five ids (see the module docstring). Returns whether it turned it on."""
    if getattr(model, "_uses_canvas_mrope", False):
        return False
    config = model.config
    if getattr(config, "uses_mrope_canvas", None) is not None or getattr(config, "mrope_mode", None) is not None:
        return False  # the config says what it wants; vLLM has read it
    ids = {ours: getattr(config, theirs, None) for ours, theirs in SPECIAL_IDS.items()}
    if any(v is None for v in ids.values()):
        return False  # transformers' config requires them for images: without them there is no canvas to lay out
    model._uses_canvas_mrope = True
    model._canvas_special_ids = {k: int(v) for k, v in ids.items()}
    return True


def init_canvas_mrope(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """Around ``MiniCPMV4_7ForConditionalGeneration._init_canvas_mrope(self, vllm_config) -> None``: vLLM's own, then
    :func:`canvas_like_transformers`."""
    wrapped(*args, **kwargs)
    canvas_like_transformers(instance)


PATCHES = {f"{V47_MODULE}:{V47_MODEL_CLASS}._init_canvas_mrope":
           on_import(lambda old, _: wrap(init_canvas_mrope) if callable(old) else None)}


# --------------------------------------------------------------------------------------------------------------------
# The decision: the installed positions against transformers' layout rules
# --------------------------------------------------------------------------------------------------------------------

#: The probe's ids (a ``MiniCPMV4_7Config`` accepts any) and its merge: "16x", 4 x 4 patches per token.
PROBE_IDS = {"image_start_id": 250, "image_end_id": 251, "slice_start_id": 252, "slice_end_id": 253, "newline_id": 10}
PAD, MERGE = 249, 4


def probe_prompt(rows: int, cols: int) -> tuple[list[int], list[list[int]]]:
    """``(ids, target_sizes)`` of a one-image prompt: 3 text ids, ``<image>`` + a 4 x 4-token thumbnail +
    ``</image>``, ``rows`` x ``cols`` slices of 4 x 4 tokens (``<slice>...</slice>``, a newline after each row), 4
    text ids; target sizes in patches (16 x 16 each)."""
    ids = [20, 21, 22, PROBE_IDS["image_start_id"], *[PAD] * 16, PROBE_IDS["image_end_id"]]
    for _ in range(rows):
        for _ in range(cols):
            ids += [PROBE_IDS["slice_start_id"], *[PAD] * 16, PROBE_IDS["slice_end_id"]]
        ids.append(PROBE_IDS["newline_id"])
    return ids + [40, 41, 42, 43], [[16, 16]] * (1 + rows * cols)


def reference_positions(ids: list[int], target_sizes: list[list[int]]) -> Any:
    """``(3, len(ids))`` positions (T, H, W) of a prompt with one image, by the rules of transformers'
    ``MiniCPMV4_7Model.get_rope_index`` for one frame: text before counts up; the frame (its markers included) sits
    at one origin, the thumbnail spread over the canvas's height and width, each slice at its row and column, a row's
    newline past its right edge; text after continues from ``origin + max(H, W) + 1``."""
    import torch

    n = len(ids)
    pos = torch.zeros(3, n, dtype=torch.long)
    markers = set(PROBE_IDS.values())
    crops, i = [], 0
    while i < n:  # maximal runs of pads: the thumbnail first, then the slices
        if ids[i] == PAD:
            j = i
            while j < n and ids[j] == PAD:
                j += 1
            crops.append((i, j))
            i = j
        else:
            i += 1
    (ts, te), slices = crops[0], crops[1:]
    start, end = ts - 1, slices[-1][1] if slices else te
    while end < n and ids[end] in markers:  # the frame takes the markers (newlines included) that close it
        end += 1
    pos[:, :start] = torch.arange(start)
    origin = start
    th, tw = target_sizes[0][0] // MERGE, target_sizes[0][1] // MERGE
    cols = next((k + 1 for k in range(len(slices) - 1) if slices[k + 1][0] - slices[k][1] > 2), len(slices))
    rows = len(slices) // cols if slices else 0
    sh, sw = (target_sizes[1][0] // MERGE, target_sizes[1][1] // MERGE) if slices else (0, 0)
    height, width = (rows * sh, cols * sw) if slices else (th, tw)
    pos[:, start:end] = origin
    pos[1:, start] = max(origin - 1, 0)
    if te < end:
        pos[1, te], pos[2, te] = origin + height, origin + width
    pos[1, ts:te] = origin + torch.linspace(0, height - 1, th).round().long().repeat_interleave(tw)
    pos[2, ts:te] = origin + torch.linspace(0, width - 1, tw).round().long().repeat(th)
    for k, (s, e) in enumerate(slices):
        ho, wo = (k // cols) * sh, (k % cols) * sw
        pos[1, s - 1], pos[2, s - 1] = origin + ho, origin + wo
        if e < end:
            pos[1, e], pos[2, e] = origin + ho + sh - 1, origin + wo + sw - 1
        pos[1, s:e] = origin + ho + torch.arange(sh).repeat_interleave(sw)
        pos[2, s:e] = origin + wo + torch.arange(sw).repeat(sh)
        if k < len(slices) - 1 and slices[k + 1][0] - e > 2:  # the newline(s) after a row: past its right edge
            for nl in range(e + 1, slices[k + 1][0] - 1):
                pos[1, nl], pos[2, nl] = origin + (k // cols + 1) * sh - 1, origin + cols * sw
    pos[:, end:] = origin + max(height, width) + 1 + torch.arange(n - end)
    return pos


def installed_positions(model_cls: type, ids: list[int], target_sizes: list[list[int]]) -> Any:
    """``(positions, delta)`` from the installed ``get_mrope_input_positions`` on a stand-in of ``model_cls`` whose
    canvas state comes from its ``_init_canvas_mrope`` as it now stands, for a transformers ``MiniCPMV4_7Config``
    without ``mrope_mode`` (with the five ids, it reads nothing but the config)."""
    import torch
    from torch import nn
    from transformers import MiniCPMV4_7Config

    model = model_cls.__new__(model_cls)
    nn.Module.__init__(model)
    model.config = MiniCPMV4_7Config(image_token_id=PAD, **PROBE_IDS)
    model._init_canvas_mrope(None)
    feature = types.SimpleNamespace(
        data={"tgt_sizes": types.SimpleNamespace(data=torch.tensor(target_sizes))},
        mm_position=types.SimpleNamespace(offset=ids.index(PROBE_IDS["image_start_id"])),
    )
    return model.get_mrope_input_positions(ids, [feature])


def probe(module: ModuleType) -> Verdict:
    """Are the member's canvas M-RoPE positions transformers' for a config transformers wrote? Never raises; leaves
    ``module`` unchanged."""
    cls = getattr(module, MODEL_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "_init_canvas_mrope", None)):
        return Verdict(State.CORRECT, f"{getattr(cls, '__name__', MODEL_CLASS)} has no canvas M-RoPE "
                                      "(_init_canvas_mrope): nothing to correct", applicable=False)
    try:
        differ = {}
        for name, (rows, cols) in {"thumbnail": (0, 0), "2x2 slices": (2, 2)}.items():
            ids, sizes = probe_prompt(rows, cols)
            want = reference_positions(ids, sizes)
            got, delta = installed_positions(cls, ids, sizes)
            if tuple(got.shape) != tuple(want.shape):
                differ[name] = f"shape {tuple(got.shape)} against {tuple(want.shape)}"
            elif bool((got != want).any()) or int(delta) != int(want.max()) + 1 - len(ids):
                differ[name] = f"{int((got != want).sum())} of {want.numel()} positions"
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"probe could not run {cls.__name__}.get_mrope_input_positions: "
                                           f"{type(exc).__name__}: {exc}")
    if differ:
        return Verdict(State.BROKEN, f"{cls.__name__} gives a checkpoint whose config transformers wrote (no "
                                     f"mrope_mode) other positions than transformers' canvas: "
                                     + "; ".join(f"{k}: {v} differ" for k, v in differ.items()))
    return Verdict(State.CORRECT, f"{cls.__name__}'s positions equal transformers' canvas layout")
