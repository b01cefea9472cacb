"""The fixes applied to the imported vLLM module for one block, as the post-import hook would apply them."""

from __future__ import annotations

import contextlib

from support.environment import hotfix_mode_set

#: What stock vLLM raised in the original report (case-01, a main build that stacked nothing).
SEED_ERA_ERROR = "There is no module or parameter named 'vit_merger.self_attn.k_proj' in MiniCPMV4_6ForConditionalGeneration"


@contextlib.contextmanager
def hotfix(m46, mode: str, fixes: tuple[str, ...] = ("qkv_loader",)):
    """Apply the named fixes (``vllm_minicpm_hotfix.fixes`` NAMEs, in registry order; ``None`` for all) to the
    imported module as the post-import hook would under ``VLLM_MINICPM_HOTFIX=mode``; yields the first one's
    :class:`~vllm_minicpm_hotfix.record.FixStatus` (or a dict NAME -> FixStatus when several are named); reverts on
    exit so the next test sees stock vLLM again."""
    from vllm_minicpm_hotfix.fixes import REGISTRY, _base

    chosen = [f for f in REGISTRY if fixes is None or f.NAME in fixes]
    unknown = set(fixes or ()) - {f.NAME for f in chosen}
    assert not unknown, f"unknown fixes {unknown}"
    with hotfix_mode_set(mode):
        try:
            out = {}
            try:
                for fix in chosen:
                    out[fix.NAME] = _base.run(fix, m46)
                _base.deferred.resolve_group()  # the processor-path probes, as vLLM's first processor would run them
            except BaseException:
                _base.revert(m46)
                raise
            yield out[chosen[0].NAME] if fixes is not None and len(chosen) == 1 else out
        finally:
            _base.revert(m46)
