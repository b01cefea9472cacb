"""``verify``'s checkpoint side (vllm_minicpm_hotfix/cli/verify/checkpoint.py): the tensors it reads are the ones
vLLM's own ``safetensors_weights_iterator`` yields, in the same order, and a broken safetensors file gives one line
that names it -- which safetensors' (and so vLLM's) own error does not.

Real files only: the bundled tiny checkpoint, re-split into shards with safetensors, and copies of it broken the ways
downloads break (cut short, trailing bytes, a garbage or corrupt header, an unknown dtype). The reference for what a
file holds is ``safetensors.torch.load_file`` and vLLM's iterator, not this module.

Placed where ``verify`` itself is tested (tests/cli/test_cli.py, ``FULL_ENVS``): every lock pins the same safetensors,
and vLLM's ``safetensors_weights_iterator`` has the same signature and order in 0.22-0.33.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.paths import TINY
from support.placement import FULL_ENVS
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from vllm_minicpm_hotfix.cli import verify
from vllm_minicpm_hotfix.cli.verify.checkpoint import BadInput, inspect_checkpoint, read_header, read_tensor

pytestmark = pytest.mark.placed(*FULL_ENVS)

WEIGHTS = TINY / "model.safetensors"


def vllm_iterator(files: list[Path]):
    """vLLM's own reader: what ``DefaultModelLoader`` feeds ``load_weights`` (default "lazy" strategy)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    return safetensors_weights_iterator([str(f) for f in files], False)


