"""Where things are: the repository, the bundled tiny checkpoint and the script that writes its variants."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "vllm_minicpm_hotfix" / "data" / "tiny-minicpm-v46"
MAKE_CHECKPOINT = REPO / "scripts" / "make_tiny_checkpoint.py"
