"""Size the video encoder budget for the frames vLLM actually loads.

What breaks
-----------
vLLM sizes its encoder cache (and profiles the vision tower) at start-up from the largest item each modality can
bring. For MiniCPM-V videos that is ``MiniCPMVProcessingInfo.get_num_frames_with_most_features(seq_len, mm_counts)``
(``vllm/model_executor/models/minicpmv.py``, 0.22-0.33) frames of the largest frame size, and that method caps the
frames per video at ``_MAX_FRAMES_PER_VIDEO = 16``. But vLLM's own video loader (``VideoMediaIO``,
``vllm/multimodal/media/video.py``) samples up to ``num_frames=32`` frames from every ``video_url`` (or what
``--media-io-kwargs '{"video": {"num_frames": N}}'`` says). A video of 32 large frames then needs about twice the
profiled budget; where that exceeds both the profiled item size and ``--max-num-batched-tokens``, vLLM refuses the
request: ``VLLMValidationError: The decoder prompt contains a(n) video item with 1216 embedding tokens, which exceeds
the pre-allocated encoder cache size 672`` (measured with vLLM 0.28.0, the tiny checkpoint, a 48-frame 1280x720 mp4
and ``--max-num-batched-tokens 512``; with the real checkpoint's 448-pixel slices, 720p and larger 32-frame videos).

What the fix does
-----------------
It wraps ``get_num_frames_with_most_features`` on ``MiniCPMV4_6ProcessingInfo``: vLLM's answer, raised -- never
lowered -- to the number of frames the loader is configured to sample (``media_io_kwargs["video"]["num_frames"]`` of
the model's multimodal config, else ``VideoMediaIO``'s own default; ``-1``, all frames, leaves vLLM's answer), and
still bounded by what fits: ``get_max_video_frames(seq_len - max image tokens) // videos``, vLLM's own arithmetic
minus its 16-frame cap. The encoder budget, the encoder cache and the start-up profiling (a dummy video of that many
largest frames) all follow from it, so a loaded video fits the budget vLLM reserved for it.

The decision
------------
:func:`probe` runs the class's ``get_num_frames_with_most_features`` on a stand-in ``MiniCPMV4_6ProcessingInfo``
(created without ``__init__``: one token per frame, no images, a ``seq_len`` of 100,000, one video, the default
media kwargs) and compares it with ``VideoMediaIO``'s default ``num_frames``: ``broken`` if it profiles fewer frames
than the loader loads (0.22-0.33: 16 < 32), ``correct`` otherwise, ``undetermined`` if the loader's default cannot be
read or the stand-in cannot run, ``unrecognised`` if the class or method is not there.

Upstream
--------
none known.

Remove when
-----------
its probe sees stock ``get_num_frames_with_most_features`` budget at least the frames ``VideoMediaIO`` loads by
default (every release measured so far: 16 against 32) on every release the hotfix supports.
"""

from __future__ import annotations

import inspect
import types
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import INFO_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, wrap

NAME = "video_budget"
LABEL = "video encoder budget (frames profiled = frames loaded)"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR inherits the 4.6 methods this fix sets
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use
METHOD = "get_num_frames_with_most_features"

PROBE_SEQ_LEN = 100_000


def loader_default_frames() -> int:
    """``VideoMediaIO.__init__``'s default ``num_frames`` (32 in vLLM 0.22-0.33). Raises if it cannot be read."""
    from vllm.multimodal.media.video import VideoMediaIO

    default = inspect.signature(VideoMediaIO.__init__).parameters["num_frames"].default
    if not isinstance(default, int):
        raise TypeError(f"VideoMediaIO num_frames default is {default!r}")
    return default


def loader_frames(info: Any) -> int | None:
    """Frames vLLM's video loader samples per video for this model: ``media_io_kwargs["video"]["num_frames"]``, else
    the loader's default. None for "all frames" (``-1`` or less) or when it cannot be told."""
    try:
        model_config = info.ctx.model_config
        mm_config = getattr(model_config, "multimodal_config", None)
        if mm_config is None and callable(getattr(model_config, "get_multimodal_config", None)):
            mm_config = model_config.get_multimodal_config()
        video_kwargs = (getattr(mm_config, "media_io_kwargs", None) or {}).get("video") or {}
        frames = video_kwargs.get("num_frames")
        if frames is None:
            frames = loader_default_frames()
        frames = int(frames)
    except Exception:  # noqa: BLE001 - no budget change rather than a broken start-up
        return None
    return frames if frames > 0 else None


def get_num_frames(wrapped: Any, instance: Any, call: Call) -> int:
    """Around ``get_num_frames_with_most_features(self, seq_len: int, mm_counts: Mapping[str, int]) -> int`` (frames
    per video to budget for; see the module docstring). Never returns less than vLLM's own answer."""
    frames = wrapped(*call.args, **call.kwargs)
    want = loader_frames(instance)
    if want is None or frames >= want:
        return frames
    mm_counts = call["mm_counts"]
    image_tokens = instance.get_max_image_tokens() * mm_counts.get("image", 0)
    fit = instance.get_max_video_frames(call["seq_len"] - image_tokens) // max(mm_counts.get("video", 0), 1)
    return max(frames, min(want, fit))


PATCHES = {f"{INFO_CLASS}.{METHOD}": wrap(get_num_frames, bind=True)}


def probe(module: ModuleType) -> Verdict:
    """Does the 4.6 processing info budget as many frames per video as vLLM's loader loads? Never raises; leaves
    ``module`` unchanged."""
    cls = getattr(module, INFO_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, METHOD, None)):
        return Verdict(State.UNRECOGNISED, f"{module.__name__} has no {INFO_CLASS}.{METHOD}", applicable=False)
    try:
        loads = loader_default_frames()
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"vLLM's video loader default not readable: {type(exc).__name__}: {exc}")
    try:
        info = object.__new__(cls)
        mm_config = types.SimpleNamespace(media_io_kwargs={})
        info.ctx = types.SimpleNamespace(model_config=types.SimpleNamespace(multimodal_config=mm_config))
        info.get_max_image_tokens = lambda: 0
        info.get_max_video_frames = lambda max_tokens: max_tokens  # one token per frame
        budgeted = int(getattr(cls, METHOD)(info, PROBE_SEQ_LEN, {"video": 1}))
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"probe failed in {INFO_CLASS}.{METHOD}: {type(exc).__name__}: {exc}")
    if budgeted < loads:
        return Verdict(State.BROKEN, f"vLLM budgets {budgeted} frames per video but its video loader samples up to "
                                     f"{loads}: such videos can exceed the encoder cache (HTTP 400)")
    return Verdict(State.CORRECT, f"{budgeted} frames per video budgeted, the video loader samples up to {loads}")
