"""Hand transformers' MiniCPM-V 4.6 image processor the ``downsample_mode`` vLLM forgot to pass.

What breaks
-----------
From transformers 5.21.0 (5.20.2 is the last without it: the signatures read in each wheel 5.19.0-5.25.0 on the
index), ``MiniCPMV4_6ImageProcessor.find_best_resize(image_size, scale_resolution, patch_size,
downsample_mode, allow_upscale=False)`` and ``get_refine_size(image_size, grid, scale_resolution, patch_size,
downsample_mode, allow_upscale=False)`` take a required ``downsample_mode`` and round each side to a multiple of
``patch_size * 4`` in ``"16x"`` mode and ``patch_size * 2`` in ``"4x"`` mode (transformers <= 5.20: always
``patch_size * 4``, no such argument). The image processor itself passes it when it resizes (``_preprocess``).
vLLM's ``MiniCPMV4_6ProcessingInfo._compute_visual_tokens`` (``vllm/model_executor/models/minicpmv4_6.py``, the same
body in every release 0.22-0.33) calls both *without* it::

    best_size = image_processor.find_best_resize(hf_image_size, scale_res, patch_size, allow_upscale=True)
    ...
    refine_size = image_processor.get_refine_size(hf_image_size, grids, scale_res, patch_size, allow_upscale=True)

so with transformers >= 5.21 every image (and video frame) placeholder count -- the dummy-input profiling at engine
start-up included -- raises ``TypeError: MiniCPMV4_6ImageProcessor.find_best_resize() missing 1 required positional
argument: 'downsample_mode'``. vLLM 0.31-0.33 pin transformers below that (< 5.20, < 5.21); 0.22-0.30 do not; 0.34
allows 5.21-5.22 and passes ``downsample_mode`` itself where transformers is at least 5.21.

What the fix does
-----------------
It wraps ``MiniCPMV4_6ProcessingInfo._compute_visual_tokens`` (vLLM's own method, patched on vLLM's class; transformers
is not touched). The wrapper resolves the mode exactly as vLLM's body does --
``self._get_downsample_mode(downsample_mode)``: the ``downsample_mode`` argument vLLM threads in from the request's
``mm_processor_kwargs`` (``MiniCPMV4_6MultiModalProcessor._resolve_downsample_mode``), else the processor's own
``downsample_mode`` (which carries the model-level ``mm_processor_kwargs``) -- then runs vLLM's *original* body against
a per-call view of ``self`` (:class:`._proxies.ModeInfoView`) whose ``get_image_processor()`` returns a view of the
real image processor (:class:`._proxies.ModeDefaultingImageProcessor`). That view adds ``downsample_mode=<resolved
mode>`` to ``find_best_resize`` / ``get_refine_size`` calls whose target signature has the parameter and that did
not bind it; everything else (``get_sliced_grid``, ``patch_size``, ...) is the real processor.
So vLLM's count is computed by vLLM's own arithmetic on transformers' own sizes for the same mode the image processor
resizes with (vLLM calls it as ``image_processor([image], **mm_kwargs)``, the same ``mm_kwargs``), and equals the number
of ``<|image_pad|>`` tokens transformers' ``MiniCPMV4_6Processor`` inserts. The views are per call: no shared state is
mutated, so concurrent requests with different modes do not interfere.

The decision
------------
:func:`probe` decides by behaviour and signatures, never by version strings:

1. vLLM side recognised: ``MiniCPMV4_6ProcessingInfo`` with a ``_compute_visual_tokens`` -- else ``unrecognised``.
2. transformers side: the installed ``MiniCPMV4_6ImageProcessor`` (and the PIL variant where importable) -- does
   ``find_best_resize`` or ``get_refine_size`` take a ``downsample_mode`` parameter? If not, the fix is *not
   applicable* (passing it would itself raise ``TypeError``) and not needed: ``correct``.
3. vLLM's behaviour: run vLLM's own ``_compute_visual_tokens`` on a stand-in ``ProcessingInfo`` (created without
   ``__init__``; no model, config or tokenizer needed) whose image processor is the real transformers class (also
   created without ``__init__``; its class defaults ``patch_size`` 14, ``scale_resolution`` 448, ``max_slice_nums`` 9
   suffice) behind a recorder (:class:`._proxies.RecordingImageProcessor`), for one unsliced and one sliced size.
   ``broken`` if it raises the ``TypeError`` naming ``downsample_mode``, or if it calls a method that takes
   ``downsample_mode`` without passing it (a transformers that made the argument optional would silently round every
   ``"4x"`` image as ``"16x"``: a misaligned count); ``correct`` if vLLM passes it itself; ``undetermined`` if
   anything else goes wrong.

``VLLM_MINICPM_HOTFIX``: ``auto`` applies on ``broken``; ``off`` never; ``force`` applies wherever the fix is
*applicable and safe* -- vLLM's layout recognised and transformers' methods take ``downsample_mode`` -- even when the
probe found vLLM correct or could not tell (the wrapper only adds the argument where vLLM did not bind it, so on a vLLM
that passes it the patch is a no-op). ``force`` does *not* patch where transformers' methods lack the parameter or
vLLM's layout is unknown: there the wrapper could only do nothing or raise, and vLLM is better left exactly as shipped.

Upstream
--------
none known. vLLM 0.34.0's ``minicpmv4_6.py`` and ``minicpm_ocr.py`` pass ``downsample_mode`` themselves where
transformers is at least 5.21 (``RESIZE_TAKES_DOWNSAMPLE_MODE``); the change that did so was not found.

Remove when
-----------
its probe sees vLLM's own ``_compute_visual_tokens`` pass ``downsample_mode`` to every ``find_best_resize`` /
``get_refine_size`` call whose signature takes it (``correct``, as on 0.34.0), on every release and transformers the
hotfix supports together: once 0.22-0.30 (no transformers cap) and 0.31-0.33 with a transformers forced past their pin
are no longer supported.

"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from .. import decision
from ..decision import Verdict
from ._base import INFO_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, on_import, wrap

NAME = "processor_downsample_mode"
LABEL = "image placeholder count (downsample_mode)"
MODELS = (V46, V47, VOCR)  # vLLM 0.33's own MiniCPM-OCR body omits the mode as 4.6's does
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use
METHOD = "_compute_visual_tokens"
#: transformers' image-processor methods vLLM calls without the mode.
TARGETS = ("find_best_resize", "get_refine_size")
PARAM = "downsample_mode"
#: transformers modules holding the 4.6 image processors, torchvision backend first: AutoImageProcessor's default, the
#: class vLLM gets wherever torchvision is installed (the probe judges the first that imports).
TRANSFORMERS_CLASSES = (
    ("transformers.models.minicpmv4_6.image_processing_minicpmv4_6", "MiniCPMV4_6ImageProcessor"),
    ("transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6", "MiniCPMV4_6ImageProcessorPil"),
)
#: (width, height) fed to vLLM's method by the probe: unsliced (find_best_resize with allow_upscale) and sliced
#: (find_best_resize + get_refine_size) at the class default scale_resolution 448.
PROBE_SIZES = ((64, 48), (1344, 896))

# vLLM's ImageSize is a NamedTuple(width, height); its body only reads .width / .height.
_ImageSize = collections.namedtuple("_ImageSize", "width height")


# --------------------------------------------------------------------------------------------------------------------
# The wrapper.
# --------------------------------------------------------------------------------------------------------------------


def _resolve_mode(info: Any, requested: Any) -> Any:
    """The mode vLLM's body resolves: ``MiniCPMV4_6ProcessingInfo._get_downsample_mode`` (0.22-0.33) where present,
    else the argument, else the image processor's ``downsample_mode``, else ``"16x"``."""
    resolver = getattr(info, "_get_downsample_mode", None)
    if callable(resolver):
        return resolver(requested)
    if requested is not None:
        return requested
    return getattr(info.get_image_processor(), PARAM, "16x")


