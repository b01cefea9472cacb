"""Build and load the vision tower when the server takes videos only.

What breaks
-----------
vLLM skips the modules of a modality whose ``--limit-mm-per-prompt`` is 0: a model marks them with
``SupportsMultiModal._mark_tower_model(vllm_config, modalities)`` (``vllm/model_executor/models/interfaces.py``), and
when *every* modality in ``modalities`` has limit 0 they are built as ``StageMissingLayer`` placeholders under
``no_init_weights`` -- left on the ``meta`` device and never loaded. MiniCPM-V 4.6 marks its vision tower (``vpm``,
``vit_merger``, ``merger``) with ``{"image"}`` only (``MiniCPMV4_6ForConditionalGeneration.__init__``, 0.22-0.33), but
the same tower encodes videos (``embed_multimodal`` runs ``video_pixel_values`` through it). So a server started with
``--limit-mm-per-prompt '{"image": 0, "video": 1}'`` has no vision tower: the first video dies inside the patch
embedding with ``RuntimeError: Tensor on device meta is not on the expected device cpu!`` (on 0.22.1 already in the
start-up profiling run, on later releases on the first video request, taking the engine down).

What the fix does
-----------------
It wraps ``_mark_tower_model`` on ``MiniCPMV4_6ForConditionalGeneration`` (and so on its 0.32+ subclass
``MiniCPMV4_7ForConditionalGeneration``): a call that marks modules for ``{"image"}`` marks them for
``{"image", "video"}`` -- the modalities that tower serves -- so they are skipped only when *both* limits are 0. Every
other call, and everything vLLM's context manager does, is unchanged.

The decision
------------
:func:`probe` runs vLLM's own ``MiniCPMV4_6ForConditionalGeneration.__init__`` on a stand-in instance (created
without ``__init__``; a minimal ``vllm_config``) whose ``_mark_tower_model`` records the modalities of its first call
and stops construction there (nothing is built). ``broken`` if the vision tower is marked for a set without
``"video"`` while the model's processing info supports videos (``get_supported_mm_limits``) -- 0.22-0.33;
``correct`` if ``"video"`` is in it (after the fix: the wrapper on the class reports what it turns vLLM's argument
into); ``undetermined`` if ``__init__`` cannot reach the call on the stand-in;
``unrecognised`` if the classes are not there. ``force`` applies wherever ``_mark_tower_model`` exists.

The fix interface (:mod:`vllm_minicpm_hotfix.fixes._base`): ``NAME``, ``LABEL``, ``MODELS``, ``PATCHES``,
:func:`probe`. Nothing here imports vLLM, torch or transformers at import time.
"""

from __future__ import annotations

import sys
import functools
import types
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from . import _base

NAME = "video_tower"
MODELS = ("MiniCPM-V 4.6", "MiniCPM-V 4.7")
LABEL = "vision tower built for video-only serving"
MODEL_CLASS = "MiniCPMV4_6ForConditionalGeneration"
INFO_CLASS = "MiniCPMV4_6ProcessingInfo"
PATCHES = {f"{MODEL_CLASS}._mark_tower_model": lambda old, _: wrap_mark_tower_model(old)}

#: The modalities MiniCPM-V 4.6's vision tower encodes.
TOWER_MODALITIES = frozenset({"image", "video"})


def _as_set(modalities: Any) -> set[str]:
    return {modalities} if isinstance(modalities, str) else set(modalities)


def wrap_mark_tower_model(original: Any) -> Any:
    """Wrap ``SupportsMultiModal._mark_tower_model(self, vllm_config, modalities, *, targets=None)`` (a context
    manager): ``{"image"}`` becomes ``{"image", "video"}``; returns vLLM's own context manager."""

    @functools.wraps(original)
    def _mark_tower_model(self: Any, vllm_config: Any, modalities: Any, *args: Any, **kwargs: Any) -> Any:
        if not _base.covers(sys.modules[__name__], self):
            return original(self, vllm_config, modalities, *args, **kwargs)
        return original(self, vllm_config, effective_modalities(modalities), *args, **kwargs)

    _mark_tower_model.effective_modalities = effective_modalities  # what the probe asks of the patched class
    return _mark_tower_model


def effective_modalities(modalities: Any) -> Any:
    """``{"image"}`` (or ``"image"``) -> ``{"image", "video"}``; anything else unchanged."""
    return set(TOWER_MODALITIES) if _as_set(modalities) == {"image"} else modalities


class _Stop(Exception):
    """Raised by the probe's recorder to stop ``__init__`` before anything is built."""


def tower_modalities(module: ModuleType) -> set[str]:
    """The modalities vLLM's ``MiniCPMV4_6ForConditionalGeneration.__init__`` marks its first tower with, run on a
    stand-in that stops at that call. Raises what ``__init__`` raises before reaching it (``RuntimeError`` if it
    never calls ``_mark_tower_model``)."""
    from torch import nn

    cls = getattr(module, MODEL_CLASS)
    seen: list[set[str]] = []

    def record(vllm_config: Any, modalities: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(_as_set(modalities))
        raise _Stop

    model = cls.__new__(cls)
    nn.Module.__init__(model)
    object.__setattr__(model, "_mark_tower_model", record)
    mm = types.SimpleNamespace(mm_encoder_tp_mode="weights", get_limit_per_prompt=lambda m: 1)
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), multimodal_config=mm,
                                         get_multimodal_config=lambda: mm)
    vllm_config = types.SimpleNamespace(model_config=model_config, quant_config=None)
    try:
        cls.__init__(model, vllm_config=vllm_config)
    except _Stop:
        return seen[0]
    raise RuntimeError(f"{MODEL_CLASS}.__init__ returned without calling _mark_tower_model")


def probe(module: ModuleType) -> Verdict:
    """Is the vision tower marked for videos too? (See the module docstring.) Never raises; leaves ``module``
    unchanged."""
    cls = getattr(module, MODEL_CLASS, None)
    info_cls = getattr(module, INFO_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "_mark_tower_model", None)):
        return Verdict(State.UNRECOGNISED, f"{module.__name__}.{MODEL_CLASS} has no _mark_tower_model",
                       applicable=False)
    try:
        asked = tower_modalities(module)
    except Exception as exc:  # noqa: BLE001 - an __init__ the stand-in cannot run
        return Verdict(State.UNDETERMINED, f"probe could not run {MODEL_CLASS}.__init__ to its vision tower: "
                                           f"{type(exc).__name__}: {exc}")
    # The stand-in stops at the call vLLM's __init__ makes; a wrapper on the class (this fix) says what it marks.
    # The wrapper acts only for the classes the fix covers.
    transform = getattr(cls._mark_tower_model, "effective_modalities", None) if _base.covers(
        sys.modules[__name__], cls) else None
    marked = _as_set(transform(asked)) if callable(transform) else asked
    try:
        supported = set(info_cls.get_supported_mm_limits(object.__new__(info_cls)))
    except Exception:  # noqa: BLE001
        supported = set(TOWER_MODALITIES)
    if "video" in supported and "video" not in marked:
        return Verdict(State.BROKEN, f"the vision tower is marked for {sorted(marked)} only but also encodes videos: "
                                     "with an image limit of 0 it stays on the meta device and the first video "
                                     "kills the engine")
    return Verdict(State.CORRECT, f"the vision tower is marked for {sorted(marked)}"
                   + ("" if marked == asked else f" (vLLM's __init__ asks for {sorted(asked)})"))
