"""Two threads importing vLLM's model module at once after ``install()``, the hook and the qkv_loader fix's ``apply``
counted (tests/loading/test_reliability.py::test_two_threads_importing_the_module_patch_once). Prints the counts."""

import importlib
import json
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_minicpm_hotfix import hook  # noqa: E402
from vllm_minicpm_hotfix.fixes import _base, qkv_loader  # noqa: E402

calls, applied = [], []
real_on_import, real_apply = hook.on_import, qkv_loader.apply


def counting_on_import(module):
    calls.append(threading.current_thread().name)
    real_on_import(module)


def counting_apply(module):
    applied.append(threading.current_thread().name)
    real_apply(module)


hook.on_import = counting_on_import
qkv_loader.apply = counting_apply
import vllm_minicpm_hotfix as h  # noqa: E402

h.install()
barrier = threading.Barrier(2)
mods, errors = [], []


def worker():
    barrier.wait()
    try:
        mods.append(importlib.import_module("vllm.model_executor.models.minicpmv4_6"))
    except BaseException as exc:
        errors.append(repr(exc))


threads = [threading.Thread(target=worker, name=f"t{i}") for i in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(240)
m = mods[0] if mods else None
print(json.dumps({"calls": calls, "applied": applied, "errors": errors, "modules": len(mods),
                  "same": len(set(map(id, mods))) == 1,
                  "patched": m is not None and _base.patched_by(m.MiniCPMV4_6ViTWindowAttentionSelfAttn,
                                                                "load_weights") is not None,
                  "alive": [t.name for t in threads if t.is_alive()]}))
