"""MiniCPM-OCR videos on vLLM 0.33: every frame processed with options transformers' image processor takes.

What breaks
-----------
vLLM 0.33's own ``MiniCPMOcrMultiModalProcessor.process_videos`` (``vllm/model_executor/models/minicpm_ocr.py``)
drops the request's OCR upsize options and pins three of them off (``disable_small_image_upsize``,
``adaptive_small_image_upsize``, ``adaptive_tile_upsize``), then runs 4.6's ``process_videos``, which hands them to
transformers' image processor for every frame. No released transformers takes those names: ``MiniCPMOcrImageProcessor``
(5.21.0-5.25.0, every release with MiniCPM-OCR) has one option, ``small_image_upsize`` (``"always"``,
``"never"``, ``"adaptive"``), and its kwargs check raises ``TypeError: MiniCPMOcrImageProcessorKwargs.__init__() got
an unexpected keyword argument 'disable_small_image_upsize'``: every video request fails.

What the fix does
-----------------
Instead of vLLM's override, 4.6's ``process_videos`` (which the override calls) with the request's kwargs minus
vLLM's names (:data:`VLLM_NAMES`) and, where the installed image processor has the option, ``small_image_upsize`` =
``"always"``: what vLLM's pinned values mean (every frame sized as 4.6 sizes it) and what transformers'
``MiniCPMOcrVideoProcessor`` does with a frame (it has no small-image option).

It acts for MiniCPM-OCR only (``MODELS``): 4.6 and 4.7 have no such override, and neither has the hotfix's OCR
backport (its videos are 4.6's path).

The decision
------------
:func:`probe` runs the installed ``process_videos`` of the member's multimodal processor -- vLLM's class, created
without ``__init__``, over a stand-in processing info whose image processor is transformers' real 4.6 one
(``_stand_ins``; it rejects unknown kwargs as OCR's does) -- on a one-frame 28x28 video: ``broken`` if it raises
``TypeError`` naming an unexpected keyword argument, ``correct`` if it returns. A class that does not override 4.6's
``process_videos`` is ``correct``, not applicable. ~5 ms where it runs (vLLM 0.33 serving MiniCPM-OCR).

Upstream
--------
none known.

Remove when
-----------
its probe sees the OCR ``process_videos`` of every release the hotfix supports with vLLM's own MiniCPM-OCR return for
a one-frame video, no ``TypeError`` naming an unexpected keyword (0.33.0 with transformers forced past its pin, and
0.34.0, raise it).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from . import _stand_ins
from ._base import INFO_CLASS, PROCESSOR_CLASS, PROCESSOR_PATH, VOCR, Call, base_named, on_import, wrap

NAME = "ocr_video_kwargs"
LABEL = "MiniCPM-OCR video frames (upsize options transformers takes)"
MODELS = (VOCR,)
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use

#: vLLM 0.33's names of MiniCPM-OCR's upsize options (``minicpm_ocr.py``), which no released transformers takes.
VLLM_NAMES = frozenset({
    "disable_small_image_upsize", "adaptive_small_image_upsize", "adaptive_upsize_font_px",
    "adaptive_upsize_dense_per_kpx", "adaptive_upsize_tiny_pixels", "adaptive_upsize_tiny_target_resolution",
    "adaptive_tile_upsize",
})
#: transformers' option and a video frame's setting of it: upsized as 4.6 upsizes (its video processor has no other).
FRAME_UPSIZE = ("small_image_upsize", "always")
#: vLLM 0.33's own MiniCPM-OCR multimodal processor.
OCR_PROCESSOR = "vllm.model_executor.models.minicpm_ocr:MiniCPMOcrMultiModalProcessor"


def frame_kwargs(image_processor: Any, mm_kwargs: Any) -> dict[str, object]:
    """``mm_kwargs`` (a request's processor kwargs) without :data:`VLLM_NAMES`, plus :data:`FRAME_UPSIZE` where
    ``image_processor`` (transformers') has that option."""
    out = {k: v for k, v in dict(mm_kwargs or {}).items() if k not in VLLM_NAMES}
    key, value = FRAME_UPSIZE
    if hasattr(image_processor, key):
        out[key] = value
    return out


def process_videos(wrapped: Any, instance: Any, call: Call) -> Any:
    """Instead of vLLM 0.33's ``MiniCPMOcrMultiModalProcessor.process_videos(self, mm_data, mm_kwargs) ->
    Mapping[str, NestedTensors]``: the 4.6 class's with :func:`frame_kwargs` (see the module docstring). Raises what
    vLLM's 4.6 method raises."""
    base = base_named(instance, PROCESSOR_CLASS)
    if base is None:
        return wrapped(*call.args, **call.kwargs)
    kwargs = frame_kwargs(instance.info.get_image_processor(), call.get("mm_kwargs"))
    return base.process_videos(instance, call["mm_data"], kwargs)


PATCHES = {
    f"{OCR_PROCESSOR}.process_videos": on_import(lambda old, owner: wrap(process_videos, bind=True)
                                                 if "process_videos" in vars(owner) else None),
}


def _run_installed(proc_cls: type, info_cls: type) -> None:
    """The installed ``process_videos`` on a one-frame 28x28 video, on stand-ins; raises what it raises."""
    import numpy as np

    native = _stand_ins.hf_processor()
    info = _stand_ins.info(info_cls, native)
    frames = [np.zeros((28, 28, 3), dtype=np.uint8)]
    info.__dict__.update(
        get_video_max_slice_num=lambda: 1,
        parse_mm_data=lambda data, validate=False: _Parsed(data["video"]),
    )
    proc = _stand_ins.processor(proc_cls, info)
    proc_cls.process_videos(proc, {"videos": [frames]}, {})


class _Parsed:
    """vLLM's parsed items as far as ``process_videos`` reads them: ``get_items("video", types)`` -> the videos."""

    def __init__(self, videos: Any) -> None:
        self.videos = videos

    def get_items(self, modality: str, types_: Any = None) -> Any:
        from vllm.multimodal.parse import VideoProcessorItems

        return VideoProcessorItems(list(self.videos))


def probe(module: ModuleType) -> Verdict:
    """Whether the member's ``process_videos`` hands transformers' image processor only options it takes (see the
    module docstring). Never raises; leaves ``module`` unchanged."""
    proc_cls, info_cls = getattr(module, PROCESSOR_CLASS, None), getattr(module, INFO_CLASS, None)
    if not isinstance(proc_cls, type) or not isinstance(info_cls, type):
        return Verdict(State.UNRECOGNISED, f"{module.__name__} lacks {PROCESSOR_CLASS} / {INFO_CLASS}",
                       applicable=False)
    base = base_named(proc_cls, PROCESSOR_CLASS) or proc_cls
    if getattr(proc_cls, "process_videos", None) is getattr(base, "process_videos", None):
        return Verdict(State.CORRECT, f"{proc_cls.__name__} processes videos with 4.6's process_videos: nothing to "
                                      "correct", applicable=False)
    try:
        _run_installed(proc_cls, info_cls)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            return Verdict(State.BROKEN, f"{proc_cls.__name__}.process_videos hands transformers' image processor an "
                                         f"option it does not take: {exc}")
        return Verdict(State.UNDETERMINED, f"video probe failed: TypeError: {exc}")
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"video probe failed: {type(exc).__name__}: {exc}")
    return Verdict(State.CORRECT, f"{proc_cls.__name__}.process_videos runs transformers' image processor on a frame")
