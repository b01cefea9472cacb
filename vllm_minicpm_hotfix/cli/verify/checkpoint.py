"""What ``verify`` gathers from the checkpoint: where it is, what it holds, and its tensors.

* :func:`resolve_model` -- a directory, a hub id (huggingface_hub cache, else a download) or the bundled tiny model.
* :func:`inspect_checkpoint` -- ``config.json`` says MiniCPM-V 4.6; the safetensors files (one, or shards listed in
  ``model.safetensors.index.json``) open with ``safetensors.safe_open`` -- which checks each header against the
  file's size, so a truncated or corrupt file fails here -- and hold the window-merger attention with the shapes the
  config implies. Reads headers only: no torch, no vLLM.
* :func:`stream_checkpoint` / :func:`read_reference` -- the tensors, one ``safe_open(..., framework="pt")`` handle
  per tensor.

The files are listed and read by :mod:`vllm_minicpm_hotfix.checkpoint`. safetensors' errors (``SafetensorError:
Error while deserializing header: ...``) name no file; :func:`unreadable` turns them, and ``OSError``, into one
:class:`BadInput` line that names the file (and the tensor, when one tensor failed).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._util import exc_line, one_line
from ... import checkpoint as reader
from ...fixes.qkv_loader import MODEL_CLASS, SHARD_IDS

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "data" / "tiny-minicpm-v46"
MODEL_TYPE = "minicpmv4_6"
ARCHITECTURE = MODEL_CLASS
#: The family members verify knows: ``config.json``'s ``model_type`` -> (member, architecture). 4.7's checkpoints
#: (1B dense, 35B-A3B MoE) and MiniCPM-OCR's keep 4.6's vision tower and window merger (transformers'
#: ``minicpmv4_7``, ``minicpm_ocr``), so the same q/k/v comparison holds for them.
MEMBERS = {
    MODEL_TYPE: ("MiniCPM-V 4.6", ARCHITECTURE),
    "minicpmv4_7": ("MiniCPM-V 4.7", "MiniCPMV4_7ForConditionalGeneration"),
    "minicpm_ocr": ("MiniCPM-OCR", "MiniCPMOcrForConditionalGeneration"),
}
#: The text config ``model_type`` of 4.7's sparse text tower (transformers' ``Qwen3_5MoeTextConfig``).
MOE_TEXT = "qwen3_5_moe_text"
#: Where checkpoints keep the window-merger attention (transformers >= 5.7 layout first, the older flat one second;
#: vLLM's ``hf_to_vllm_mapper`` maps both to ``vit_merger.``).
ATTN_PREFIXES = ("model.vision_tower.vit_merger.self_attn.", "model.vit_merger.self_attn.")
QKV = tuple(SHARD_IDS)
SUFFIXES = ("weight", "bias")

#: safetensors dtype -> (torch spelling, bits per element).
_DTYPES = {
    "F64": ("float64", 64), "F32": ("float32", 32), "F16": ("float16", 16), "BF16": ("bfloat16", 16),
    "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8), "F8_E8M0": ("float8_e8m0fnu", 8),
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8), "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8), "F4": ("float4_e2m1fn_x2", 4),
    "I64": ("int64", 64), "I32": ("int32", 32), "I16": ("int16", 16), "I8": ("int8", 8),
    "U64": ("uint64", 64), "U32": ("uint32", 32), "U16": ("uint16", 16), "U8": ("uint8", 8), "BOOL": ("bool", 8),
}
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class BadInput(Exception):
    """The checkpoint (or the way it was named) is unusable: exit 2."""


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    file: Path
    dtype: str  #: torch spelling (``float32``, ``bfloat16``, ...); safetensors' own for a dtype not listed
    shape: tuple[int, ...]
    nbytes: int


@dataclasses.dataclass
class Checkpoint:
    path: Path
    source: str  #: how it was named on the command line (a directory, a hub id, or the bundled tiny model)
    config: dict
    files: list[Path]
    tensors: dict[str, TensorMeta]
    attn_prefix: str
    sharded: bool

    @property
    def member(self) -> str:
        """The family member ``config.json`` names (``"MiniCPM-V 4.6"``, ``"MiniCPM-V 4.7"``, ``"MiniCPM-OCR"``)."""
        return member_of(self.config)[0]

    @property
    def architecture(self) -> str:
        """The architecture vLLM must resolve for it (``MiniCPMV4_7ForConditionalGeneration``, ...)."""
        return member_of(self.config)[1]

    @property
    def model_type(self) -> str:
        """``config.json``'s ``model_type`` of the member (``minicpm_ocr``, ...): what transformers must know."""
        return next((t for t, m in MEMBERS.items() if m[1] == self.architecture), MODEL_TYPE)

    @property
    def text_tower(self) -> str:
        """The text tower in words: ``"dense"``, or ``"MoE: E experts, top-K"`` for a sparse ``text_config``."""
        text = self.config.get("text_config") or {}
        if text.get("model_type") == MOE_TEXT or text.get("num_experts"):
            return f"MoE: {text.get('num_experts', '?')} experts, top-{text.get('num_experts_per_tok', '?')}"
        return "dense"

    def attn(self, proj: str, suffix: str) -> str:
        return f"{self.attn_prefix}{proj}.{suffix}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def reference_names(self) -> list[str]:
        return [self.attn(p, s) for p in (*QKV, "out_proj") for s in SUFFIXES]


