"""How ``verify`` prints: the header lines as each fact becomes known (vLLM's import takes a while, so they are
printed -- and flushed -- as they come), the result table and the timings. Only formatting."""

from __future__ import annotations

import sys

from .._util import fmt_bytes, print_table, vllm_distributions
from .checkpoint import Checkpoint
from .judge import Row
from .build import Built


def _line(label: str, text: str) -> None:
    print(f"  {label:<10}  {text}")
    sys.stdout.flush()


def header(ckpt: Checkpoint, *, device: str, dtype: str, stored: str | None) -> None:
    """The title, the checkpoint and the vLLM about to be used (``stored``: the dtype the vit_merger tensors are
    stored in, when ``dtype`` was taken from it)."""
    print("vllm-minicpm-hotfix verify")
    files = f"{len(ckpt.files)} safetensors file{'s' if len(ckpt.files) > 1 else ''}" + (
        " (sharded)" if ckpt.sharded else "")
    dists = vllm_distributions()
    vllm = ", ".join(f"{d} {v}" for d, v in dists) if dists else "absent"
    _line("checkpoint", ckpt.source)
    _line("", f"{ckpt.member} ({ckpt.architecture}), text tower {ckpt.text_tower}")
    _line("", f"{files}, {len(ckpt.tensors)} tensors, {fmt_bytes(ckpt.nbytes)}; vit_merger at {ckpt.attn_prefix}*")
    _line("vLLM", f"{vllm}; device {device}; dtype {dtype}" + (f" (stored {stored})" if stored else ""))


def hotfix(line: str, rows: list[tuple[str, str, str]] | None = None) -> None:
    """The hotfix's one line; with ``rows`` (``--fixes``), a table of every fix under it."""
    _line("hotfix", line)
    if rows:
        print_table(["fix", "result", "why"], rows, style_col=1)
        sys.stdout.flush()


def stop_ids(report: dict) -> None:
    """Where vLLM stops a chat answer for this checkpoint (:func:`vllm_minicpm_hotfix.cli.stop_tokens.report`):
    ``OK ...``, ``WARN ...`` with the ``stop_token_ids`` to pass, or ``cannot tell ...``."""
    status = report["status"]
    _line("stop ids", report["detail"] if status == "-" else f"{status} {report['detail']}")


def quantized(text: str, *, first: bool) -> None:
    """One line of a quantized checkpoint's report (:func:`vllm_minicpm_hotfix.cli.quant_report.report_lines`)."""
    _line("quantized" if first else "", text)


def load_plan(built: Built, ckpt: Checkpoint, fed: list[str], version: str) -> None:
    """What is about to be fed to ``load_weights``, and what is left out."""
    left_out = len(ckpt.tensors) - len(fed)
    fed_bytes = sum(ckpt.tensors[n].nbytes for n in fed)
    if built.encoder_only:
        scope = (f"language model left out (vLLM's mm_encoder_only: built on meta, {left_out} of its tensors not "
                 f"read); the vision tensors take vLLM's normal path")
    elif built.fallback:
        scope = (f"whole model built and loaded (vLLM {version} cannot build it with the language model left out: "
                 f"{built.fallback})")
    else:
        scope = "whole model built and loaded"
    _line("load", f"{built.model_cls.__name__}.load_weights over {len(fed)} tensors ({fmt_bytes(fed_bytes)}); {scope}")


def results(rows: list[Row], times: dict[str, float], total: float, rss_mib: float | None) -> None:
    """The result table, then the time per phase and the peak resident set size."""
    print()
    print_table(["tensor", "shape", "dtype", "result"], [(r.tensor, r.shape, r.dtype, r.result) for r in rows],
                style_col=3)
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
    print(f"\n  time {total:.1f} s ({timing}); peak RSS {fmt_bytes(rss_mib * 2**20) if rss_mib else '?'}")
