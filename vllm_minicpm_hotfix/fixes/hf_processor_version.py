"""vLLM 0.23.0 cannot start a MiniCPM-V 4.6 model: its processor wraps transformers' in a legacy one.

What breaks
-----------
vLLM 0.23.0's ``MiniCPMVProcessingInfo.get_hf_processor`` (``vllm/model_executor/models/minicpmv.py``, inherited by
``MiniCPMV4_6ProcessingInfo``) wraps the processor transformers built in vLLM's vendored
``vllm.transformers_utils.processors.minicpmv.MiniCPMVProcessor`` (2.x-4.5), whose ``__init__`` reads
``image_processor.version``; transformers' ``MiniCPMV4_6ImageProcessor`` has no ``version``. Every call raises
``AttributeError: 'MiniCPMV4_6ImageProcessor' object has no attribute 'version'`` -- first during the start-up
profiling, so ``vllm serve`` / ``LLM(...)`` die before serving anything. 0.22 returned transformers' processor;
0.24+ gives the 4.6 class its own ``get_hf_processor`` doing so (vLLM PR #44980).

What the fix does
-----------------
Sets ``MiniCPMV4_6ProcessingInfo.get_hf_processor`` to what 0.24.0 defines there: transformers' own processor from
``self.ctx.get_hf_processor(**kwargs)``, with the image processor's NumPy ``mean`` / ``std`` / ``image_mean`` /
``image_std`` turned into lists (as vLLM does in every release).

The decision
------------
Runs the installed ``MiniCPMV4_6ProcessingInfo.get_hf_processor`` on a stand-in (created without ``__init__``)
whose ``ctx.get_hf_processor()`` returns a real transformers ``MiniCPMV4_6Processor`` (real image and video
processors, a tiny in-memory tokenizer): ``broken`` if it raises (the ``version`` error) or returns anything but
that processor, ``correct`` if it returns it. Costs ~10 ms (building the stand-in processor).

Upstream
--------
vllm-project/vllm#44980: 0.24+ give the 4.6 class its own ``get_hf_processor`` returning transformers' processor.

Remove when
-----------
its probe sees the installed ``get_hf_processor`` return transformers' ``MiniCPMV4_6Processor`` on every release the
hotfix supports: once 0.23.0, the one release that raises, is no longer supported.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from . import _stand_ins
from ._base import INFO_CLASS, PROCESSOR_PATH, V46, V47, replace

NAME = "hf_processor_version"
LABEL = "4.6 processor (no legacy MiniCPMVProcessor wrapper)"
MODELS = (V46, V47)
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use


def get_hf_processor(self: Any, **kwargs: object) -> Any:
    """``MiniCPMV4_6ProcessingInfo.get_hf_processor(self, **kwargs) -> transformers.ProcessorMixin`` as vLLM 0.24.0
    defines it: ``self.ctx.get_hf_processor(**kwargs)`` with NumPy normalisation constants turned into lists."""
    hf_processor = self.ctx.get_hf_processor(**kwargs)
    image_processor = getattr(hf_processor, "image_processor", None)
    if image_processor is not None:
        import numpy as np

        for attr in ("mean", "std", "image_mean", "image_std"):
            value = getattr(image_processor, attr, None)
            if isinstance(value, np.ndarray):
                setattr(image_processor, attr, value.tolist())
    return hf_processor


PATCHES = {f"{INFO_CLASS}.get_hf_processor": replace(get_hf_processor)}


def probe(module: ModuleType) -> Verdict:
    """Whether the installed ``get_hf_processor`` hands back transformers' own 4.6 processor (see the module
    docstring). Never raises; leaves ``module`` unchanged."""
    info_cls = getattr(module, INFO_CLASS, None)
    if not isinstance(info_cls, type) or not callable(getattr(info_cls, "get_hf_processor", None)):
        return Verdict(State.UNRECOGNISED, f"{module.__name__} has no {INFO_CLASS}.get_hf_processor", applicable=False)
    try:
        native = _stand_ins.hf_processor()
        info = _stand_ins.info(info_cls, native)
    except Exception as exc:
        return Verdict(State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    try:
        got = info_cls.get_hf_processor(info)
    except AttributeError as exc:
        return Verdict(State.BROKEN, f"{INFO_CLASS}.get_hf_processor raises AttributeError: {exc}")
    except Exception as exc:
        return Verdict(State.BROKEN, f"{INFO_CLASS}.get_hf_processor raises {type(exc).__name__}: {exc}")
    if got is not native:
        return Verdict(
            State.BROKEN,
            f"{INFO_CLASS}.get_hf_processor returns a {type(got).__name__}, not transformers' "
            f"{type(native).__name__}",
        )
    return Verdict(State.CORRECT, f"{INFO_CLASS}.get_hf_processor returns transformers' {type(native).__name__}")
