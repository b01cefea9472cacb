"""``video_loader``: a ``video_url`` of a 4.6 checkpoint without a ``video_processor_type`` reaches vLLM's video loader.

vLLM's chat front end asks ``get_video_processor_cls_name(model_config)`` for the tiny checkpoint's video processor
name (transformers' ``save_pretrained`` writes no ``preprocessor_config.json`` for it) and loads the request's video
through ``MediaConnector.fetch_video(url, video_processor=name)``, as ``ChatParser``'s tracker does for every
``video_url``. The video is an mp4 written here by OpenCV (the library of vLLM's default loader), sent as a base64
data URL. The reference is independent of the fix: the frames OpenCV itself decodes from the same file (RGB), and
stock vLLM's answer with the operator's workaround ``--media-io-kwargs '{"video": {"video_backend": "opencv"}}'``.

Stock vLLM 0.24-0.30 with transformers >= 5.19 raises ``TypeError: unhashable type: 'dict'`` there (the pinned
``broken`` rows of tests/support/expected.py); with the fix the frames are the reference's. Elsewhere the stock answer is the
reference already and the fix is not applied. tests/e2e/test_video_serve.py sends the same video through real
``vllm serve``. Cheap (no engine): every environment.
"""

from __future__ import annotations

import importlib
import inspect
import json
import types
from pathlib import Path

from support import expected as table
import numpy as np
import pytest
from support.hotfix import hotfix
from support.paths import TINY
from vllm_minicpm_hotfix.fixes import video_loader
from support.video import WORKAROUND, FRAMES, WIDTH, HEIGHT, write_video, decoded_frames, data_url


def connector_cls():
    for name in ("vllm.multimodal.media.connector", "vllm.multimodal.utils"):
        try:
            cls = getattr(importlib.import_module(name), "MediaConnector", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise AssertionError("no vLLM MediaConnector found")


def processor_name(model: Path = TINY):
    """What vLLM's chat front end takes the checkpoint's video processor name to be (None where it asks nothing)."""
    proc = importlib.import_module("vllm.transformers_utils.processor")
    ask = getattr(proc, "get_video_processor_cls_name", None)
    if ask is None:
        return None
    return ask(types.SimpleNamespace(model=str(model), revision=None))


def fetch(url: str, media_io_kwargs: dict | None = None, model: Path = TINY) -> np.ndarray:
    """The frames vLLM's ``MediaConnector.fetch_video`` loads from ``url`` as the chat front end calls it."""
    connector = connector_cls()(media_io_kwargs=media_io_kwargs)
    kwargs = {}
    if "video_processor" in inspect.signature(connector.fetch_video).parameters:
        kwargs["video_processor"] = processor_name(model)
    out = connector.fetch_video(url, **kwargs)
    media = getattr(out, "media", out)  # 0.28+: MediaWithBytes
    frames, _meta = media
    return np.asarray(frames)


@pytest.fixture(scope="module")
def video(tmp_path_factory) -> Path:
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4")


@pytest.fixture(scope="module")
def reference(video) -> np.ndarray:
    frames = decoded_frames(video)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3), frames.shape
    return frames


def test_workaround_loads_the_decoded_frames(video, reference):
    """The reference path: stock vLLM with ``video_backend`` named loads exactly what OpenCV decodes."""
    got = fetch(data_url(video), WORKAROUND)
    np.testing.assert_array_equal(got, reference)


def test_default_flags_stock_fails_where_pinned_and_the_fix_loads_the_frames(m46, environment, video, reference):
    stock_broken = table.verdict(video_loader.NAME, environment) == "broken"
    if stock_broken:
        with pytest.raises(TypeError, match="unhashable type: 'dict'"):
            fetch(data_url(video))
    else:
        np.testing.assert_array_equal(fetch(data_url(video)), reference)
    with hotfix(m46, "auto", fixes=(video_loader.NAME,)) as entry:
        assert entry.applied is stock_broken, entry
        np.testing.assert_array_equal(fetch(data_url(video)), reference)
        assert video_loader.probe(m46).state.value == "correct"


def test_another_models_answer_is_left_to_vllm(m46, environment, tmp_path):
    """A checkpoint of a model type outside the fix's ``MODELS`` gets vLLM's own answer, fix applied or not."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    other = next((t for t, v in VIDEO_PROCESSOR_MAPPING_NAMES.items()
                  if isinstance(v, dict) and t not in video_loader.MODEL_TYPES), None)
    assert other is not None or table.verdict(video_loader.NAME, environment) != "broken", \
        "transformers maps no other model type to a dict: nothing to leave alone"
    other = other or "llava"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": other}))
    (tmp_path / "preprocessor_config.json").write_text("{}")
    stock = processor_name(tmp_path)
    with hotfix(m46, "force", fixes=(video_loader.NAME,)):
        assert processor_name(tmp_path) == stock
