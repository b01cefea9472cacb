"""One fresh vLLM process: what the post-import hook costs in it, per fix. Prints one JSON object (last line).

    python hook_child.py REPO|- [eager|lazy]

Imports the package from ``REPO`` (``-``: as installed in the interpreter's environment), registers the hook
(``vllm_minicpm_hotfix.install()``, as every activation path does), then ``import
vllm.model_executor.models.minicpmv4_6`` with ``VLLM_TARGET_DEVICE=cpu``: the hook runs inside that import, as in
vLLM's API server, EngineCore and workers. ``VLLM_MINICPM_HOTFIX`` is whatever the parent set (auto).

Measured with ``time.process_time()`` (CPU of this process, every thread) and ``time.perf_counter()`` (wall):

* ``install``: importing the package and registering the hook (before vLLM is imported);
* ``import_fixes``: importing the fix modules (the first thing the hook does);
* ``fixes``: per fix, ``fixes._base.run`` (probe, decision, apply; for a fix probed at first use: setting its trigger);
* ``hook``: the whole hook (``hook.on_import``: the two above and the status record);
* ``first_use``: with ``lazy``, the deferred fixes resolved afterwards (``fixes.deferred.resolve_all``: the cost moved
  to vLLM's first processing info -- the processor path's group, which every serving process pays there, together
  with transformers' processor modules that vLLM imports there itself -- and to the first quantized model
  construction -- ``quantized_vision``, which an unquantized checkpoint never pays).

``eager`` sets ``VLLM_MINICPM_HOTFIX_PROBES=eager`` (every probe at import, as before probes could be deferred).
"""

import json
import os
import sys
import time


def main(repo: str, probes: str) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_MINICPM_HOTFIX_PROBES"] = probes
    if repo != "-":  # "-": the package installed in this environment
        sys.path.insert(0, repo)
    out: dict = {"probes": probes, "fixes": {}}

    c0, w0 = time.process_time(), time.perf_counter()
    import vllm_minicpm_hotfix
    from vllm_minicpm_hotfix import hook

    original_on_import = hook.on_import

    def timed_on_import(module):
        c1, w1 = time.process_time(), time.perf_counter()
        from vllm_minicpm_hotfix.fixes import _base

        out["import_fixes"] = {"cpu_ms": (time.process_time() - c1) * 1e3, "wall_ms": (time.perf_counter() - w1) * 1e3}
        run = _base.run

        def timed_run(fix, mod):
            c, w = time.process_time(), time.perf_counter()
            try:
                return run(fix, mod)
            finally:
                out["fixes"][fix.NAME] = {"cpu_ms": (time.process_time() - c) * 1e3,
                                          "wall_ms": (time.perf_counter() - w) * 1e3}

        _base.run = timed_run
        try:
            original_on_import(module)
        finally:
            _base.run = run
        out["hook"] = {"cpu_ms": (time.process_time() - c1) * 1e3, "wall_ms": (time.perf_counter() - w1) * 1e3}

    hook.on_import = timed_on_import  # looked up by name when wrapt calls the registered hook
    vllm_minicpm_hotfix.install()
    out["package_file"] = vllm_minicpm_hotfix.__file__
    out["install"] = {"cpu_ms": (time.process_time() - c0) * 1e3, "wall_ms": (time.perf_counter() - w0) * 1e3}

    import vllm.model_executor.models.minicpmv4_6  # noqa: F401 - the hook runs inside this import

    if "hook" not in out:
        raise RuntimeError("the post-import hook did not run")
    from vllm_minicpm_hotfix.fixes._base import deferred

    from vllm_minicpm_hotfix import record

    st = record.current().as_dict()  # before any first use (status() would probe the processor path's group)
    out["status"] = {n: {"verdict": e["verdict"], "applied": e["applied"], "first_use": e.get("first_use")}
                     for n, e in st["fixes"].items()}
    c, w = time.process_time(), time.perf_counter()
    resolved = deferred.resolve_all()
    out["first_use"] = {"cpu_ms": (time.process_time() - c) * 1e3, "wall_ms": (time.perf_counter() - w) * 1e3,
                        "fixes": sorted(resolved)}
    import vllm

    out["vllm"] = getattr(vllm, "__version__", "?")
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "lazy")), flush=True)
