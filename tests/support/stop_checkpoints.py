"""Checkpoints whose stop tokens differ (tests/cli/test_stop_tokens.py): the bundled tiny checkpoint (written by
transformers, scripts/make_tiny_checkpoint.py) copied and its files then edited the way published checkpoints differ
-- the tokenizer's ``eos_token`` in ``tokenizer_config.json``, ``eos_token_id`` in ``generation_config.json`` (or no
such file), the chat template. The ids are read from the checkpoint's own ``tokenizer.json``, never assumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.paths import TINY

#: Marks "leave the file out" for :func:`write`.
MISSING = object()


def token_ids(folder: Path = TINY) -> dict[str, int]:
    """``{token text: id}`` of the added tokens in ``folder``'s ``tokenizer.json`` (``<|endoftext|>``, ``<|im_end|>``...)."""
    data = json.loads((Path(folder) / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in data["added_tokens"]}


def _edit(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2) + "\n")


def write(dst: Path, *, tokenizer_eos: str | None = None, generation_eos: object = None,
          chat_template: object = None, tokenizer: bool = True) -> Path:
    """The bundled tiny checkpoint copied to ``dst`` with its files edited: ``tokenizer_eos`` (a token text) into
    ``tokenizer_config.json``'s ``eos_token``; ``generation_eos`` (token texts: one, or a list) into
    ``generation_config.json``'s ``eos_token_id`` as ids, or :data:`MISSING` to delete that file; ``chat_template``
    (Jinja text) as ``chat_template.jinja``, or :data:`MISSING` to delete it; ``tokenizer=False`` deletes
    ``tokenizer.json`` and ``tokenizer_config.json``. None leaves a file as transformers wrote it."""
    shutil.copytree(TINY, dst)
    ids = token_ids(dst)
    if tokenizer_eos is not None:
        _edit(dst / "tokenizer_config.json", eos_token=tokenizer_eos)
    if generation_eos is MISSING:
        (dst / "generation_config.json").unlink()
    elif generation_eos is not None:
        value = [ids[t] for t in generation_eos] if isinstance(generation_eos, list) else ids[generation_eos]
        _edit(dst / "generation_config.json", eos_token_id=value)
    if chat_template is MISSING:
        (dst / "chat_template.jinja").unlink()
    elif chat_template is not None:
        (dst / "chat_template.jinja").write_text(str(chat_template))
    if not tokenizer:
        (dst / "tokenizer.json").unlink()
        (dst / "tokenizer_config.json").unlink()
    return dst