def checkpoint_copy(dst: Path, weights: bytes | None = None) -> Path:
    """The tiny checkpoint's folder copied to ``dst``, with ``model.safetensors`` replaced by ``weights``."""
    shutil.copytree(TINY, dst)
    if weights is not None:
        (dst / "model.safetensors").write_bytes(weights)
    return dst


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The tiny checkpoint in three shards with an index, the window-merger q/k/v spread over two of them."""
    out = tmp_path_factory.mktemp("sharded") / "ckpt"
    shutil.copytree(TINY, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = load_file(str(WEIGHTS))
    names = sorted(tensors)
    shards = [names[0::3], names[1::3], names[2::3]]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def test_header_agrees_with_safetensors_torch():
    reference = load_file(str(WEIGHTS))
    header = read_header(WEIGHTS)
    assert list(header) == sorted(reference)
    for name, meta in header.items():
        t = reference[name]
        assert (meta.shape, meta.dtype) == (tuple(t.shape), str(t.dtype).removeprefix("torch.")), name
        assert meta.nbytes == t.numel() * t.element_size() and meta.file == WEIGHTS


def test_stream_is_what_vllm_feeds_load_weights(sharded):
    """Same names in the same order, bit-identical tensors, as vLLM's ``safetensors_weights_iterator`` over the
    same shards; a tensor ``keep`` rejects is not read."""
    ckpt = inspect_checkpoint(sharded, "test")
    assert ckpt.sharded and len(ckpt.files) == 3
    ours = list(verify.stream_checkpoint(ckpt, lambda name: True))
    theirs = list(vllm_iterator(ckpt.files))
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (name, a), (_, b) in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    vision = [n for n, _ in verify.stream_checkpoint(ckpt, lambda name: "vision" in name)]
    assert vision == [n for n, _ in ours if "vision" in n] and len(vision) < len(ours)


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def _unknown_dtype(data: bytes) -> bytes:
    header = json.loads(data[8:_header_end(data)])
    first = next(k for k in header if k != "__metadata__")
    header[first]["dtype"] = "X9"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[_header_end(data):]


#: How downloads break -> (what to write instead of model.safetensors, the words the error line must carry).
BROKEN = {
    "cut short": (lambda d: d[:-100], "truncated or corrupt safetensors file -- the header does not match"),
    "trailing bytes": (lambda d: d + b"\0" * 16, "truncated or corrupt safetensors file -- the header does not match"),
    "cut inside the header": (lambda d: d[:50], "no valid header"),
    "a few bytes": (lambda d: d[:4], "no valid header"),
    "empty": (lambda d: b"", "no valid header"),
    "an HTML error page": (lambda d: b"<!DOCTYPE html><html>Rate limited</html>", "no valid header"),
    "corrupt JSON": (lambda d: d[:8] + b"[" + d[9:], "corrupt safetensors file"),
    "unknown dtype": (_unknown_dtype, "corrupt safetensors file (invalid JSON in header: unknown variant `X9`"),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_broken_file_is_one_line_naming_it(tmp_path, how):
    make, words = BROKEN[how]
    ckpt = checkpoint_copy(tmp_path / "ckpt", make(WEIGHTS.read_bytes()))
    bad = ckpt / "model.safetensors"
    with pytest.raises(BadInput) as info:
        inspect_checkpoint(ckpt, "test")
    line = str(info.value)
    print(f"\n{how}: {line}")
    assert "\n" not in line and line.startswith(f"{bad} (") and words in line
    # What it wraps: safetensors' own error, which is also what vLLM's loader would raise -- without the file's name.
    cause = info.value.__cause__
    assert isinstance(cause, SafetensorError) and str(bad) not in str(cause) and bad.name not in str(cause)
    with pytest.raises(SafetensorError) as stock:
        next(iter(vllm_iterator([bad])))
    assert str(stock.value) == str(cause) and bad.name not in str(stock.value)


def test_missing_tensor_names_file_and_tensor():
    with pytest.raises(BadInput) as info:
        read_tensor(WEIGHTS, "model.no.such.tensor")
    line = str(info.value)
    assert line.startswith(f"{WEIGHTS} (") and ", tensor model.no.such.tensor: corrupt safetensors file" in line


def test_unreadable_folder_entry(tmp_path):
    """A file name that is a folder: the OS error, one line, naming it."""
    ckpt = checkpoint_copy(tmp_path / "ckpt")
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    with pytest.raises(BadInput) as info:
        inspect_checkpoint(ckpt, "test")
    assert str(info.value).startswith(f"{ckpt / 'model.safetensors'}")


def _drawn_on_a_terminal(total: int, steps: int, first_wait: float = 10.0) -> str:
    """What ``progress`` writes to a pseudo-terminal 100 columns wide over ``steps`` equal updates (``""`` if
    nothing arrives within ``first_wait`` seconds)."""
    import fcntl
    import os
    import select
    import struct
    import termios

    from vllm_minicpm_hotfix.cli._util import progress

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        with open(follower, "w", closefd=False) as tty:
            assert tty.isatty()
            with progress(total, "loading", stream=tty) as bar:
                for _ in range(steps):
                    bar.update(total // steps)
            tty.flush()
        # Everything is written before the first read, but a pseudo-terminal hands it over in pieces: read until
        # nothing more arrives for a while (the first piece may take long on a loaded machine).
        chunks, wait = [], first_wait
        while select.select([leader], [], [], wait)[0]:
            chunk = os.read(leader, 65536)
            if not chunk:
                break
            chunks.append(chunk)
            wait = 0.5
        return b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)


def test_progress_only_on_a_terminal():
    """``verify``'s loading bar: tqdm on a terminal (a pseudo-terminal here), nothing at all when stdout is a file or
    a pipe, and erased when done (``leave=False``)."""
    import io

    from vllm_minicpm_hotfix.cli._util import progress

    off = io.StringIO()
    with progress(3 * 2**20, "loading", stream=off) as bar:
        for _ in range(3):
            bar.update(2**20)
    assert off.getvalue() == ""

    drawn = _drawn_on_a_terminal(3 * 2**20, 3)
    assert drawn.startswith("\rloading:") and "/3.00M [" in drawn, drawn  # bytes, 1024-based units
    assert drawn.endswith("\r") and drawn.rstrip("\r").split("\r")[-1].strip() == "", drawn  # erased when done


def test_progress_without_tqdm_draws_nothing(monkeypatch):
    """An environment without tqdm (it is not a dependency of the package; vLLM's environments have it): no bar, and
    the load it would show goes on."""
    import sys

    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import tqdm` now raises ImportError
    assert _drawn_on_a_terminal(3 * 2**20, 3, first_wait=2.0) == ""
