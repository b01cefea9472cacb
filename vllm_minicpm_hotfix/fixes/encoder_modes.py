"""Encode every image and video in the downsample mode its own request asked for.

What breaks
-----------
MiniCPM-V 4.6 has two vision modes: ``"16x"`` (the vit_merger runs mid-encoder: 1 embedding per 4x4 patches) and
``"4x"`` (it is skipped: 1 per 2x2). A request picks one with ``mm_processor_kwargs={"downsample_mode": "4x"}``; vLLM's
processor then sizes the item's placeholder for that mode and records it per image as ``use_vit_merger``. In vLLM
0.22-0.31 the model does not honour it per item (``vllm/model_executor/models/minicpmv4_6.py``):

* ``embed_multimodal`` collapses the flags of every image in the encoder batch into one,
  ``use_vit_merger = any(flags)``, so when the scheduler puts a ``"4x"`` and a ``"16x"`` request in the same step the
  ``"4x"`` image is encoded in 16x: 4x fewer embeddings than its placeholder has, and ``_merge_multimodal_embeddings``
  kills the engine (every request in flight fails);
* videos carry no flag at all (``process_videos`` emits none, ``_get_mm_fields_config`` declares none), so a video is
  encoded in the images' mode or, alone, in the model config's ``downsample_mode``: a ``"4x"`` video request dies the
  same way.

vLLM 0.32 fixed both (``_process_vision_input`` groups items by flag; ``process_videos`` emits a per-video
``video_use_vit_merger`` declared ``MultiModalFieldConfig.batched("video")``).

What the fix does
-----------------
The same on the releases that need it, without copying vLLM's body:

* ``MiniCPMV4_6MultiModalProcessor.process_mm_inputs`` (vLLM's ``MiniCPMVMultiModalProcessor`` method that returns
  ``{**process_images(...), **process_videos(...)}``; wrapped there rather than on ``process_videos``, which the
  serving fixes may wrap): vLLM's own result plus ``video_use_vit_merger`` -- one ``torch.bool`` tensor of shape
  ``(1,)`` per video, true iff the video's resolved mode (``_resolve_downsample_mode``, the same the placeholder count
  uses) is not ``"4x"`` and ``insert_layer_id >= 0`` -- where vLLM emitted videos and no such field;
* ``MiniCPMV4_6MultiModalProcessor._get_mm_fields_config``: declares that field (batched per video, kept on CPU where
  this vLLM's ``MultiModalFieldConfig.batched`` takes ``keep_on_cpu``), so it reaches the model;
* ``MiniCPMV4_6ForConditionalGeneration.embed_multimodal``: splits the batch into groups of items that share a flag
  (images by ``use_vit_merger``, videos by ``video_use_vit_merger``), runs vLLM's *own* ``embed_multimodal`` once per
  group -- where a uniform flag is exactly what it handles -- and returns the embeddings in the original item order
  (images, then videos, as vLLM does). A batch that needs no split goes to vLLM's method unchanged.

The decision
------------
:func:`probe` runs vLLM's own code on stand-ins (created without ``__init__``; the vision tower replaced by a recorder
that returns, per slice, as many rows as the mode it is asked for gives):

1. vLLM's ``embed_multimodal`` on a batch of two one-slice images, one 16x and one 4x: does each get its own count
   (1 and 4 rows)?
2. vLLM's ``process_mm_inputs`` (with the member's own transformers image processor, :data:`IMAGE_PROCESSORS`:
   ``MiniCPMV4_6ImageProcessor`` for 4.6 and 4.7, ``MiniCPMOcrImageProcessor`` for MiniCPM-OCR) on a one-frame 28x28
   video with ``{"downsample_mode": "4x"}``, filtered through vLLM's ``_get_mm_fields_config`` as vLLM's processor
   does, then vLLM's ``embed_multimodal``: does the video get the 4x count of its ``video_tgt_sizes``? vLLM 0.33-0.34's
   own OCR ``process_videos`` hands the image processor options no released transformers takes (every OCR video
   fails before the encoder, whatever this fix does: ``ocr_video_kwargs``' defect, whose fix puts 4.6's
   ``process_videos`` in its place); there the video is run through the 4.6 ``process_videos`` the member inherits,
   and the reason says so.

``broken`` if either answer is no (0.22-0.31: both), ``correct`` if both are yes (0.32-0.34, MiniCPM-OCR included),
``undetermined`` if a stand-in cannot be run, ``unrecognised`` if the classes or methods are not there. Where
transformers has no image processor of the member (MiniCPM-OCR before transformers has ``minicpm_ocr``, e.g. 0.32.0,
0.33.0 with 5.20.2: vLLM cannot serve it there) 4.6's stands in, and the reason says so. ``force`` applies wherever they are
(on a vLLM that already groups, the wrapper's groups are what vLLM would form itself).

Upstream
--------
none known (0.32 groups a batch by mode and flags each video itself).

Remove when
-----------
its probe sees stock vLLM give the 16x and the 4x image of one batch 1 and 4 rows, and the 4x video its 4x count, on
every release the hotfix supports: once 0.22-0.31 are no longer supported.

"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import (
    FAMILY, INFO_CLASS, MODEL_CLASS, PROCESSOR_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, base_named, wrap,
)

NAME = "encoder_modes"
LABEL = "per-item downsample mode in the vision encoder (mixed 4x/16x batches, 4x videos)"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR inherits the 4.6 methods this fix wraps
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use
#: Two fixes on ``process_mm_inputs``: this one wraps outside ``mm_placeholders``'s.
AFTER = ("mm_placeholders",)

IMAGE_FLAG = "use_vit_merger"
VIDEO_FLAG = "video_use_vit_merger"
IMAGE_KEYS = ("pixel_values", "image_embeds", "tgt_sizes")
VIDEO_PREFIX = "video_"


# --------------------------------------------------------------------------------------------------------------------
# Batched values
# --------------------------------------------------------------------------------------------------------------------


def _num_items(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    return len(value)


def _take(value: Any, indices: list[int]) -> list[Any]:
    """The items at ``indices`` of a batched value (a stacked tensor or a per-item list), as a per-item list."""
    return [value[i] for i in indices]


def item_flags(value: Any, n: int) -> list[bool] | None:
    """One vit_merger flag per item from a batched flag field (None if absent or not one per item)."""
    import torch

    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        flat = value.reshape(value.shape[0], -1) if value.ndim else value.reshape(1, 1)
        rows = [bool(r.any().item()) for r in flat]
    else:
        rows = [bool(v.any().item()) if isinstance(v, torch.Tensor) else bool(v) for v in value]
    if len(rows) == n:
        return rows
    return None


def _groups(flags: list[bool]) -> list[tuple[bool, list[int]]]:
    """Item indices per flag, in order of first appearance."""
    out: dict[bool, list[int]] = {}
    for i, f in enumerate(flags):
        out.setdefault(f, []).append(i)
    return list(out.items())


# --------------------------------------------------------------------------------------------------------------------
# The wrappers
# --------------------------------------------------------------------------------------------------------------------


def embed_multimodal(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``MiniCPMV4_6ForConditionalGeneration.embed_multimodal(**kwargs) -> MultiModalEmbeddings``: one
    ``(tokens, hidden)`` tensor per item, images first then videos (vLLM's order); each item encoded in its own mode.
    Raises what vLLM's method raises."""
    image_flag_value = kwargs.get(IMAGE_FLAG)
    video_flag_value = kwargs.get(VIDEO_FLAG)
    image_kw = {k: kwargs[k] for k in IMAGE_KEYS if kwargs.get(k) is not None}
    video_kw = {k: v for k, v in kwargs.items() if k.startswith(VIDEO_PREFIX) and k != VIDEO_FLAG}
    other = {k: v for k, v in kwargs.items()
             if k not in image_kw and k not in video_kw and k not in (IMAGE_FLAG, VIDEO_FLAG)}

    n_images = _num_items(image_kw["pixel_values"]) if "pixel_values" in image_kw else 0
    n_videos = (_num_items(video_kw["video_pixel_values"])
                if video_kw.get("video_pixel_values") is not None else 0)
    image_flags = item_flags(image_flag_value, n_images) if n_images else None
    video_flags = item_flags(video_flag_value, n_videos) if n_videos else None
    split_images = image_flags is not None and len(set(image_flags)) > 1
    if not split_images and video_flags is None:
        return wrapped(**kwargs)  # nothing per item to honour: vLLM's own behaviour

    out: list[Any] = []
    if image_kw:
        if split_images:
            by_index: dict[int, Any] = {}
            for _flag, idx in _groups(image_flags):
                part = {k: _take(v, idx) for k, v in image_kw.items()}
                part[IMAGE_FLAG] = _take(image_flag_value, idx)
                for i, emb in zip(idx, wrapped(**other, **part)):
                    by_index[i] = emb
            out.extend(by_index[i] for i in range(n_images))
        else:
            part = dict(image_kw)
            if image_flag_value is not None:
                part[IMAGE_FLAG] = image_flag_value
            out.extend(wrapped(**other, **part))
    if video_kw:
        if video_flags is None:
            # vLLM's own rule for videos without a flag: the images' flag of this batch, else the config's mode.
            part = dict(video_kw)
            if image_flag_value is not None:
                part[IMAGE_FLAG] = image_flag_value
            out.extend(wrapped(**other, **part))
        else:
            by_index = {}
            for _flag, idx in _groups(video_flags):
                part = {k: _take(v, idx) for k, v in video_kw.items()}
                flags = _take(video_flag_value, idx)
                # <= 0.31 encodes videos with the images' flag; 0.32+ reads the video flag: give both.
                part[IMAGE_FLAG] = flags
                part[VIDEO_FLAG] = flags
                for i, emb in zip(idx, wrapped(**other, **part)):
                    by_index[i] = emb
            out.extend(by_index[i] for i in range(n_videos))
    return tuple(out)


