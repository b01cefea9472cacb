#!/usr/bin/env python3
"""Write the package's release facts, ``vllm_minicpm_hotfix/data/releases.json``, from the recorded run
``docs/results/test-run.json`` (``scripts/test --record``), so that ``doctor`` quotes measurements, not a list typed
by hand. Run it after every recorded run; tests/release/test_release.py fails while the two differ.

    python3 scripts/release_facts.py          # write the file
    python3 scripts/release_facts.py --check  # exit 1 if the packaged file differs from what the run gives
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_minicpm_hotfix.cli import releases  # noqa: E402

RUN = REPO / "docs" / "results" / "test-run.json"


def render() -> str:
    """The file's text: :func:`vllm_minicpm_hotfix.cli.releases.derive` of the recorded run, as indented JSON."""
    return json.dumps(releases.derive(json.loads(RUN.read_text())), indent=1) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        same = releases.DATA.is_file() and releases.DATA.read_text() == text
        print(f"{releases.DATA.relative_to(REPO)}: {'up to date' if same else 'differs from ' + str(RUN.relative_to(REPO))}")
        return 0 if same else 1
    releases.DATA.write_text(text)
    print(f"wrote {releases.DATA.relative_to(REPO)} from {RUN.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
