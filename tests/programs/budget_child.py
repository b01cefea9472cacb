"""A fresh vLLM process: the post-import hook must not import ``vllm.multimodal.encoder_budget``, and
``request_kwargs``'s recorder must be on ``compute_mm_encoder_budget`` once vLLM imports that module. Prints one JSON
object (last line).

    python budget_child.py REPO

Registers the hook (``vllm_minicpm_hotfix.install()``), imports vLLM's 4.6 model module (the hook runs), has the
processor path's fixes probed (``status()``, as vLLM's first processor would), notes whether the budget module was
imported by then, imports it as vLLM's scheduler and input processor do, and calls its
``compute_mm_encoder_budget`` on a scheduler config stand-in. The reference is vLLM's own function in
``vllm.v1.core.encoder_cache_manager`` (which the fix never touches), called with the same arguments.
"""

import json
import os
import sys
import types


def main(repo: str) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, repo)
    import vllm_minicpm_hotfix

    vllm_minicpm_hotfix.install()
    import vllm.model_executor.models.minicpmv4_6  # noqa: F401 - the hook runs inside this import

    # vLLM's MultiModalBudget creates its processor (the processor path's fixes probed and applied there) before
    # it computes the budget; status() probes them here as that first processor would.
    applied = vllm_minicpm_hotfix.status()["fixes"]["request_kwargs"]["applied"]
    out = {"imported_by_hook": "vllm.multimodal.encoder_budget" in sys.modules}
    from vllm.multimodal import encoder_budget
    from vllm.v1.core import encoder_cache_manager

    from vllm_minicpm_hotfix.fixes import _base
    from vllm_minicpm_hotfix.fixes import request_kwargs as fix

    sched = types.SimpleNamespace(disable_chunked_mm_input=False, max_num_batched_tokens=1000,
                                  encoder_cache_size=1000, max_num_encoder_input_tokens=1000)
    out["patched_by"] = _base.patched_by(encoder_budget, "compute_mm_encoder_budget")
    out["result"] = list(encoder_budget.compute_mm_encoder_budget(sched, {"image": 300}))
    out["reference"] = list(encoder_cache_manager.compute_mm_encoder_budget(sched, {"image": 300}))
    out["recorded"] = list(fix.ENCODER_CACHE_SIZE)
    out["applied"] = applied
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])), flush=True)
