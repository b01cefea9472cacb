"""Reading the hotfix's log in tests: the one summary line per process (``record.summary_line``)."""

from __future__ import annotations

from vllm_minicpm_hotfix import record
from vllm_minicpm_hotfix.fixes import names


def summaries(log: str) -> list[dict]:
    """Every summary line in ``log``, parsed (:func:`vllm_minicpm_hotfix.record.parse_summary`)."""
    return record.parse_summary(log, names())


def patched_pids(log: str, fix: str) -> list[str]:
    """The pids whose summary line says ``fix`` (a NAME) was applied, as strings, in log order."""
    return [str(s["pid"]) for s in summaries(log) if fix in s["applied"]]
