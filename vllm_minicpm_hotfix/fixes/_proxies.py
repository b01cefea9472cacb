"""The views the fixes run vLLM's and transformers' own code against: ``wrapt.ObjectProxy`` subclasses.

Each proxy is the wrapped object (attribute reads and writes, ``isinstance``, ``__class__``, ``==`` and ``hash`` all
go to it) except for the attributes its docstring names; its own state is kept in ``_self_`` attributes, as wrapt
requires. They are built per call and never shared.

This module imports wrapt at import time (the installed one, else a bundle's pure-Python copy, as
:func:`vllm_minicpm_hotfix._wrapt.ensure_wrapt` picks it for the hook), so the fix modules import it only where
they build a proxy: importing the fixes package (``doctor`` and ``verify`` do, in environments without wrapt) needs no
wrapt. Nothing here imports vLLM, torch or transformers.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

from .._wrapt import ensure_wrapt

ensure_wrapt()

import wrapt  # noqa: E402

PARAM = "downsample_mode"

#: The ``mode`` of a :class:`ModeDefaultingImageProcessor` that was given none: the processor's own is used.
_OWN_MODE: Any = object()


@functools.lru_cache(maxsize=64)
def _mode_slot(function: Callable[..., Any], skip: int) -> tuple[bool, int | None]:
    """For ``function`` called with its first ``skip`` parameters already given (a bound method's ``self``): whether
    it takes ``downsample_mode``, and the position of that parameter among the arguments after those (None where it
    can only be passed by keyword). Computed once per function (transformers' two sizing methods)."""
    try:
        params = list(inspect.signature(function).parameters.values())[skip:]
    except (TypeError, ValueError):
        return False, None
    for i, p in enumerate(params):
        if p.name == PARAM:
            return True, (i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None)
    return False, None


def _with_mode(method: Callable[..., Any], mode: Any, args: tuple, kwargs: dict) -> Any:
    """Call ``method(*args, **kwargs)`` (a bound method), adding ``downsample_mode=mode`` if ``method``'s signature
    takes it and the arguments do not pass it. Arguments that do not bind are passed through, so the error is the
    method's own. Returns what ``method`` returns."""
    function = getattr(method, "__func__", None)
    takes, index = _mode_slot(method, 0) if function is None else _mode_slot(function, 1)
    if takes and PARAM not in kwargs and (index is None or len(args) <= index):
        kwargs = {**kwargs, PARAM: mode}
    return method(*args, **kwargs)


class ModeDefaultingImageProcessor(wrapt.ObjectProxy):
    """A transformers MiniCPM-V 4.6 image processor (``MiniCPMV4_6ImageProcessor`` /
    ``MiniCPMV4_6ImageProcessorPil``) whose ``find_best_resize`` / ``get_refine_size`` get ``downsample_mode`` when
    the caller does not bind it and the installed signature takes it (transformers >= 5.21: ``find_best_resize(
    image_size, scale_resolution, patch_size, downsample_mode, allow_upscale=False)``, ``get_refine_size(image_size,
    grid, scale_resolution, patch_size, downsample_mode, allow_upscale=False)``, both returning ``(height, width)``).

    Args:
        wrapped: the image processor.
        mode: the ``downsample_mode`` to add (``"16x"`` / ``"4x"``). Omitted: the processor's own ``downsample_mode``
            when the call is made (``"16x"`` if it has none), as ``MiniCPMV4_6ImageProcessor._preprocess`` uses it.

    Overrides ``find_best_resize``, ``get_refine_size`` and ``__call__`` (the processor's own ``__call__``);
    everything else, ``get_sliced_grid``, ``patch_size`` and attribute writes included, is the processor.
    ``copy.copy`` gives a proxy over the same processor, ``copy.deepcopy`` one over a deep copy, and it pickles as
    ``(wrapped, mode)``.
    """

    def __init__(self, wrapped: Any, mode: Any = _OWN_MODE) -> None:
        super().__init__(wrapped)
        self._self_mode = mode

    def _self_mode_now(self) -> Any:
        if self._self_mode is _OWN_MODE:
            return getattr(self.__wrapped__, PARAM, "16x")
        return self._self_mode

    def _self_args(self) -> tuple:
        return (self.__wrapped__,) if self._self_mode is _OWN_MODE else (self.__wrapped__, self._self_mode)

    def find_best_resize(self, *args: Any, **kwargs: Any) -> Any:
        return _with_mode(self.__wrapped__.find_best_resize, self._self_mode_now(), args, kwargs)

    def get_refine_size(self, *args: Any, **kwargs: Any) -> Any:
        return _with_mode(self.__wrapped__.get_refine_size, self._self_mode_now(), args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__wrapped__(*args, **kwargs)

    def __copy__(self) -> ModeDefaultingImageProcessor:
        return type(self)(*self._self_args())

    def __deepcopy__(self, memo: dict) -> ModeDefaultingImageProcessor:
        return type(self)(*copy.deepcopy(self._self_args(), memo))

    def __reduce_ex__(self, protocol: int) -> tuple:
        return type(self), self._self_args()

    def __reduce__(self) -> tuple:
        return self.__reduce_ex__(2)


class ModeInfoView(wrapt.ObjectProxy):
    """vLLM's ``MiniCPMV4_6ProcessingInfo`` (``vllm/model_executor/models/minicpmv4_6.py``) whose
    ``get_image_processor(*args, **kwargs)`` returns the real one's result behind a
    :class:`ModeDefaultingImageProcessor` with ``mode``: the ``self`` that ``processor_downsample_mode`` runs vLLM's
    ``_compute_visual_tokens`` against; likewise ``_pinned_image_processor`` where vLLM's MiniCPM-OCR info has it.
    Everything else is the ``ProcessingInfo`` (its methods bound to it). Not copyable or picklable (wrapt's ``NotImplementedError``)."""

    def __init__(self, wrapped: Any, mode: Any) -> None:
        super().__init__(wrapped)
        self._self_mode = mode

    def get_image_processor(self, *args: Any, **kwargs: Any) -> ModeDefaultingImageProcessor:
        return ModeDefaultingImageProcessor(self.__wrapped__.get_image_processor(*args, **kwargs), self._self_mode)

    def _pinned_image_processor(self, *args: Any, **kwargs: Any) -> ModeDefaultingImageProcessor:
        """vLLM 0.33's ``MiniCPMOcrProcessingInfo._pinned_image_processor(downsample_mode)``
        (``vllm/model_executor/models/minicpm_ocr.py``), through which its own ``_compute_visual_tokens`` reads the
        image processor: the real one's result (the processor, or a copy of it with the request's mode set) behind a
        :class:`ModeDefaultingImageProcessor` with the mode that processor holds. A method of the wrapped object is
        bound to it, not to this view, so the view's ``get_image_processor`` would not be reached."""
        pinned = self.__wrapped__._pinned_image_processor(*args, **kwargs)
        return ModeDefaultingImageProcessor(pinned, getattr(pinned, "downsample_mode", self._self_mode))


class RecordingImageProcessor(wrapt.ObjectProxy):
    """A transformers MiniCPM-V 4.6 image processor behind a recorder: reading ``find_best_resize`` /
    ``get_refine_size`` gives a callable with the processor's own signature (``inspect.signature`` follows its
    ``__wrapped__``) that appends ``(name, passed: bool)`` -- whether the call bound ``downsample_mode`` -- to
    ``calls`` and returns the processor's result, so transformers' own errors surface. Everything else is the
    processor. What ``processor_downsample_mode``'s probe runs vLLM's ``_compute_visual_tokens`` against.
    Not copyable or picklable (wrapt's ``NotImplementedError``)."""

    def __init__(self, wrapped: Any, calls: list) -> None:
        super().__init__(wrapped)
        self._self_calls = calls

    def _self_recorder(self, name: str) -> Callable[..., Any]:
        attr = getattr(self.__wrapped__, name)
        calls = self._self_calls

        @functools.wraps(attr)
        def record(*args: Any, **kwargs: Any) -> Any:
            passed = PARAM in kwargs
            if not passed:
                try:
                    passed = PARAM in inspect.signature(attr).bind_partial(*args, **kwargs).arguments
                except TypeError:
                    passed = False
            calls.append((name, passed))
            return attr(*args, **kwargs)

        return record

    @property
    def find_best_resize(self) -> Callable[..., Any]:
        return self._self_recorder("find_best_resize")

    @property
    def get_refine_size(self) -> Callable[..., Any]:
        return self._self_recorder("get_refine_size")


class SlicedAsProcessor(wrapt.ObjectProxy):
    """transformers' ``MiniCPMV4_6Processor`` (``processing_minicpmv4_6.py``) as its ``replace_image_token`` /
    ``replace_video_token`` read it, with ``slice_mode`` and ``video_slice_mode`` (the gates on the slice rows, set
    from the image / video processor when the processor was built) both ``bool(slice_mode)``, the item's effective
    ``slice_mode``: a request's ``slice_mode: true`` over a model-level ``false`` slices the tensors (vLLM hands the
    request's kwargs to the image processor), so the text must show the slices too. Setting either sets it on the
    view only; everything else is the processor. Not copyable or picklable (wrapt's ``NotImplementedError``)."""

    def __init__(self, wrapped: Any, slice_mode: bool) -> None:
        super().__init__(wrapped)
        self._self_slice_mode = bool(slice_mode)
        self._self_video_slice_mode = bool(slice_mode)

    @property
    def slice_mode(self) -> bool:
        return self._self_slice_mode

    @slice_mode.setter
    def slice_mode(self, value: bool) -> None:
        self._self_slice_mode = value

    @property
    def video_slice_mode(self) -> bool:
        return self._self_video_slice_mode

    @video_slice_mode.setter
    def video_slice_mode(self, value: bool) -> None:
        self._self_video_slice_mode = value