# --------------------------------------------------------------------------------------------------------------------
# safetensors, and its errors as one line
# --------------------------------------------------------------------------------------------------------------------


def unreadable(path: Path, exc: BaseException, what: str = "") -> BadInput:
    """One :class:`BadInput` line for an exception safetensors (or the OS) raised on ``path``: the file, its size, and
    what went wrong in safetensors' words, e.g. ``.../model-00003-of-00003.safetensors (1.2 GiB): truncated or
    corrupt safetensors file -- the header does not match the file's size (incomplete metadata, file not fully
    covered)``. ``what`` names the tensor being read, if any."""
    from .._util import fmt_bytes

    try:
        size = f" ({fmt_bytes(path.stat().st_size)})"
    except OSError:
        size = ""
    where = f"{path}{size}{f', tensor {what}' if what else ''}"
    if isinstance(exc, OSError):
        return BadInput(f"{where}: cannot read: {exc_line(exc)}")
    detail = str(exc).replace("Error while deserializing header: ", "").strip()
    low = detail.lower()
    if "not fully covered" in low or "incomplete" in low or "out of bounds" in low or "invalid offset" in low:
        kind = "truncated or corrupt safetensors file -- the header does not match the file's size"
    elif "header too small" in low or "invalid header length" in low or "header too large" in low:
        kind = "not a safetensors file (or a truncated or corrupt one) -- no valid header"
    else:
        kind = "corrupt safetensors file"
    return BadInput(f"{where}: {kind} ({one_line(detail, 300)}); download it again")


def _no_safetensors(path: Path) -> BadInput:
    return BadInput(f"{path}: the safetensors package is not installed for {sys.executable} (every vLLM installs "
                    f"it: is this the Python that runs vLLM?)")


