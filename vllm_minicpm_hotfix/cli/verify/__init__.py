"""``vllm-minicpm-hotfix verify``: load a MiniCPM-V 4.6-family checkpoint (4.6, 4.7 dense or MoE, OCR) through *this* vLLM
and compare bit for bit.

    vllm-minicpm-hotfix verify                          # the tiny checkpoint shipped in the package: a self-test
    vllm-minicpm-hotfix verify --model /models/MiniCPM-V-4.6
    vllm-minicpm-hotfix verify --model openbmb/MiniCPM-V-4.6     # a hub id, from the huggingface_hub cache

In order: the checkpoint is checked without vLLM or torch (bad input: one line, exit 2); vLLM starts as its processes
start, with the hotfix as this environment activates it (``verify`` never installs the hook); where vLLM stops a chat
answer (:mod:`vllm_minicpm_hotfix.cli.stop_tokens`); the model vLLM resolves is built (the language model left out
through vLLM's ``mm_encoder_only`` unless ``--full-model``) and fed the streamed checkpoint through its own top-level
``load_weights``; ``vit_merger``'s fused ``qkv_proj`` and ``out_proj`` are compared with the checkpoint's tensors
(exit 1 on a mismatch or on vLLM's own error). The reference is docs/cli.md's ``verify`` section.

Where it lives: what it gathers in :mod:`vllm_minicpm_hotfix.cli.verify.checkpoint` (the checkpoint) and
:mod:`vllm_minicpm_hotfix.cli.verify.build` (vLLM, the model, the load), what it concludes in
:mod:`vllm_minicpm_hotfix.cli.verify.judge` (:func:`~vllm_minicpm_hotfix.cli.verify.judge.compare` and
:func:`~vllm_minicpm_hotfix.cli.verify.judge.verdict`), how it prints in
:mod:`vllm_minicpm_hotfix.cli.verify.render`; this module runs them in order (:func:`main`) and keeps their public names.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ... import quant_layout
from .. import quant_report, stop_tokens
from . import render
from .._util import exc_line, one_line, peak_rss_mib, print_verdict, progress
from .checkpoint import BadInput, Checkpoint, inspect_checkpoint, read_reference, resolve_model, stream_checkpoint
from .judge import _compare, compare, verdict  # noqa: F401 - _compare re-exported (tests/cli/test_cli.py)
from .build import (
    VerifyFailed,
    build_model,
    hotfix_state,
    language_model_filter,
    load,
    start_vllm_like_its_processes,
)

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-minicpm-hotfix verify",
        description="Load a MiniCPM-V 4.6 checkpoint through this environment's vLLM (with the hotfix as the "
        "environment activates it) and compare every vit_merger qkv_proj / out_proj tensor with the checkpoint, "
        "bit for bit.",
        epilog="Exit status: 0 all match; 1 a tensor differs or vLLM's own load raised; 2 bad input.",
    )
    p.add_argument("--model", metavar="DIR|HUB_ID", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the tiny checkpoint in the package)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where vLLM builds the model (cpu)")
    p.add_argument("--dtype", default="checkpoint",
                   choices=("checkpoint", "auto", "float32", "bfloat16", "float16"),
                   help="model dtype: 'checkpoint' (the dtype the vit_merger tensors are stored in: no rounding, "
                   "default), 'auto' (what `vllm serve` picks), float32, bfloat16, float16")
    p.add_argument("--full-model", action="store_true",
                   help="build and load the language model too (default: left out through vLLM's mm_encoder_only)")
    p.add_argument("--fixes", action="store_true", help="a table of every fix: patched or not, and why")
    p.add_argument("--debug", action="store_true", help="tracebacks and vLLM's own INFO logging")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    if not args.debug:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        return _run(args, t0)
    except BadInput as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {one_line(exc, 1000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except VerifyFailed as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        print_verdict(False, f"FAIL: {one_line(exc, 1000)}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _failed(args: argparse.Namespace, message: str, exc: BaseException) -> VerifyFailed:
    if args.debug:
        import traceback

        traceback.print_exception(exc)
    return VerifyFailed(f"{message}: {exc_line(exc)}")


def _run(args: argparse.Namespace, t0: float) -> int:
    """The command, in order: the checkpoint (bad input stops here, before vLLM is imported), vLLM as its processes
    start, the model built and loaded through its own ``load_weights``, the comparison, the verdict."""
    times: dict[str, float] = {}
    ckpt = inspect_checkpoint(*resolve_model(args.model))
    stored = ckpt.tensors[ckpt.attn("q_proj", "weight")].dtype
    dtype = stored if args.dtype == "checkpoint" else args.dtype
    render.header(ckpt, device=args.device, dtype=dtype, stored=stored if args.dtype == "checkpoint" else None)

    t = time.perf_counter()
    module, version = start_vllm_like_its_processes(args.device)
    times["import vLLM"] = time.perf_counter() - t
    active, hotfix_line, fix_rows = hotfix_state()
    render.hotfix(hotfix_line, fix_rows if args.fixes else None)
    t = time.perf_counter()
    render.stop_ids(stop_tokens.report(ckpt.path))
    times["stop ids"] = time.perf_counter() - t
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise VerifyFailed("--device cuda: torch sees no CUDA device here")
    if quant_layout.quant_method(ckpt.path) is not None:  # a quantized checkpoint: its vision layers, stored vs built
        for i, text in enumerate(quant_report.report_lines(quant_report.report(ckpt.path))[1]):
            render.quantized(text, first=i == 0)
    reference = read_reference(ckpt)

    t = time.perf_counter()
    try:
        built = build_model(ckpt, module, device=args.device, dtype=dtype, full=args.full_model)
    except (BadInput, VerifyFailed):
        raise
    except Exception as exc:  # vLLM's own error, on one line
        what = "the model" if ckpt.member == "MiniCPM-V 4.6" else f"{ckpt.member} ({why_not_built(ckpt, active)})"
        raise _failed(args, f"vLLM {version} could not build {what}", exc) from exc
    times["build"] = time.perf_counter() - t
    keep = language_model_filter(built, ckpt)
    fed = [n for n in ckpt.tensors if keep(n)]
    render.load_plan(built, ckpt, fed, version)

    t = time.perf_counter()
    try:
        with progress(sum(ckpt.tensors[n].nbytes for n in fed), "loading") as bar:
            load(built, stream_checkpoint(ckpt, keep, bar))
    except BadInput:
        raise
    except Exception as exc:  # vLLM's own error, on one line
        state = "hotfix active" if active else "hotfix not active"
        raise _failed(args, f"vLLM {version}'s own load_weights raised ({state})", exc) from exc
    times["load"] = time.perf_counter() - t

    t = time.perf_counter()
    rows = compare(built, ckpt, reference)
    times["compare"] = time.perf_counter() - t
    render.results(rows, times, time.perf_counter() - t0, peak_rss_mib())
    ok, line = verdict(rows, active=active, version=version)
    print_verdict(ok, line)
    return EXIT_OK if ok else EXIT_FAIL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


def why_not_built(ckpt: Checkpoint, active: bool) -> str:
    """What verify adds to vLLM's error when it cannot build a member other than 4.6: the architecture; whether the
    hotfix registers it where vLLM lacks it (a backport of it exists) and is active, else whether vLLM registers it
    itself; and, where the installed transformers has no config of the member's ``model_type``, that too (vLLM 0.33
    registers MiniCPM-OCR but pins a transformers without ``minicpm_ocr``). Never raises."""
    from ...backports import BACKPORTS

    try:
        from vllm.model_executor.models.registry import ModelRegistry

        vllms = ckpt.architecture in ModelRegistry.get_supported_archs()
    except Exception:  # noqa: BLE001 - a registry of another shape: say nothing about it
        vllms = False
    backport = next((b for b in BACKPORTS if b.ARCH == ckpt.architecture), None)
    if vllms and not (backport is not None and backport.registered()):
        said = "registered by vLLM"
    elif backport is not None:
        said = "hotfix active" if active else "hotfix not active: it registers this architecture where vLLM lacks it"
    else:
        said = "not registered by this vLLM, and the hotfix has no backport of it"
    try:
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except Exception:  # noqa: BLE001 - no transformers: vLLM's own error says what is missing
        return f"{ckpt.architecture}; {said}"
    if ckpt.model_type not in CONFIG_MAPPING_NAMES:
        said += f"; transformers {transformers.__version__} has no {ckpt.model_type}"
    return f"{ckpt.architecture}; {said}"