def compute_visual_tokens(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around vLLM's ``MiniCPMV4_6ProcessingInfo._compute_visual_tokens(self, image_size: ImageSize, max_slice_nums:
    int | None = None, downsample_mode: str | None = None) -> tuple[list[int], int, int]`` -- ``(grids [rows, cols]
    or [0, 0], source_image_visual_tokens, patch_visual_tokens)``: vLLM's body run on a
    :class:`._proxies.ModeInfoView` of ``self`` with the resolved mode (see the module docstring). Raises what vLLM's
    body raises."""
    from ._proxies import ModeInfoView

    mode = _resolve_mode(instance, call.get(PARAM))
    args, kwargs = call.replaced(**({PARAM: mode} if PARAM in call.parameters else {}))
    function = getattr(wrapped, "__func__", None) or wrapped.__wrapped__  # bound to the instance, or called on the class
    return function(ModeInfoView(instance, mode), *args[1:], **kwargs)


#: vLLM 0.33's own MiniCPM-OCR processing info, which overrides the method with a body of its own that omits the mode
#: in the same three calls (``vllm/model_executor/models/minicpm_ocr.py``).
OCR_INFO = "vllm.model_executor.models.minicpm_ocr:MiniCPMOcrProcessingInfo"

PATCHES = {
    f"{INFO_CLASS}.{METHOD}": wrap(compute_visual_tokens, bind=True),
    f"{OCR_INFO}.{METHOD}": on_import(lambda old, owner: wrap(compute_visual_tokens, bind=True)
                                      if METHOD in vars(owner) else None),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe.
# --------------------------------------------------------------------------------------------------------------------


def transformers_image_processor_classes() -> Iterator[type]:
    """The installed transformers' MiniCPM-V 4.6 image-processor classes that import (none before 5.7), in the order
    of :data:`TRANSFORMERS_CLASSES`, each module imported only when the caller asks for the next class."""
    import importlib

    for mod_name, cls_name in TRANSFORMERS_CLASSES:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name, None)
        except Exception:  # a missing backend (torchvision / PIL) or no such model in this transformers
            continue
        if isinstance(cls, type):
            yield cls


def takes_mode(cls: type) -> dict[str, str]:
    """For each of :data:`TARGETS` that ``cls`` defines with a ``downsample_mode`` parameter: ``"required"`` or
    ``"optional"``. Empty if none takes it."""
    out = {}
    for name in TARGETS:
        try:
            params = inspect.signature(getattr(cls, name)).parameters
        except (AttributeError, TypeError, ValueError):
            continue
        if PARAM in params:
            out[name] = "required" if params[PARAM].default is inspect.Parameter.empty else "optional"
    return out


def probe(module: ModuleType) -> Verdict:
    """Decide whether vLLM's placeholder count omits a ``downsample_mode`` the installed transformers needs.

    Args:
        module: the imported ``vllm.model_executor.models.minicpmv4_6``.

    Returns:
        A :class:`~vllm_minicpm_hotfix.decision.Verdict` (see the module docstring for the states). Never raises;
        leaves ``module`` and transformers unchanged. Costs well under a millisecond plus the import of transformers' 4.6 image-processor
        modules (already imported by vLLM in practice).
    """
    info_cls = getattr(module, INFO_CLASS, None)
    if not isinstance(info_cls, type) or not callable(getattr(info_cls, METHOD, None)):
        return Verdict(
            decision.State.UNRECOGNISED, f"{module.__name__} has no {INFO_CLASS}.{METHOD}", applicable=False
        )
    # The class judged is the first that imports: the one transformers' AutoImageProcessor hands vLLM (the torchvision
    # backend, or the PIL one where torchvision is missing), as _stand_ins.hf_processor picks it. The PIL
    # module, which vLLM never imports where torchvision is installed, is then not imported by the probe either.
    try:
        ip_cls = next(transformers_image_processor_classes(), None)
    except Exception as exc:  # pragma: no cover - importlib itself failing
        return Verdict(decision.State.UNDETERMINED, f"transformers not inspectable: {exc!r}", applicable=False)
    if ip_cls is None:
        return Verdict(
            decision.State.UNRECOGNISED,
            "the installed transformers has no MiniCPM-V 4.6 image processor (needs transformers >= 5.7)",
            applicable=False,
        )
    kinds = takes_mode(ip_cls)
    if not kinds:
        return Verdict(
            decision.State.CORRECT,
            f"not needed: transformers' {ip_cls.__name__}.find_best_resize/get_refine_size take no {PARAM}",
            applicable=False,
        )
    described = ", ".join(f"{ip_cls.__name__}.{m}({PARAM}: {k})" for m, k in kinds.items())

    try:
        from ._proxies import RecordingImageProcessor

        calls: list = []
        real = ip_cls.__new__(ip_cls)
        recorder = RecordingImageProcessor(real, calls)
        info = info_cls.__new__(info_cls)
        # An instance attribute shadows the class's get_image_processor on this throw-away object only.
        info.__dict__["get_image_processor"] = lambda *a, **k: recorder
        original = getattr(info_cls, METHOD)
        method_takes_mode = PARAM in inspect.signature(original).parameters
    except Exception as exc:
        return Verdict(
            decision.State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}", applicable=True
        )
    try:
        for width, height in PROBE_SIZES:
            kwargs = {PARAM: "16x"} if method_takes_mode else {}
            original(info, _ImageSize(width, height), None, **kwargs)
    except TypeError as exc:
        if PARAM in str(exc):
            return Verdict(
                decision.State.BROKEN,
                f"vLLM's {INFO_CLASS}.{METHOD} calls transformers' {described} without it: "
                f"TypeError: {exc}",
                applicable=True,
            )
        return Verdict(
            decision.State.UNDETERMINED, f"probe failed inside vLLM's {METHOD}: TypeError: {exc}", applicable=True
        )
    except Exception as exc:
        return Verdict(
            decision.State.UNDETERMINED,
            f"probe failed inside vLLM's {METHOD}: {type(exc).__name__}: {exc}",
            applicable=True,
        )
    missing = sorted({name for name, passed in calls if not passed and name in kinds})
    if missing:
        return Verdict(
            decision.State.BROKEN,
            f"vLLM's {INFO_CLASS}.{METHOD} calls {', '.join(missing)} without {PARAM}; transformers' {described} "
            f"then rounds every image with its default mode, so '4x' counts are misaligned",
            applicable=True,
        )
    if not calls:
        return Verdict(
            decision.State.UNDETERMINED,
            f"vLLM's {METHOD} never called {'/'.join(TARGETS)} on the probe sizes",
            applicable=True,
        )
    return Verdict(
        decision.State.CORRECT, f"not needed: vLLM's {METHOD} passes {PARAM} itself ({described})", applicable=True
    )