def read_header(path: Path) -> dict[str, TensorMeta]:
    """``{name: TensorMeta}`` of the tensors one safetensors file declares
    (:func:`vllm_minicpm_hotfix.checkpoint.read_header`: headers only, no torch), in the order
    ``safe_open(...).keys()`` gives them (sorted by name); ``TensorMeta.nbytes`` is the element count times the dtype's bits, rounded up to bytes (0 bits for a dtype not
    in ``_DTYPES``).

    Raises:
        BadInput: the file is truncated, corrupt or unreadable (one line naming it), or safetensors is missing.
    """
    out: dict[str, TensorMeta] = {}
    try:
        for name, info in reader.read_header(path):
            dtype, bits = _DTYPES.get(info.dtype, (info.dtype.lower(), 0))
            count = 1
            for d in info.shape:
                count *= d
            out[name] = TensorMeta(path, dtype, info.shape, (count * bits + 7) // 8)
    except BaseException as exc:
        raise _bad_file(path, exc) from _cause(exc)
    return out


def _cause(exc: BaseException) -> BaseException:
    return exc.__cause__ if isinstance(exc, reader.TensorError) and exc.__cause__ is not None else exc


def _bad_file(path: Path, exc: BaseException) -> BadInput:
    """The :class:`BadInput` for what reading ``path`` raised: one tensor's failure names the tensor; no safetensors
    says so; anything else safetensors raises on open (a Rust panic is a ``BaseException``) is :func:`unreadable`.
    ``KeyboardInterrupt`` and ``SystemExit`` are re-raised."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        raise exc
    if isinstance(exc, reader.TensorError):
        return unreadable(path, _cause(exc), exc.tensor)
    if isinstance(exc, ImportError):
        return _no_safetensors(path)
    return unreadable(path, exc)


def read_tensor(path: Path, name: str) -> Any:
    """Tensor ``name`` of ``path``, a CPU ``torch.Tensor``, from a ``safe_open`` handle of its own
    (:func:`vllm_minicpm_hotfix.checkpoint.read_tensor` says why one per tensor).

    Raises:
        BadInput: the file is unreadable (one line naming it, and the tensor if the file opened), or safetensors is
            missing.
    """
    try:
        return reader.read_tensor(path, name)
    except BaseException as exc:
        raise _bad_file(path, exc) from _cause(exc)


def stream_checkpoint(ckpt: Checkpoint, keep: Callable[[str], bool],
                      progress: Any = None) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` over the safetensors files in vLLM's order (files naturally sorted, names sorted within a
    file, as vLLM's ``safetensors_weights_iterator`` yields them), one fresh tensor at a time, nothing kept; tensors
    ``keep`` rejects are not read at all. ``progress.update(nbytes)`` after each tensor, if given."""
    for f in ckpt.files:
        for name, meta in ckpt.tensors.items():
            if meta.file != f or not keep(name):
                continue
            tensor = read_tensor(f, name)
            if progress is not None:
                progress.update(meta.nbytes)
            yield name, tensor


def read_reference(ckpt: Checkpoint) -> dict[str, Any]:
    """The vit_merger self-attention tensors, read on their own (small: 4 x hidden^2 + 4 x hidden values)."""
    return {name: read_tensor(ckpt.tensors[name].file, name) for name in ckpt.reference_names}


# --------------------------------------------------------------------------------------------------------------------
# The checkpoint
# --------------------------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: unreadable ({one_line(exc)})") from exc
    if not isinstance(data, dict):
        raise BadInput(f"{path}: unreadable (not a JSON object)")
    return data


def weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """``(safetensors files in load order, the index's weight_map or None)``
    (:func:`vllm_minicpm_hotfix.checkpoint.weight_files`).

    Raises:
        BadInput: no weights, an unreadable index, or a shard it lists that is missing.
    """
    try:
        return reader.weight_files(path)
    except reader.CheckpointError as exc:
        raise BadInput(str(exc)) from exc


def member_of(config: dict) -> tuple[str, str]:
    """``(member, architecture)`` of a ``config.json`` (by ``model_type``, else by ``architectures``); 4.6's for
    anything else (:func:`inspect_checkpoint` has refused a config no member names)."""
    if config.get("model_type") in MEMBERS:
        return MEMBERS[config["model_type"]]
    archs = config.get("architectures") or []
    return next((m for m in MEMBERS.values() if m[1] in archs), MEMBERS[MODEL_TYPE])


def inspect_checkpoint(path: Path, source: str) -> Checkpoint:
    """Read ``config.json`` and every safetensors header; raise :class:`BadInput` on anything that is not a usable
    MiniCPM-V 4.6 checkpoint (the message is one line naming the file or tensor)."""
    if not path.is_dir():
        raise BadInput(f"{path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BadInput(f"{path} is not a model checkpoint: it has no config.json")
    config = _read_json(cfg_file)
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type not in MEMBERS and not any(arch in archs for _, arch in MEMBERS.values()):
        raise BadInput(
            f"{path} is not a MiniCPM-V 4.6-family checkpoint: config.json has model_type {model_type!r}, "
            f"architectures {archs} (expected model_type {' or '.join(map(repr, MEMBERS))}, "
            f"{' or '.join(arch for _, arch in MEMBERS.values())})"
        )

    files, weight_map = weight_files(path)
    tensors: dict[str, TensorMeta] = {}
    for f in files:
        for name, meta in read_header(f).items():
            if name in tensors:
                raise BadInput(f"{path}: tensor {name} is in both {tensors[name].file.name} and {f.name}")
            tensors[name] = meta
    for name, fname in (weight_map or {}).items():
        meta = tensors.get(name)
        if meta is None or meta.file.name != fname:
            raise BadInput(f"{path / 'model.safetensors.index.json'}: says {name} is in {fname}, but that file does "
                           f"not hold it")

    prefix = next((p for p in ATTN_PREFIXES if f"{p}q_proj.weight" in tensors), None)
    if prefix is None:
        raise BadInput(
            f"{path}: no vit_merger self-attention weights (looked for {ATTN_PREFIXES[0]}q_proj.weight): "
            f"not a MiniCPM-V 4.6 checkpoint"
        )
    ckpt = Checkpoint(path, source, config, files, tensors, prefix, weight_map is not None)
    check_attention(ckpt)
    return ckpt


def check_attention(ckpt: Checkpoint) -> None:
    """The eight vit_merger self-attention tensors are there, floating point, and shaped as the config implies
    (``[hidden, hidden]`` weights, ``[hidden]`` biases, ``hidden`` = ``vision_config.hidden_size``)."""
    for name in ckpt.reference_names:
        if name not in ckpt.tensors:
            raise BadInput(f"{ckpt.path}: checkpoint tensor {name} is missing")
    hidden = (ckpt.config.get("vision_config") or {}).get("hidden_size")
    if isinstance(hidden, int):
        where = "vision_config.hidden_size in config.json"
    else:
        hidden = ckpt.tensors[ckpt.attn("q_proj", "weight")].shape[-1]
        where = f"{ckpt.attn('q_proj', 'weight')}'s input size"
    for proj in (*QKV, "out_proj"):
        for suffix, want in (("weight", (hidden, hidden)), ("bias", (hidden,))):
            name = ckpt.attn(proj, suffix)
            meta = ckpt.tensors[name]
            if meta.shape != want:
                raise BadInput(f"checkpoint tensor {name} has shape {list(meta.shape)}, expected {list(want)} "
                               f"({where} is {hidden})")
            if meta.dtype not in _FLOAT_DTYPES:
                raise BadInput(f"checkpoint tensor {name} has dtype {meta.dtype}, expected a floating-point dtype")


# --------------------------------------------------------------------------------------------------------------------
# Naming a model: a directory or a hub id
# --------------------------------------------------------------------------------------------------------------------


def resolve_model(spec: str | None, *, download: bool = True) -> tuple[Path, str]:
    """``(directory, how it was named)``. ``None`` is the bundled tiny checkpoint; an existing path is used as is;
    ``ORG/NAME`` is looked up in the huggingface_hub cache first (``local_files_only``), then downloaded unless the
    hub is offline (``HF_HUB_OFFLINE=1``) or ``download`` is false.

    Raises:
        BadInput: not a directory and not a resolvable hub id.
    """
    if spec is None:
        return DEFAULT_MODEL, f"bundled tiny checkpoint ({DEFAULT_MODEL})"
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{spec}: not a directory (give the checkpoint's folder)")
        return path.resolve(), str(path.resolve())
    if not _HUB_ID.match(spec) or spec.startswith((".", "~")):
        raise BadInput(f"{spec}: no such directory (and not a hub id of the form ORG/NAME)")
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError as exc:
        raise BadInput(f"{spec}: no such directory, and huggingface_hub is not installed to resolve it as a hub id") \
            from exc
    patterns = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
    try:
        folder = snapshot_download(spec, local_files_only=True, allow_patterns=patterns)
        return Path(folder), f"{spec} (huggingface_hub cache: {folder})"
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    except Exception as exc:  # e.g. an invalid repo id
        raise BadInput(f"{spec}: cannot resolve as a hub id: {exc_line(exc)}") from exc
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))
    cache = getattr(constants, "HF_HUB_CACHE", "the huggingface_hub cache")
    if offline or not download:
        raise BadInput(
            f"{spec} is not in the local Hugging Face cache ({cache}) and the hub is offline"
            f"{' (HF_HUB_OFFLINE=1)' if offline else ''}: download it first (`hf download {spec}`) or pass its "
            f"directory with --model"
        )
    print(f"downloading {spec} into {cache} ...", file=sys.stderr)
    try:
        folder = snapshot_download(spec, allow_patterns=patterns)
    except Exception as exc:
        raise BadInput(f"{spec}: not in the local Hugging Face cache ({cache}) and the download failed: "
                       f"{exc_line(exc, 300)}") from exc
    return Path(folder), f"{spec} (downloaded to {folder})"
