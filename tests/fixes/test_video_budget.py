"""``video_budget`` against the real vLLM of this environment, without an engine: the frames budgeted per video against
the frames vLLM's loader samples, and a 32-frame video's embeddings against the encoder budget vLLM computes from it
(vLLM's own processor and model for the bundled tiny checkpoint: :mod:`support.engine`)."""

from __future__ import annotations

from vllm_minicpm_hotfix.fixes import video_budget
from support.engine import video, fixes, process, pads_in_prompt, model_config, mconfig, vproc


def test_video_budget_covers_the_frames_vllm_loads(m46, vproc, mconfig):
    """The encoder budget vLLM computes for a video (``get_max_video_tokens``: frames x largest frame) against the embeddings of a
    video of as many frames as vLLM's loader samples (32, ``VideoMediaIO``'s default): stock budgets 16 frames and
    the video exceeds it (vLLM answers 400: 'exceeds the pre-allocated encoder cache size'); fixed, it fits."""
    info = vproc.info
    loads = video_budget.loader_default_frames()
    seq_len = mconfig.max_model_len
    counts = {"image": 1, "video": 1}
    with fixes(m46):
        stock_frames = info.get_num_frames_with_most_features(seq_len, counts)
        stock_budget = info.get_max_video_tokens(seq_len, counts)
        out = process(vproc, {"video": [video(loads, 448, 252)]}, {})
        need = pads_in_prompt(vproc, out, "video")
    with fixes(m46, "video_budget"):
        frames = info.get_num_frames_with_most_features(seq_len, counts)
        budget = info.get_max_video_tokens(seq_len, counts)
    print(f"\nloader {loads} frames; stock {stock_frames} frames / {stock_budget} tokens; fixed {frames} frames / "
          f"{budget} tokens; a {loads}-frame 448x252 video needs {need}")
    assert (stock_frames, frames) == (16, loads)
    assert stock_budget < need <= budget


def test_video_budget_never_lowers_and_follows_media_io_kwargs(m46):
    from vllm.multimodal import MULTIMODAL_REGISTRY

    for num_frames, want in ((8, 16), (64, 64), (-1, 16)):
        info = MULTIMODAL_REGISTRY.create_processor(
            model_config(max_model_len=4096, media_io_kwargs={"video": {"num_frames": num_frames}})).info
        with fixes(m46, "video_budget"):
            assert info.get_num_frames_with_most_features(4096, {"video": 1}) == want, num_frames
    info = MULTIMODAL_REGISTRY.create_processor(model_config(max_model_len=700)).info
    with fixes(m46, "video_budget"):
        fit = info.get_max_video_frames(700 - info.get_max_image_tokens())
        assert fit < 16  # what fits bounds it, as in vLLM
        assert info.get_num_frames_with_most_features(700, {"image": 1, "video": 1}) == fit
