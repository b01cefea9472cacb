"""The canary's look at one vLLM environment (scripts/canary runs this file with that environment's Python): every
fix's verdict on vLLM as shipped, and what the hotfix then does there. Prints one JSON object on its last line.

In one process, in this order:

1. ``import vllm``, vLLM's 4.6 model module and every other family member's (as a process serving 4.7 or OCR has
   them), with the hotfix not yet installed;
2. ``stock``: every registered fix's probe on those classes as shipped -- for 4.6 and per member the fix declares --
   exactly as the test suite records the verdicts ``vllm_minicpm_hotfix/data/releases.json`` holds
   (tests/conftest.py ``pytest_sessionfinish``);
3. ``vllm_minicpm_hotfix.install()`` (the post-import hook runs at once on the imported modules, under the mode the
   environment says, ``auto`` by default), vLLM's model registry imported (the backports), then ``status``:
   ``vllm_minicpm_hotfix.status()`` -- per fix the verdict the hook reached, whether it applied the fix, and any
   exception it caught (the processor path's deferred probes are run by that call, as vLLM's first processor would).

``import_error`` instead of the rest if ``import vllm`` or the model module fails. A stand-in release
(tests/programs/standin_release.py) alters vLLM's classes first and then runs :func:`main`.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def collect() -> dict:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    out: dict = {"python": sys.executable}
    try:
        import vllm

        out["vllm"] = vllm.__version__
        import transformers

        out["transformers"] = transformers.__version__
        module = importlib.import_module("vllm.model_executor.models.minicpmv4_6")
    except BaseException as exc:  # noqa: BLE001 - what the canary reports: the release does not import
        out["import_error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
        return out

    from vllm_minicpm_hotfix.fixes import REGISTRY, _base

    members = {m: view for m, view in _base.member_modules(module).items() if view is not module}
    out["members"] = sorted(members)
    stock = {}
    for fix in REGISTRY:
        try:
            v = fix.probe(module)
            row = {"verdict": v.state.value, "reason": v.reason}
        except Exception as exc:  # noqa: BLE001 - a probe must never raise; the canary reports it if it does
            row = {"verdict": "error", "reason": f"the probe raised {type(exc).__name__}: {exc}"}
        row["models"] = {}
        for m, view in members.items():
            if m not in _base.models_of(fix):
                continue
            try:
                mv = fix.probe(view)
                row["models"][m] = {"verdict": mv.state.value, "reason": mv.reason}
            except Exception as exc:  # noqa: BLE001
                row["models"][m] = {"verdict": "error", "reason": f"the probe raised {type(exc).__name__}: {exc}"}
        stock[fix.NAME] = row
    out["stock"] = stock

    import vllm_minicpm_hotfix as hotfix

    hotfix.install()
    importlib.import_module("vllm.model_executor.models.registry")
    out["status"] = hotfix.status()
    return out


def main() -> None:
    print(json.dumps(collect(), default=str))


if __name__ == "__main__":
    main()
