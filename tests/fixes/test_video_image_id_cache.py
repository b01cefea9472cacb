"""``video_image_id_cache`` on the installed vLLM's own multimodal processor (no engine): items served from vLLM's
processor cache get their index in the new prompt, token for token as transformers' ``MiniCPMV4_6Processor`` builds
that prompt (real processor geometry; every fix, ``auto``). The stock outcome of the same cached-video prompts, per
release, is pinned by tests/prompt/test_prompt_conformance.py (``STOCK``, case "cached video").

Placement: every environment (cheap: no engine; one vLLM processor with a processor cache)."""

from __future__ import annotations

from support.prompt import (  # noqa: F401 - fixtures
    cached_prompts, checkpoints, hf_ids, image, pairs, summary, timed, vllm_ids, with_hotfix, _one_torch_thread,
    _report_times,
)


def test_cached_items(m46, pairs):
    """Items served from vLLM's processor cache get their index in the new prompt (images and videos)."""
    pair = pairs("real", cache=True)
    with timed("cache"), with_hotfix(m46):
        got, want = cached_prompts(pair)
        assert got == want, (summary(pair.tokenizer, got), summary(pair.tokenizer, want))
        c, d = image(365, 211), image(449, 449)
        vllm_ids(pair, "image", [c], {})
        assert vllm_ids(pair, "image", [d, c], {}) == hf_ids(pair, "image", [d, c], {})
