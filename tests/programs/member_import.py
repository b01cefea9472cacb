"""One fresh vLLM process that imports the family's model modules in a given order with the hook installed, as
``vllm serve`` does for the model it serves; prints one JSON object (last line).

    python tests/programs/member_import.py REPO MODULE [MODULE ...]

``MODULE``: ``vllm.model_executor.models.minicpmv4_6`` / ``...minicpmv4_7``, imported in that order after
``vllm_minicpm_hotfix.install()``. Prints ``models`` (``status()["models"]``), ``rows`` (fix NAME -> member ->
``[verdict, applied]``), ``active`` (fix NAME -> the members its wrappers act for, ``fixes._base._ACTIVE``) and
``imported`` (which of the two modules are in ``sys.modules``). Probes run eagerly
(``VLLM_MINICPM_HOTFIX_PROBES=eager``) so that every verdict is the stock one tests/support/expected.py pins.
"""

import importlib
import json
import os
import sys

FAMILY = ("vllm.model_executor.models.minicpmv4_6", "vllm.model_executor.models.minicpmv4_7")


def main(repo: str, modules: list[str]) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_MINICPM_HOTFIX_PROBES"] = "eager"
    sys.path.insert(0, repo)
    import vllm_minicpm_hotfix

    vllm_minicpm_hotfix.install()
    for name in modules:
        importlib.import_module(name)
    from vllm_minicpm_hotfix.fixes import _base

    st = vllm_minicpm_hotfix.status()
    return {
        "models": st["models"],
        "rows": {n: {m: [r["verdict"], r["applied"]] for m, r in e["models"].items()} for n, e in st["fixes"].items()},
        "active": {n: sorted(v) for n, v in _base._ACTIVE.items()},
        "imported": [n for n in FAMILY if n in sys.modules],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:])), flush=True)
