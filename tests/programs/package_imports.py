"""Import the named module of this repository's package in a fresh interpreter and report which heavy packages that
imported: ``{"module", "heavy": [the names of vllm, torch, transformers in sys.modules]}``.

    python tests/programs/package_imports.py vllm_minicpm_hotfix.backports
"""

import importlib
import json
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    importlib.import_module(sys.argv[1])
    print(json.dumps({"module": sys.argv[1], "heavy": [m for m in ("vllm", "torch", "transformers") if m in sys.modules]}))
