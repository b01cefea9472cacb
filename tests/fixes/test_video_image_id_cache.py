"""``video_image_id_cache`` on the installed vLLM's own multimodal processor (no engine): items served from vLLM's processor cache get their index in the new prompt, as transformers' processor numbers them (images and videos)."""

from __future__ import annotations

from support.prompt import _cached_prompts, checkpoints, image, vllm_ids, hf_ids, summary, pairs, _one_torch_thread, _report_times, timed, with_hotfix  # noqa: F401 - fixtures


def test_cached_items(m46, pairs):
    """Items served from vLLM's processor cache get their index in the new prompt (images and videos)."""
    pair = pairs("real", cache=True)
    with timed("cache"), with_hotfix(m46):
        got, want = _cached_prompts(pair)
        assert got == want, (summary(pair.tokenizer, got), summary(pair.tokenizer, want))
        c, d = image(365, 211), image(449, 449)
        vllm_ids(pair, "image", [c], {})
        assert vllm_ids(pair, "image", [d, c], {}) == hf_ids(pair, "image", [d, c], {})
