"""``plugin.register()`` (what vLLM calls in each of its processes) or, with ``--install-now``,
``_bootstrap.install_now("test")`` (what the finder calls on ``import vllm``); reports what it installed and the file
wrapt came from. ``--prepend DIR`` / ``--append DIR`` (repeatable, in order) put folders on ``sys.path`` first."""

import argparse
import json
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--install-now", action="store_true")
parser.add_argument("--prepend", action="append", default=[])
parser.add_argument("--append", action="append", default=[])
args = parser.parse_args()
sys.path[:0] = args.prepend
sys.path.extend(args.append)

from vllm_minicpm_hotfix import _bootstrap, hook, plugin  # noqa: E402

result = _bootstrap.install_now("test") if args.install_now else plugin.register()
print(json.dumps({"result": repr(result), "installed": hook._installed, "activations": _bootstrap.activations,
                  "wrapt": getattr(sys.modules.get("wrapt"), "__file__", None),
                  "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]}))
