"""ocr_video_kwargs: MiniCPM-OCR videos on vLLM 0.33's own classes, each frame processed with options transformers'
image processor takes.

* Stock: vLLM 0.33's ``MiniCPMOcrMultiModalProcessor.process_videos`` hands transformers 5.24's OCR image processor
  ``disable_small_image_upsize`` (and two more names no released transformers has): every video request raises
  ``TypeError``, and the probe says broken on OCR's classes.
* With the fix (every fix applied as the hook applies them): the same videos give prompt ids equal to transformers'
  ``MiniCPMOcrProcessor`` (``placeholder_guard`` checks each video's tensors against its placeholders on the way), for
  small and sliced frames, per-request ``max_slice_nums``, ``slice_mode: false``, ``use_image_id: false`` and two
  videos; with every fix but this one, they still raise. A model built with ``small_image_upsize: "never"`` still
  upsizes its frames, as transformers' video processor does.
* The probe on 4.6's classes (no such override): correct, not applicable.

Placed on ``0.33.0:tf5.24.0`` (vLLM's own OCR classes with a transformers that reads an OCR checkpoint) and 0.33.0
(the probe on OCR's classes with its own transformers).
"""

from __future__ import annotations

import pytest
from support.backport47 import write_checkpoint
from support.hotfix import hotfix
from support.prompt import assert_all_equal, make_pair, video, vllm_ids, with_hotfix

from vllm_minicpm_hotfix.decision import State
from vllm_minicpm_hotfix.fixes import _base, names, ocr_video_kwargs

NARROW = "0.33.0:tf5.24.0"
pytestmark = pytest.mark.placed(NARROW)

UNEXPECTED = "unexpected keyword argument 'disable_small_image_upsize'"
#: ((frames, width, height), request kwargs)
VIDEOS = [((1, 56, 56), {}), ((2, 640, 480), {}), ((1, 1000, 300), {}), ((2, 640, 480), {"max_slice_nums": 1}),
          ((2, 640, 480), {"slice_mode": False}), ((2, 640, 480), {"use_image_id": False})]


@pytest.fixture(scope="module")
def ocr_view(m46):
    view = _base.member_modules(m46).get("MiniCPM-OCR")
    assert view is not None and view.__name__ == "vllm.model_executor.models.minicpm_ocr", view
    return view


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ocr") / "ckpt", member="ocr")


def _cases():
    cases = [(f"video {f}x{w}x{h}", "video", [video(w, h, f)], kw) for (f, w, h), kw in VIDEOS]
    return cases + [("two videos", "video", [video(640, 480, 1), video(56, 56, 2)], {})]


@pytest.mark.placed(NARROW, "0.33.0")
def test_probe_on_vllms_own_ocr_classes(ocr_view, m46):
    verdict = ocr_video_kwargs.probe(ocr_view)
    assert verdict.state is State.BROKEN and UNEXPECTED in verdict.reason, verdict
    own = ocr_video_kwargs.probe(m46)
    assert own.state is State.CORRECT and not own.applicable, own


def test_stock_fails_every_video(m46, ckpt):
    pair = make_pair(ckpt, {})
    for _, _, items, kwargs in _cases():
        with pytest.raises(TypeError, match=UNEXPECTED):
            vllm_ids(pair, "video", items, kwargs)


def test_video_prompt_ids_equal_transformers(m46, ckpt):
    pair = make_pair(ckpt, {})
    with with_hotfix(m46) as statuses:
        assert statuses[ocr_video_kwargs.NAME].models["MiniCPM-OCR"]["applied"], statuses[ocr_video_kwargs.NAME]
        assert_all_equal(pair, _cases())
    others = tuple(n for n in names() if n != ocr_video_kwargs.NAME)
    with hotfix(m46, "auto", fixes=others):
        with pytest.raises(TypeError, match=UNEXPECTED):
            vllm_ids(pair, "video", [video(56, 56, 1)], {})


def test_frames_upsized_as_transformers_whatever_the_model_level_option(m46, ckpt):
    """transformers' OCR video processor has no small-image option: a 56x56 frame is upsized as 4.6 upsizes it even
    when the server's ``small_image_upsize`` is ``"never"`` (which vLLM's image path reads)."""
    pair = make_pair(ckpt, {"small_image_upsize": "never"})
    with with_hotfix(m46):
        assert_all_equal(pair, [("video 1x56x56", "video", [video(56, 56, 1)], {})])
