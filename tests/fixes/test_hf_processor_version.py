"""``hf_processor_version`` on the installed vLLM's own multimodal processor (no engine): on 0.23.0 stock vLLM's
processor raises the ``version`` AttributeError on any image; with the fix the prompt equals the one transformers'
processor builds."""

from __future__ import annotations

from support.hotfix import hotfix
from support.placement import vllm_release
from support.prompt import (  # noqa: F401 - fixtures
    checkpoints, image, compare, family, pairs, _one_torch_thread, _report_times, with_hotfix,
)


def test_stock_version_crash(m46, pairs, family):
    """0.23.0: stock vLLM's processor raises the ``version`` AttributeError on any image (start-up profiling dies
    the same way); hf_processor_version makes it transformers' own processor. Elsewhere stock processes images."""
    pair = pairs("tiny")
    with hotfix(m46, "auto", fixes=("processor_downsample_mode",)):
        outcome, detail = compare(pair, "image", [image(64, 64)], {})
    if vllm_release() == "0.23.0":
        assert outcome == "AttributeError" and "has no attribute 'version'" in detail, detail
    else:
        assert outcome == "equal", detail
    with with_hotfix(m46):
        assert compare(pair, "image", [image(64, 64)], {})[0] == "equal"
