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
and stops construction there (nothing is built); then it enters the class's ``_mark_tower_model`` as it now stands
(vLLM's, or this fix's over it) with those modalities and a multimodal config that records which modalities' limits
it reads -- the modalities the tower is marked for. ``broken`` if that set lacks ``"video"`` while the model's
processing info supports videos (``get_supported_mm_limits``) -- 0.22-0.33; ``correct`` if ``"video"`` is in it;
``undetermined`` if ``__init__`` cannot reach the call on the stand-in; ``unrecognised`` if the classes are not
there. ``force`` applies wherever ``_mark_tower_model`` exists.

Upstream
--------
none known.

Remove when
-----------
its probe sees vLLM's own ``__init__`` and ``_mark_tower_model`` mark the vision tower for ``"video"`` as well as
``"image"`` on every release the hotfix supports; every release measured so far (0.22-0.34) marks it for ``"image"``
only.

"""

from __future__ import annotations

import types
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import INFO_CLASS, MODEL_CLASS, V46, V47, VOCR, Call, wrap

NAME = "video_tower"
LABEL = "vision tower built for video-only serving"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR inherits the 4.6 methods this fix sets

#: The modalities MiniCPM-V 4.6's vision tower encodes.
TOWER_MODALITIES = frozenset({"image", "video"})


def _as_set(modalities: Any) -> set[str]:
    return {modalities} if isinstance(modalities, str) else set(modalities)


def mark_tower_model(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``SupportsMultiModal._mark_tower_model(self, vllm_config, modalities, *, targets=None)`` (a context
    manager): ``{"image"}`` becomes ``{"image", "video"}``; returns vLLM's own context manager."""
    args, kwargs = call.replaced(modalities=effective_modalities(call["modalities"]))
    return wrapped(*args[1:], **kwargs)


def effective_modalities(modalities: Any) -> Any:
    """``{"image"}`` (or ``"image"``) -> ``{"image", "video"}``; anything else unchanged."""
    return set(TOWER_MODALITIES) if _as_set(modalities) == {"image"} else modalities


PATCHES = {f"{MODEL_CLASS}._mark_tower_model": wrap(mark_tower_model, bind=True)}


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


def marked_modalities(cls: type, asked: Any) -> set[str]:
    """The modalities the class's ``_mark_tower_model`` as it now stands marks a tower for when vLLM's ``__init__``
    asks for ``asked``: entered on a stand-in instance with a multimodal config whose every limit is 0, the
    modalities whose limits it reads (vLLM reads each marked modality's to decide whether to skip the tower)."""
    from torch import nn

    model = cls.__new__(cls)
    nn.Module.__init__(model)
    read: set[str] = set()

    def limit(modality: str) -> int:
        read.add(modality)
        return 0

    mm = types.SimpleNamespace(get_limit_per_prompt=limit)
    model_config = types.SimpleNamespace(multimodal_config=mm, get_multimodal_config=lambda: mm)
    vllm_config = types.SimpleNamespace(model_config=model_config)
    with cls._mark_tower_model(model, vllm_config, asked):
        pass
    return read


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
    try:
        marked = marked_modalities(cls, asked)
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"probe could not enter {MODEL_CLASS}._mark_tower_model: "
                                           f"{type(exc).__name__}: {exc}")
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
