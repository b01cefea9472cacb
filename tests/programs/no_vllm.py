"""In an environment without vLLM: what start-up armed, what ``import vllm`` raises, and what that attempt imported
of ours, wrapt, torch or vLLM (nothing, if the finder looks vLLM up before it installs anything)."""

import json
import sys

start_modules = set(sys.modules)


def waiting() -> list[str]:
    return [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]


armed = waiting()
try:
    import vllm  # noqa: F401

    error = None
except ImportError as exc:
    error = f"{type(exc).__name__}: {exc}"
print(json.dumps({"waiting": armed, "error": error, "waiting_after": waiting(),
                  "at_start": sorted(m for m in start_modules if "vllm_minicpm_hotfix" in m),
                  "after": sorted(m for m in set(sys.modules) - start_modules
                                  if m.split(".")[0] in ("wrapt", "vllm_minicpm_hotfix", "torch", "vllm"))}))
