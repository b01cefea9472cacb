"""Record one environment's row of tests/data/stock.json: run with the environment's own Python (scripts/record-stock).

It runs ``pytest -m stock_pin`` here with ``VLLM_MINICPM_HOTFIX_RECORD_STOCK`` set: every pin test records what it
observed on stock vLLM (tests/support/expected.py: a probe's verdict on vLLM's own classes, the error stock vLLM
raises loading the bundled checkpoint, the prompt family stock vLLM's prompts match, each quantized layout's outcome,
the LoRA tower flag's) instead of asserting it. The observations become the environment's row, keyed
``<vLLM>:tf<transformers>``; a fact this environment's pin tests did not observe (a test placed elsewhere) is kept
from the old row and listed. Prints what changed; the file is for review (git diff), never trusted blindly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "stock.json"


def installed() -> tuple[str, str]:
    import transformers
    import vllm

    return vllm.__version__.split("+")[0], transformers.__version__


def run_pins(spec: str, out: Path) -> int:
    env = dict(os.environ, VLLM_MINICPM_HOTFIX_RECORD_STOCK=str(out), VLLM_MINICPM_HOTFIX_ENV=spec,
               VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "stock_pin", "tests"]
    return subprocess.run(cmd, cwd=REPO, env=env, check=False).returncode


def build_row(lines: list[tuple[list[str], object]]) -> dict:
    row: dict = {}
    for path, value in lines:
        *head, last = path
        node = row
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    row["members"] = {m: v for m, v in row.get("members", {}).items() if v is not None}  # None: member absent
    return row


def holds(old: object, new: object) -> bool:
    """Whether the recorded ``old`` still says what ``new`` observed: equal, or an error text recorded as a part of
    the message now observed (the pin tests match recorded texts as substrings)."""
    if isinstance(old, str) and isinstance(new, str):
        return old in new
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(holds(o, n) for o, n in zip(old, new))
    return old == new


def merge(old: object, new: object) -> object:
    """``new``, keeping ``old``'s value wherever it still holds and its key order (so the diff shows what changed)."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = [k for k in old if k in new] + [k for k in new if k not in old]
        return {k: merge(old.get(k), new[k]) for k in keys}
    return old if holds(old, new) else new


def main() -> int:
    spec = sys.argv[1] if len(sys.argv) > 1 else installed()[0]
    env = installed()
    key = f"{env[0]}:tf{env[1]}"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "observed.jsonl"
        out.touch()
        code = run_pins(spec, out)
        lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    if not lines:
        print(f"record-stock {spec}: no pin test recorded anything (pytest exit {code})", file=sys.stderr)
        return 1
    new = build_row(lines)
    doc = json.loads(DATA.read_text())
    rows = doc["environments"]
    old = rows.get(key, {})
    old = rows.get(old["same_as"], {}) if "same_as" in old else old
    kept = [k for k in old if k not in new]
    row = merge(old, new)
    row.update({k: old[k] for k in kept})
    row = {k: row[k] for k in [*old, *(k for k in row if k not in old)]}
    changed = [k for k in row if old.get(k) != row[k]]
    rows[key] = row
    DATA.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"record-stock {spec}: vLLM {env[0]} / transformers {env[1]} -> tests/data/stock.json [{key!r}]; "
          f"pin tests exit {code} (a failure while recording is a test that could not observe: read its output)")
    print(f"  changed: {', '.join(changed) or 'nothing'}; kept from the old row (not observed here): "
          f"{', '.join(kept) or 'none'}")
    for k in changed:
        print(f"  {k}: {json.dumps(old.get(k))} -> {json.dumps(row[k])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
