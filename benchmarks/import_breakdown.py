#!/usr/bin/env python
"""Where the hotfix's import-time cost goes: one instrumented ``import vllm.model_executor.models.minicpmv4_6``.

Run by benchmarks/bench.py in a fresh interpreter of an environment with the package pip-installed (its ``.pth``
has armed the finder that waits for ``import vllm``), or of one without it (then it only times the import and lists
the modules, for comparison). Prints one JSON line.

The package is not edited: the functions the activation path looks up at call time are wrapped here with
``perf_counter`` timers before vLLM is imported --

* ``_vllm_minicpm_hotfix_arm._install`` (the finder calls it when ``import vllm`` starts; it imports the package and
  calls ``_bootstrap.install_now``), split into ``import wrapt``, importing the package and the hook's modules (hook,
  decision, record, fixes/*), and registering the hook;
* wrapt's ``ImportHookFinder.find_spec``, asked about every import after the hook is registered;
* ``hook.on_import`` (wrapt calls it when vLLM's model module has been imported), and inside it
  ``fixes.qkv_loader.probe`` (the probe), ``fixes.qkv_loader.apply`` (the q/k/v patch) and
  ``fixes._base.run`` of the processor fix (its check/patch).
"""

from __future__ import annotations

import json
import sys
import time

T_START = time.perf_counter()
TARGET = "vllm.model_executor.models.minicpmv4_6"
timings: dict[str, float] = {}
counts: dict[str, int] = {}
modules_before_wrapt: set[str] = set()
wrapt_modules: list[str] = []


def timed(module, name: str, key: str) -> None:
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t0

    setattr(module, name, wrapper)


def count_finder_calls(wrapt) -> None:
    """Time wrapt's ``ImportHookFinder.find_spec``, which sits first on ``sys.meta_path`` once the hook is registered
    and so is asked about every later import (an upper bound: the timer's own cost is included)."""
    finder = getattr(getattr(wrapt, "importer", None), "ImportHookFinder", None)
    if finder is None:
        return
    original = finder.find_spec

    def find_spec(self, fullname, path=None, target=None):
        t0 = time.perf_counter()
        try:
            return original(self, fullname, path, target)
        finally:
            timings["wrapt_finder"] = timings.get("wrapt_finder", 0.0) + time.perf_counter() - t0
            counts["wrapt_finder_calls"] = counts.get("wrapt_finder_calls", 0) + 1

    finder.find_spec = find_spec


def instrument() -> bool:
    arm = sys.modules.get("_vllm_minicpm_hotfix_arm")
    if arm is None or arm.waiting() is None:
        return False
    original = arm._install  # what the waiting finder calls when `import vllm` starts (looked up at call time)

    def install_now(source):
        global modules_before_wrapt
        t0 = time.perf_counter()
        modules_before_wrapt = set(sys.modules)
        import wrapt  # noqa: F401 - what install_now imports first (via the hook module)

        wrapt_modules.extend(sorted(set(sys.modules) - modules_before_wrapt))
        t1 = time.perf_counter()
        count_finder_calls(wrapt)
        from vllm_minicpm_hotfix import hook
        from vllm_minicpm_hotfix.fixes import qkv_loader
        from vllm_minicpm_hotfix.fixes import processor_downsample_mode as processor_mode

        t2 = time.perf_counter()
        timed(hook, "on_import", "on_import")
        timed(qkv_loader, "probe", "probe_qkv")
        timed(qkv_loader, "apply", "patch_qkv")
        timed(processor_mode, "probe", "processor_fix")
        result = original(source)
        t3 = time.perf_counter()
        timings.update(import_wrapt=t1 - t0, import_hook_modules=t2 - t1, register=t3 - t2, install_now=t3 - t0)
        return result

    arm._install = install_now
    return True


def main() -> int:
    armed = instrument()
    t0 = time.perf_counter()
    __import__(TARGET)
    t1 = time.perf_counter()
    status = {}
    if armed:
        import vllm_minicpm_hotfix

        status = vllm_minicpm_hotfix.status()
    print(json.dumps({
        "armed": armed,
        "import_s": t1 - t0,
        "since_start_s": t1 - T_START,
        "timings_s": timings,
        "counts": counts,
        "fixes": {k: {"verdict": v.get("verdict"), "applied": v.get("applied")} for k, v in status.get("fixes", {}).items()},
        "wrapt_modules": wrapt_modules,
        "modules": sorted(sys.modules),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
