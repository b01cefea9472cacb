"""A checkpoint folder's safetensors files, read with safetensors' own API: the one reader of checkpoint files.

* :func:`weight_files` -- the folder's ``*.safetensors`` files in load order (one file, or the shards
  ``model.safetensors.index.json`` names), and the index's ``weight_map``.
* :func:`read_header` / :func:`read_tensor_info` -- each tensor's dtype and shape, from the headers alone
  (``safe_open(..., framework="numpy")``, ``keys()``, ``get_slice(name).get_dtype()`` / ``.get_shape()``): no tensor
  data, no torch.
* :func:`read_tensor` / :func:`iter_tensors` -- the tensors themselves, on the CPU, through ``safe_open(...,
  framework="pt")`` and ``get_tensor``: the calls vLLM's own ``safetensors_weights_iterator``
  (``vllm/model_executor/model_loader/weight_utils.py``) makes.

Users: :mod:`vllm_minicpm_hotfix.quant_layout` (and through it the ``quantized_vision`` fix), ``verify``
(:mod:`vllm_minicpm_hotfix.cli.verify.checkpoint`) and the CPU model builder (:mod:`vllm_minicpm_hotfix.cli.vllm_cpu`).

The module imports nothing of the package and nothing outside the standard library at import time (safetensors and
torch are imported by the functions that need them): tests/support/ray_driver.py hands its source, with vllm_cpu.py's, to
Ray actors on nodes that have nothing of the hotfix installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: The index of a sharded checkpoint (``{"weight_map": {tensor name: shard file name}}``).
INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str  #: safetensors' dtype string, e.g. "BF16", "F32", "I32", "U8", "F8_E4M3"
    shape: tuple[int, ...]


class CheckpointError(ValueError):
    """The folder cannot be read as a safetensors checkpoint; the message names the folder or file and says why."""


class TensorError(CheckpointError):
    """safetensors failed on one tensor of a file (its header entry, or reading its data): :attr:`path` and
    :attr:`tensor` name it, the exception safetensors raised is the ``__cause__``."""

    def __init__(self, path: Path, tensor: str, exc: BaseException) -> None:
        super().__init__(f"{path}: tensor {tensor}: {type(exc).__name__}: {exc}")
        self.path, self.tensor = path, tensor


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{index}: unreadable ({' '.join(str(exc).split())[:600]})") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: unreadable (no weight_map)")
    return weight_map


def weight_files(folder: str | os.PathLike) -> tuple[list[Path], dict[str, str] | None]:
    """``(the folder's safetensors files in load order, the index's weight_map or None)``: the files
    ``model.safetensors.index.json`` names if there is one, else every ``*.safetensors``; naturally sorted
    (``model-2-of-10`` before ``model-10-of-10``), the order vLLM's ``safetensors_weights_iterator`` loads them in.

    Raises:
        CheckpointError: no safetensors file (naming the ``.bin``/``.pt``/``.gguf`` files found instead), an
            unreadable index, or a shard the index lists that is missing.
    """
    d = Path(folder)
    index = d / INDEX
    if not index.is_file():
        files = sorted(d.glob("*.safetensors"), key=_natural_key)
        if not files:
            other = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            extra = f" (found {', '.join(other[:3])}: only safetensors weights are read)" if other else ""
            raise CheckpointError(f"{d}: no *.safetensors weights{extra}")
        return files, None
    weight_map = _read_index(index)
    files = sorted({d / name for name in weight_map.values()}, key=_natural_key)
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{d}: shard {f.name} listed in {index.name} is missing")
    return files, weight_map


def read_header(path: str | os.PathLike) -> Iterator[tuple[str, TensorInfo]]:
    """``(tensor name, TensorInfo)`` for each tensor one safetensors file declares, in the order
    ``safe_open(...).keys()`` gives them (sorted by name). ``safe_open`` checks the header against the file's size,
    so a truncated or corrupt file fails here.

    Raises:
        TensorError: safetensors failed on one tensor's entry.
        ImportError: safetensors is not installed.
        OSError, safetensors.SafetensorError: what ``safe_open`` raises on an unreadable, truncated or corrupt file
            (a Rust panic inside safetensors arrives as a ``BaseException``).
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as sf:
        for name in sf.keys():  # noqa: SIM118 - a safe_open handle is not iterable
            try:
                sl = sf.get_slice(name)
                info = TensorInfo(str(sl.get_dtype()), tuple(int(x) for x in sl.get_shape()))
            except Exception as exc:
                raise TensorError(Path(path), name, exc) from exc
            yield name, info


def read_tensor_info(folder: str | os.PathLike) -> dict[str, TensorInfo]:
    """``{tensor name: TensorInfo}`` of every tensor in the folder (:func:`read_header` over :func:`weight_files`).

    Raises:
        CheckpointError: see :func:`weight_files`, or a tensor name in two files; and what :func:`read_header`
            raises.
    """
    out: dict[str, TensorInfo] = {}
    for f in weight_files(folder)[0]:
        for name, info in read_header(f):
            if name in out:
                raise CheckpointError(f"tensor {name} is in more than one file of {folder}")
            out[name] = info
    return out


def read_tensor(path: str | os.PathLike, name: str) -> Any:
    """Tensor ``name`` of the file ``path`` as a CPU ``torch.Tensor`` (the file's dtype and shape), from a
    ``safe_open`` handle of its own.

    One handle per tensor on purpose: ``get_tensor`` returns a view of a memory map of the whole file that lives as
    long as the handle's tensors, so with one handle per file every page read so far would stay in the process's
    resident set on top of the model's copy until the file is done (docs/cli.md measures it: about twice the
    memory). Opening costs a header parse (~1 ms on a 779-tensor checkpoint).

    Raises:
        TensorError: the file opened but the tensor could not be read (not in the file, data out of bounds, ...).
        ImportError, OSError, safetensors.SafetensorError: as :func:`read_header`, on opening the file.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        try:
            return f.get_tensor(name)
        except Exception as exc:
            raise TensorError(Path(path), name, exc) from exc


def iter_tensors(folder: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(name, CPU torch.Tensor)`` over every tensor of the folder in vLLM's load order (:func:`weight_files`'s file
    order, names sorted within a file), one ``safe_open`` handle per file, a fresh tensor on each call (vLLM's
    ``load_weights`` may tag them).

    Raises:
        CheckpointError: see :func:`weight_files`; and what ``safe_open`` / ``get_tensor`` raise.
    """
    from safetensors import safe_open

    for f in weight_files(folder)[0]:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                yield name, sf.get_tensor(name)
