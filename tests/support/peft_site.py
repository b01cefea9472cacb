"""peft (and accelerate, which it imports) for the tests that write a LoRA adapter with peft, installed on demand.

Neither is in the shared test environments (locks/*.txt): both are pure Python, so :func:`peft_site` installs the
pinned wheels once with ``uv pip install --target DIR --no-deps`` into a cache folder outside the repository
(``~/.cache/vllm-minicpm-hotfix/overlays/``, or under ``$VLLM_MINICPM_HOTFIX_OVERLAYS``), offline first (uv's cache),
then from the package index. A program that needs them gets ``DIR`` on its ``PYTHONPATH``; nothing is installed into
an environment, and the test process itself never imports peft. Their dependencies (torch, transformers,
safetensors, huggingface-hub, numpy, packaging, psutil, pyyaml, tqdm) come from the vLLM environment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from support.venvs import run_uv

#: The pinned wheels (pure Python).
PINS = ("peft==0.21.2", "accelerate==1.15.0")


def overlays_root() -> Path:
    return Path(os.environ.get("VLLM_MINICPM_HOTFIX_OVERLAYS")
                or Path.home() / ".cache" / "vllm-minicpm-hotfix" / "overlays")


def peft_site() -> Path:
    """The folder holding :data:`PINS` (installed on first use; an existing complete folder is reused). Raises
    RuntimeError (with uv's output) if they cannot be installed."""
    dest = overlays_root() / "+".join(p.replace("==", "-") for p in PINS)
    if (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        run_uv("pip", "install", "--no-deps", "--target", str(tmp), *PINS)
        (tmp / ".complete").write_text("\n".join(PINS) + "\n")
        try:
            tmp.rename(dest)  # atomic: a concurrent session that won the race has already put a complete one there
        except OSError:
            if not (dest / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
