"""The hotfix's mode (``VLLM_MINICPM_HOTFIX``) and its status record (``vllm_minicpm_hotfix.record``) set for one
test or one block, through pytest's ``MonkeyPatch``: the environment is restored afterwards and the record is fresh
on both sides, so a test neither sees nor leaves another test's record."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

#: The variable the hotfix reads its mode from (``vllm_minicpm_hotfix.decision.ENV_VAR``).
ENV_VAR = "VLLM_MINICPM_HOTFIX"


def _setter(mp: pytest.MonkeyPatch) -> Callable[[str | None], None]:
    from vllm_minicpm_hotfix import record

    def set_mode(mode: str | None) -> None:
        """``VLLM_MINICPM_HOTFIX=mode`` (None: unset) and a fresh status record (the next ``record.current()``
        builds one under that mode)."""
        if mode is None:
            mp.delenv(ENV_VAR, raising=False)
        else:
            mp.setenv(ENV_VAR, mode)
        record._STATUS = None

    return set_mode


@contextlib.contextmanager
def hotfix_mode_set(mode: str | None) -> Iterator[Callable[[str | None], None]]:
    """A block under ``VLLM_MINICPM_HOTFIX=mode`` (None: unset) with a fresh status record; yields the setter, to
    change the mode again inside the block. On exit the variable is as before and the record fresh again."""
    from vllm_minicpm_hotfix import record

    with pytest.MonkeyPatch.context() as mp:
        set_mode = _setter(mp)
        try:
            set_mode(mode)
            yield set_mode
        finally:
            record._STATUS = None


@pytest.fixture
def hotfix_mode(monkeypatch) -> Iterator[Callable[[str | None], None]]:
    """``hotfix_mode(mode)``: ``VLLM_MINICPM_HOTFIX=mode`` (None: unset) and a fresh status record for the rest of
    the test (call it again to change the mode); after the test the variable is as before and the record fresh."""
    from vllm_minicpm_hotfix import record

    try:
        yield _setter(monkeypatch)
    finally:
        record._STATUS = None
