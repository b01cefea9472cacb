"""``python -m vllm_minicpm_hotfix.cli.model_report DIR``: what ``doctor --model DIR`` learns about a checkpoint in a
fresh vLLM process of this environment, printed as one JSON object on the last line of stdout:

* ``quantized`` -- how a quantized checkpoint stores its vision layers and how vLLM builds them
  (:func:`vllm_minicpm_hotfix.cli.quant_report.report`; ``{"quant_method": null}`` for an unquantized one);
* ``stop_tokens`` -- where vLLM stops a chat answer for it (:func:`vllm_minicpm_hotfix.cli.stop_tokens.report`).

One process for both: each costs an ``import vllm`` (15-40 s).
"""

from __future__ import annotations

import json
import sys

from . import quant_report, stop_tokens


def report(folder: str) -> dict:
    return {"quantized": quant_report.as_json(quant_report.report(folder)), "stop_tokens": stop_tokens.report(folder)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(json.dumps(report(args[0]), default=str))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
