"""Tiny checkpoints written by ``scripts/make_tiny_checkpoint.py`` with this environment's transformers, once per run.

The script is deterministic: its output is a function of its own text, its arguments and the libraries that write
the files (transformers, torch, tokenizers, safetensors, huggingface_hub). A run of ``scripts/test`` starts ten test
sessions, seven of them on one transformers, and each used to write the same few checkpoints again (6-10 s of CPU
each). ``scripts/test`` sets ``VLLM_MINICPM_HOTFIX_CHECKPOINTS`` to a folder of its run: the first session that needs
a checkpoint writes it there under a key of all of the above, and every later one with the same key copies it. A
test always gets its own copy, so nothing it edits reaches another test. Without the variable every call writes its
own, as before.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from support.paths import MAKE_CHECKPOINT

#: The variable scripts/test sets to its run's checkpoint folder.
CACHE_VAR = "VLLM_MINICPM_HOTFIX_CHECKPOINTS"
#: The distributions whose versions decide the files the script writes.
WRITERS = ("transformers", "torch", "tokenizers", "safetensors", "huggingface_hub")


def key(args: tuple[str, ...]) -> str:
    """The cache key of ``make_tiny_checkpoint.py OUT *args`` in this environment (hex, 16 characters)."""
    h = hashlib.sha256(MAKE_CHECKPOINT.read_bytes())
    h.update(repr(args).encode())
    for dist in WRITERS:
        try:
            h.update(f"{dist}=={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist} absent".encode())
    return h.hexdigest()[:16]


def write(dest: Path, *args: str) -> Path:
    """``scripts/make_tiny_checkpoint.py DEST *args`` with this interpreter; from the run's cache where there is one.
    Returns ``dest``. Raises ``subprocess.CalledProcessError`` where the script fails (its stderr in the error)."""
    cache = os.environ.get(CACHE_VAR)
    if not cache:
        return _run(dest, args)
    entry = Path(cache) / key(args)
    if not entry.is_dir():
        entry.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
        _run(scratch / "ckpt", args)
        try:
            os.rename(scratch / "ckpt", entry)  # atomic: another session writing the same key wins or loses whole
        except OSError:
            pass  # written by another session meanwhile: the same files
        shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(entry, dest, dirs_exist_ok=True)
    return dest


def _run(dest: Path, args: tuple[str, ...]) -> Path:
    proc = subprocess.run([sys.executable, str(MAKE_CHECKPOINT), str(dest), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return dest
