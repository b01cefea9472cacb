"""The four engine-side fixes together (``encoder_modes``, ``video_tower``, ``video_budget``, ``placeholder_guard``;
each one's own tests are in tests/fixes/test_<NAME>.py) against the real vLLM of this environment, without an engine:
the post-import hook under each mode, applying them all or nothing, and their probes (vLLM's own processor for the
bundled tiny checkpoint: :mod:`support.engine`).
"""

from __future__ import annotations

import pytest
import vllm_minicpm_hotfix
from vllm_minicpm_hotfix import hook, record
from vllm_minicpm_hotfix.fixes import _base, encoder_modes
from support.engine import (  # noqa: F401 - fixtures
    OURS, KILL_REQUESTS, family, image, fixes, process, pads_in_prompt, mconfig, vproc, stock_verdict,
)

# --------------------------------------------------------------------------------------------------------------------
# Modes, status, transactions
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_modes(m46, vproc, environment, mode, hotfix_mode):
    """The hook under each mode: ``off`` applies none of them (and a mismatching request passes the processor as
    stock), ``force`` all, ``auto`` exactly the ones pinned broken here; ``status()`` says so."""
    hotfix_mode(mode)
    try:
        hook.on_import(m46)
        vllm_minicpm_hotfix.status()  # the processor-path probes run (as at vLLM's first processor)
        st = record.current()
        for fix in OURS:
            entry = st.fixes[fix.NAME]
            want = {"off": False, "force": True, "auto": stock_verdict(fix.NAME, environment) == "broken"}[mode]
            assert entry.applied is want and _base.is_patched(fix, m46) is want, entry
            if mode == "auto" and not want:
                assert entry.verdict == "correct" and not _base.is_patched(fix, m46)
        if mode == "off":
            # processing needs the load fixes; apply just those to show the guard is not there
            _base.revert(m46)
            with fixes(m46):
                mm_kwargs, pads, _ = KILL_REQUESTS[family(environment[0])][0]
                out = process(vproc, {"image": [image(224, 224)]}, mm_kwargs)
                assert pads_in_prompt(vproc, out) == pads
    finally:
        _base.revert(m46)


def test_apply_is_all_or_nothing(m46, monkeypatch):
    """A failure setting the third of encoder_modes' attributes leaves all three as vLLM defined them."""
    before = {t: _base.resolve(m46, t) for t in encoder_modes.SETS}
    before = {t: getattr(o, a) for t, (o, a) in before.items()}

    def boom(original, owner):
        raise RuntimeError("boom")

    monkeypatch.setitem(encoder_modes.PATCHES, encoder_modes.SETS[2], boom)
    with pytest.raises(RuntimeError, match="boom"):
        encoder_modes.apply(m46)
    after = {t: getattr(*_base.resolve(m46, t)) for t in encoder_modes.SETS}
    assert after == before
    assert not _base.is_patched(encoder_modes, m46)


def test_probes_are_cheap_and_leave_vllm_alone(m46):
    import time

    for fix in OURS:
        t = time.perf_counter()
        fix.probe(m46)
        dt = time.perf_counter() - t
        assert dt < 2.0, (fix.NAME, dt)
        assert not _base.is_patched(fix, m46)
