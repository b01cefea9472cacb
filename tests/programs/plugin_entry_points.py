"""``argv[1]`` (a site-packages folder) appended to ``sys.path`` by hand (for ``python -S``, which adds none), then
the ``vllm.general_plugins`` entry points found there and the finders waiting for ``import vllm``."""

import json
import sys
from importlib.metadata import entry_points

sys.path.append(sys.argv[1])
eps = [(e.name, e.value) for e in entry_points(group="vllm.general_plugins")]
print(json.dumps({"eps": eps,
                  "waiting": [f.source for f in sys.meta_path if getattr(f, "_vllm_minicpm_hotfix_waiting", False)]}))