def _resolved_video_mode(processor: Any, mm_kwargs: Mapping[str, object]) -> Any:
    resolver = processor._resolve_downsample_mode
    try:
        if "modality" in inspect.signature(resolver).parameters:
            return resolver(mm_kwargs, modality="video")
    except (TypeError, ValueError):
        pass
    return resolver(mm_kwargs)


def process_mm_inputs(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``process_mm_inputs(mm_data, mm_kwargs[, tok_kwargs]) -> Mapping[str, NestedTensors]``: vLLM's result,
    plus ``video_use_vit_merger`` (one ``torch.bool`` tensor of shape ``(1,)`` per video) where vLLM emitted videos
    and no such field."""
    out = wrapped(*call.args, **call.kwargs)
    videos = out.get("video_pixel_values") if isinstance(out, Mapping) else None
    if not videos or VIDEO_FLAG in out:
        return out
    import torch

    mode = _resolved_video_mode(instance, call.get("mm_kwargs") or {})
    insert_layer_id = getattr(instance.info.get_hf_config(), "insert_layer_id", -1)
    flag = mode != "4x" and insert_layer_id >= 0
    return {**out, VIDEO_FLAG: [torch.tensor([flag], dtype=torch.bool) for _ in range(_num_items(videos))]}


def _batched_video_field() -> Any:
    from vllm.multimodal.inputs import MultiModalFieldConfig

    try:
        return MultiModalFieldConfig.batched("video", keep_on_cpu=True)
    except TypeError:  # vLLM <= 0.28: no keep_on_cpu
        return MultiModalFieldConfig.batched("video")


def get_mm_fields_config(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``_get_mm_fields_config(hf_inputs, hf_processor_mm_kwargs)``: vLLM's fields, plus
    ``video_use_vit_merger`` (batched per video) when the processed inputs carry it and vLLM does not declare it."""
    fields = wrapped(*call.args, **call.kwargs)
    hf_inputs = call["hf_inputs"]
    if VIDEO_FLAG in hf_inputs and VIDEO_FLAG not in fields:
        fields = {**fields, VIDEO_FLAG: _batched_video_field()}
    return fields


PATCHES = {
    f"{MODEL_CLASS}.embed_multimodal": wrap(embed_multimodal),
    f"{PROCESSOR_CLASS}.process_mm_inputs": wrap(process_mm_inputs, bind=True),
    f"{PROCESSOR_CLASS}._get_mm_fields_config": wrap(get_mm_fields_config, bind=True),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------------------------


def rows_for(tgt_sizes: Any, use_vit_merger: bool) -> list[int]:
    """Embeddings per slice the real model gives (vit_merger 2x2 when 16x, then the 2x2 merger)."""
    from .placeholder_guard import embeddings_per_slice

    return [embeddings_per_slice(int(h), int(w), use_vit_merger) for h, w in tgt_sizes.reshape(-1, 2).tolist()]


def _stand_in_model(module: ModuleType, config: Any, calls: list) -> Any:
    """vLLM's 4.6 model class without ``__init__``; its vision tower a recorder returning zero rows per slice."""
    import torch
    from torch import nn

    cls = getattr(module, MODEL_CLASS)
    model = cls.__new__(cls)
    nn.Module.__init__(model)
    model.config = config

    def get_vision_hidden_states(data: Any, downsample_mode: str | None = None) -> list:
        mode = downsample_mode or getattr(config, "downsample_mode", "16x")
        calls.append(mode)
        return [torch.zeros(n, 1) for n in rows_for(data["tgt_sizes"], mode != "4x")]

    model.get_vision_hidden_states = get_vision_hidden_states
    return model


def _mixed_image_batch(module: ModuleType, config: Any) -> tuple[list[int], list[int]]:
    """(rows vLLM's embed_multimodal returns, rows each image's own mode gives) for a 16x and a 4x image."""
    import torch

    model = _stand_in_model(module, config, [])
    tgt = torch.tensor([[[4, 4]], [[4, 4]]])  # two images of one 4x4-patch slice each (stacked, as vLLM batches)
    out = getattr(module, MODEL_CLASS).embed_multimodal(
        model,
        pixel_values=torch.zeros(2, 1, 3, 14, 14 * 16),
        tgt_sizes=tgt,
        **{IMAGE_FLAG: torch.tensor([[True], [False]])},
    )
    return [int(e.shape[0]) for e in out], [sum(rows_for(tgt[0], True)), sum(rows_for(tgt[1], False))]


class _Items(list):
    def get_items(self, modality: str, types_: Any = None) -> list:
        return list(self)


def reshape_by_patch(image: Any, patch_size: int) -> Any:
    """transformers' ``MiniCPMV4_6ImageProcessor.reshape_by_patch(image [C, H, W], patch_size) -> [C, patch_size,
    H * W / patch_size]`` (NaViT patch layout: patch ``l`` in row-major order of the ``patch_size`` grid, row ``i``
    of channel ``c`` at ``[c, i, l * patch_size : (l + 1) * patch_size]``), the same tensor by a view and a permute
    instead of ``torch.nn.functional.unfold``: torch's CPU ``im2col`` costs milliseconds of CPU per call in its thread
    pool even for a 56x56 image, a probe's largest single cost. Same dtype. Raises RuntimeError if ``H`` or ``W`` is
    not a multiple of ``patch_size`` (``unfold`` would drop the remainder; the probe's sizes are multiples)."""
    c, h, w = image.shape
    p = int(patch_size)
    return image.reshape(c, h // p, p, w // p, p).permute(0, 2, 1, 3, 4).reshape(c, p, -1)


def _probe_image_processor(cls: type, **kwargs: Any) -> Any:
    """An instance of ``cls`` (transformers' ``MiniCPMV4_6ImageProcessor``) built with ``kwargs`` whose
    ``reshape_by_patch`` is :func:`reshape_by_patch` (an instance attribute: a subclass would cost transformers'
    class set-up, milliseconds): the probe judges rows and flags, never pixel values, and the values are the same
    anyway."""
    processor = cls(**kwargs)
    processor.reshape_by_patch = lambda image, patch_size: reshape_by_patch(image, patch_size)
    return processor


#: transformers' image processor of each member (torchvision backend: what AutoImageProcessor gives a checkpoint wherever
#: torchvision is installed, as it is with vLLM): the class whose kwargs check a member's frames go through. 4.7's is
#: 4.6's (transformers maps ``minicpmv4_7`` to it).
IMAGE_PROCESSORS = {
    V46: ("transformers.models.minicpmv4_6.image_processing_minicpmv4_6", "MiniCPMV4_6ImageProcessor"),
    V47: ("transformers.models.minicpmv4_6.image_processing_minicpmv4_6", "MiniCPMV4_6ImageProcessor"),
    VOCR: ("transformers.models.minicpm_ocr.image_processing_minicpm_ocr", "MiniCPMOcrImageProcessor"),
}


def member_image_processor(module: ModuleType) -> tuple[type, str]:
    """(transformers' image processor class of the member ``module`` stands for -- a :func:`~._base.member_view` or
    vLLM's 4.6 module: :data:`IMAGE_PROCESSORS` --, a note: "" or why another class stands in). Where the installed
    transformers has no such class (MiniCPM-OCR before transformers has ``minicpm_ocr``: vLLM cannot serve the member
    there), 4.6's, which the member's image processor is a variant of, and the note says so. Raises ImportError where
    transformers has neither."""
    import importlib

    member = FAMILY.get(module.__name__, V46)
    mod_name, cls_name = IMAGE_PROCESSORS.get(member, IMAGE_PROCESSORS[V46])
    try:
        return getattr(importlib.import_module(mod_name), cls_name), ""
    except (ImportError, AttributeError) as exc:
        base_mod, base_name = IMAGE_PROCESSORS[V46]
        if (mod_name, cls_name) == (base_mod, base_name):
            raise
        import transformers

        note = (f"transformers {transformers.__version__} has no {cls_name} ({type(exc).__name__}: {exc}; vLLM cannot "
                f"serve this member here), so its frames are judged with {base_name}")
        return getattr(importlib.import_module(base_mod), base_name), note


def _rejects_kwargs(exc: BaseException) -> bool:
    """Whether ``exc`` is an image processor's kwargs check refusing an option (a ``TypeError`` naming an unexpected
    keyword argument): the frame is refused before any pixel or encoder work."""
    return isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc)


def _four_x_video(module: ModuleType, config: Any) -> tuple[int, int, str]:
    """(rows vLLM gives a one-frame "4x" video, rows its placeholder is sized for, a note: "" or how the video path
    was run). The member's own ``process_mm_inputs`` with the member's transformers image processor
    (:func:`member_image_processor`). Where the member's own ``process_videos`` overrides 4.6's and hands the image
    processor an option it refuses (vLLM 0.33-0.34's MiniCPM-OCR: every video fails before the encoder, whatever
    this fix does: ``ocr_video_kwargs``' defect, which puts 4.6's ``process_videos`` in its place), the video is run
    through the 4.6 ``process_videos`` the member inherits, still in the member's ``process_mm_inputs`` and with its
    image processor: the path its videos take once they can be processed at all."""
    import numpy as np
    import torch

    proc_cls = getattr(module, PROCESSOR_CLASS)
    info_cls = getattr(module, INFO_CLASS)
    ip_cls, ip_note = member_image_processor(module)
    image_processor = _probe_image_processor(ip_cls, scale_resolution=56)  # 28x28 -> 56x56
    info = object.__new__(info_cls)
    video = [np.zeros((28, 28, 3), dtype=np.uint8)]
    request = {"downsample_mode": "4x"}
    stubs = {
        "get_hf_config": lambda: config,
        "get_image_processor": lambda *a, **k: image_processor,
        "get_video_max_slice_num": lambda: 1,
        "parse_mm_data": lambda data, validate=False: _Items(data["video"]),
        "_merge_and_resolve_mm_processor_kwargs": lambda kw: {"images_kwargs": dict(kw), "videos_kwargs": dict(kw)},
    }
    for name, fn in stubs.items():
        setattr(info, name, fn)
    proc = object.__new__(proc_cls)
    proc.info = info
    params = inspect.signature(proc_cls.process_mm_inputs).parameters
    args = [{"videos": [video]}, request] + ([{}] if "tok_kwargs" in params else [])
    notes = [ip_note] if ip_note else []
    try:
        out = proc_cls.process_mm_inputs(proc, *args)
    except TypeError as exc:
        base = base_named(proc_cls, PROCESSOR_CLASS)  # vLLM's 4.6 class (a member view names its subclass so)
        if (not _rejects_kwargs(exc) or base is None or base is proc_cls
                or getattr(proc_cls, "process_videos", None) is getattr(base, "process_videos", None)):
            raise
        proc.process_videos = types.MethodType(base.process_videos, proc)
        notes.append(f"its own process_videos refuses the frame: {type(exc).__name__}: {exc} (ocr_video_kwargs' "
                     "defect), so the video is judged on the process_videos of vLLM's 4.6 class, which it inherits")
        out = proc_cls.process_mm_inputs(proc, *args)
    fields = proc_cls._get_mm_fields_config(proc, out, request)
    batch = {k: torch.stack([v[0]]) for k, v in out.items() if k in fields and k.startswith(VIDEO_PREFIX)}
    model = _stand_in_model(module, config, [])
    emb = getattr(module, MODEL_CLASS).embed_multimodal(model, **batch)
    got = sum(int(e.shape[0]) for e in emb)
    want = sum(rows_for(out["video_tgt_sizes"][0], False))
    return got, want, "; ".join(notes)


def probe(module: ModuleType) -> Verdict:
    """Does vLLM encode each image and video in its own request's mode? (See the module docstring.) Never raises;
    leaves ``module`` unchanged."""
    model_cls = getattr(module, MODEL_CLASS, None)
    proc_cls = getattr(module, PROCESSOR_CLASS, None)
    missing = [f"{c}.{a}" for c, cls, attrs in (
        (MODEL_CLASS, model_cls, ("embed_multimodal", "get_vision_hidden_states", "_process_vision_input")),
        (PROCESSOR_CLASS, proc_cls, ("process_mm_inputs", "process_videos", "_get_mm_fields_config",
                                     "_resolve_downsample_mode")),
    ) for a in attrs if not callable(getattr(cls, a, None))]
    if missing:
        return Verdict(State.UNRECOGNISED, f"{module.__name__} lacks {missing}", applicable=False)
    config = types.SimpleNamespace(downsample_mode="16x", insert_layer_id=0)
    problems = []
    try:
        got, want = _mixed_image_batch(module, config)
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"mixed-batch probe failed: {type(exc).__name__}: {exc}")
    if got != want:  # broken already: the verdict cannot change, so the 4x video (~4 ms of transformers) is not run
        return Verdict(State.BROKEN, "vLLM's vision encoder ignores the per-item mode: a 16x and a 4x image in one "
                                     f"encoder batch get {got} embeddings, their placeholders {want} (the 4x-video "
                                     "check not run)")
    try:
        got_v, want_v, note = _four_x_video(module, config)
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"4x-video probe failed: {type(exc).__name__}: {exc}")
    if got_v != want_v:
        problems.append(f"a one-frame 4x video gets {got_v} embeddings, its placeholder {want_v}")
    tail = f" ({note})" if note else ""
    if problems:
        return Verdict(State.BROKEN, "vLLM's vision encoder ignores the per-item mode: " + "; ".join(problems) + tail)
    return Verdict(State.CORRECT, "not needed: vLLM encodes each image and video in its own mode "
                                  f"(mixed batch {got}, 4x video {got_v}){tail}")
