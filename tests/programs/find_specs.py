"""For each module named in ``argv[1:]``, whether this interpreter can NOT find it (``importlib.util.find_spec`` is
None), as a JSON list (tests/e2e/test_serve.py: an environment as a vLLM image ships it)."""

import importlib.util
import json
import sys

print(json.dumps([importlib.util.find_spec(m) is None for m in sys.argv[1:]]))
