"""``vllm-minicpm-hotfix verify``: load a MiniCPM-V 4.6 checkpoint through *this* vLLM and compare bit for bit.

    vllm-minicpm-hotfix verify                          # the tiny checkpoint shipped in the package: a self-test
    vllm-minicpm-hotfix verify --model /models/MiniCPM-V-4.6
    vllm-minicpm-hotfix verify --model openbmb/MiniCPM-V-4.6     # a hub id, from the huggingface_hub cache

What it does, in order:

1. Checks the checkpoint without importing vLLM or torch: ``config.json`` says MiniCPM-V 4.6, the safetensors files
   (one file or sharded through ``model.safetensors.index.json``) are complete and hold the window-merger attention
   tensors ``...vit_merger.self_attn.{q,k,v,out}_proj.{weight,bias}`` with the shapes the config implies. Any problem
   is *bad input*: one line, exit 2.
2. Starts vLLM the way its own processes do -- ``vllm.plugins.load_general_plugins()``, then the import of
   ``vllm.model_executor.models.minicpmv4_6`` -- with the hotfix exactly as this environment has it: ``verify`` never
   installs the hook itself. If no activation path fired it says "hotfix not active" and carries on (that is what
   ``vllm serve`` would get here).
3. Builds the model class vLLM resolves for the checkpoint (``get_model_architecture``) on the chosen device and feeds
   the checkpoint, streamed tensor by tensor from the safetensors files, to the model's own top-level
   ``load_weights`` -- the call vLLM's ``DefaultModelLoader`` makes. By default the language model is left out with
   vLLM's own ``mm_encoder_only`` switch: vLLM builds it on the ``meta`` device (no memory) behind a
   ``StageMissingLayer`` that its ``AutoWeightsLoader`` skips, and its tensors are not even read from disk. The vision
   tensors take exactly the path they take in ``vllm serve``: the same top-level ``load_weights``, the same
   ``hf_to_vllm_mapper``, the same ``AutoWeightsLoader`` descent into ``vit_merger.self_attn``. ``--full-model``
   builds and loads everything instead.
4. Compares vLLM's fused ``vit_merger.self_attn.qkv_proj.{weight,bias}`` with ``cat(q, k, v)`` of the checkpoint and
   ``out_proj`` with the checkpoint's ``out_proj`` (the reference tensors are read separately; they are small), after
   the dtype cast vLLM itself applies on copy. A mismatch names the checkpoint tensor whose rows differ.

Exit status: 0 every tensor matches; 1 a tensor differs, vLLM's own load raised (the error on one line), or vLLM is
unusable here; 2 bad input (not a 4.6 checkpoint, missing or truncated files, wrong shapes, hub id not cached while
offline). No traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import quant_layout
from ._cliutil import (
    exc_line,
    fmt_bytes,
    one_line,
    peak_rss_mib,
    print_table,
    print_verdict,
    vllm_distributions,
)

EXIT_OK, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2

DEFAULT_MODEL = Path(__file__).resolve().parent / "data" / "tiny-minicpm-v46"
MODEL_TYPE = "minicpmv4_6"
ARCHITECTURE = "MiniCPMV4_6ForConditionalGeneration"
MODULE = "vllm.model_executor.models.minicpmv4_6"
#: Where checkpoints keep the window-merger attention (transformers >= 5.7 layout first, the older flat one second;
#: vLLM's ``hf_to_vllm_mapper`` maps both to ``vit_merger.``).
ATTN_PREFIXES = ("model.vision_tower.vit_merger.self_attn.", "model.vit_merger.self_attn.")
#: Where vLLM keeps it.
PARAM_PREFIX = "vit_merger.self_attn."
QKV = ("q_proj", "k_proj", "v_proj")
SUFFIXES = ("weight", "bias")

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}
_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}
_MAX_HEADER = 100 * 1024 * 1024


class BadInput(Exception):
    """The checkpoint (or the way it was named) is unusable: exit 2."""


class VerifyFailed(Exception):
    """vLLM could not be used or its own load raised: exit 1."""


# --------------------------------------------------------------------------------------------------------------------
# The checkpoint, inspected without torch or vLLM
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    file: Path
    dtype: str  #: torch spelling (``float32``, ``bfloat16``, ...)
    shape: tuple[int, ...]
    nbytes: int
    offset: int  #: absolute byte offset of the data in ``file``


@dataclasses.dataclass
class Checkpoint:
    path: Path
    source: str  #: how it was named on the command line (a directory, a hub id, or the bundled tiny model)
    config: dict
    files: list[Path]
    tensors: dict[str, TensorMeta]
    attn_prefix: str
    sharded: bool

    def attn(self, proj: str, suffix: str) -> str:
        return f"{self.attn_prefix}{proj}.{suffix}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def reference_names(self) -> list[str]:
        return [self.attn(p, s) for p in (*QKV, "out_proj") for s in SUFFIXES]


def _natural_key(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def read_safetensors_header(path: Path) -> dict[str, TensorMeta]:
    """The tensors a safetensors file declares, checked against its size (a truncated file is caught here)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadInput(f"{path}: not a safetensors file (only {len(head)} bytes)")
            n = int.from_bytes(head, "little")
            if n <= 0 or n > min(size - 8, _MAX_HEADER):
                raise BadInput(f"{path}: not a safetensors file (header length {n}, file size {size})")
            raw = f.read(n)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc_line(exc)}") from exc
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except ValueError as exc:
        raise BadInput(f"{path}: corrupt safetensors header ({one_line(exc)})") from exc
    data_size = size - 8 - n
    out: dict[str, TensorMeta] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES.get(meta["dtype"], str(meta["dtype"]).lower())
            shape = tuple(int(x) for x in meta["shape"])
            start, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BadInput(f"{path}: corrupt safetensors header entry for {name!r}") from exc
        if not 0 <= start <= end <= data_size:
            raise BadInput(
                f"{path}: tensor {name} lies beyond the end of the file (bytes {start}-{end} of {data_size}): "
                f"truncated or corrupt download"
            )
        out[name] = TensorMeta(path, dtype, shape, end - start, 8 + n + start)
    return out


def inspect_checkpoint(path: Path, source: str) -> Checkpoint:
    """Read ``config.json`` and every safetensors header; raise :class:`BadInput` on anything that is not a usable
    MiniCPM-V 4.6 checkpoint (the message is one line naming the file or tensor)."""
    if not path.is_dir():
        raise BadInput(f"{path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise BadInput(f"{path} is not a model checkpoint: it has no config.json")
    try:
        config = json.loads(cfg_file.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise BadInput(f"{cfg_file}: unreadable ({one_line(exc)})") from exc
    model_type = config.get("model_type")
    archs = config.get("architectures") or []
    if model_type != MODEL_TYPE and ARCHITECTURE not in archs:
        raise BadInput(
            f"{path} is not a MiniCPM-V 4.6 checkpoint: config.json has model_type {model_type!r}, architectures "
            f"{archs} (expected model_type {MODEL_TYPE!r}, {ARCHITECTURE})"
        )

    index_file = path / "model.safetensors.index.json"
    weight_map: dict[str, str] | None = None
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError("empty weight_map")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise BadInput(f"{index_file}: unreadable ({one_line(exc)})") from exc
        files = sorted({path / name for name in weight_map.values()}, key=_natural_key)
        for f in files:
            if not f.is_file():
                raise BadInput(f"{path}: shard {f.name} listed in {index_file.name} is missing")
    else:
        files = sorted(path.glob("*.safetensors"), key=_natural_key)
        if not files:
            other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
            extra = f" (found {', '.join(other[:3])}: verify reads safetensors only)" if other else ""
            raise BadInput(f"{path}: no *.safetensors weights{extra}")

    tensors: dict[str, TensorMeta] = {}
    for f in files:
        for name, meta in read_safetensors_header(f).items():
            if name in tensors:
                raise BadInput(f"{path}: tensor {name} is in both {tensors[name].file.name} and {f.name}")
            tensors[name] = meta
    if weight_map is not None:
        for name, fname in weight_map.items():
            meta = tensors.get(name)
            if meta is None or meta.file.name != fname:
                raise BadInput(f"{index_file}: says {name} is in {fname}, but that file does not hold it")

    prefix = next((p for p in ATTN_PREFIXES if f"{p}q_proj.weight" in tensors), None)
    if prefix is None:
        raise BadInput(
            f"{path}: no vit_merger self-attention weights (looked for {ATTN_PREFIXES[0]}q_proj.weight): "
            f"not a MiniCPM-V 4.6 checkpoint"
        )
    ckpt = Checkpoint(path, source, config, files, tensors, prefix, weight_map is not None)
    for name in ckpt.reference_names:
        if name not in tensors:
            raise BadInput(f"{path}: checkpoint tensor {name} is missing")
    vision = config.get("vision_config") or {}
    hidden = vision.get("hidden_size")
    if not isinstance(hidden, int):
        hidden = tensors[ckpt.attn("q_proj", "weight")].shape[-1]
        where = f"{ckpt.attn('q_proj', 'weight')}'s input size"
    else:
        where = "vision_config.hidden_size in config.json"
    for proj in (*QKV, "out_proj"):
        for suffix, want in (("weight", (hidden, hidden)), ("bias", (hidden,))):
            name = ckpt.attn(proj, suffix)
            meta = tensors[name]
            if meta.shape != want:
                raise BadInput(
                    f"checkpoint tensor {name} has shape {list(meta.shape)}, expected {list(want)} "
                    f"({where} is {hidden})"
                )
            if meta.dtype not in _FLOAT_DTYPES:
                raise BadInput(f"checkpoint tensor {name} has dtype {meta.dtype}, expected a floating-point dtype")
    return ckpt


# --------------------------------------------------------------------------------------------------------------------
# Naming a model: a directory or a hub id
# --------------------------------------------------------------------------------------------------------------------

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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


# --------------------------------------------------------------------------------------------------------------------
# vLLM
# --------------------------------------------------------------------------------------------------------------------


def start_vllm_like_its_processes(device: str) -> tuple[Any, str]:
    """Import vLLM, run its general plugins (as EngineCore and the workers do) and import the MiniCPM-V 4.6 model
    module. Returns ``(module, vLLM version)``. The hotfix is whatever this environment activated."""
    if device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if not vllm_distributions():
        raise VerifyFailed(f"vLLM is not installed for this Python ({sys.executable})")
    try:
        import vllm
    except Exception as exc:
        raise VerifyFailed(f"import vllm failed: {exc_line(exc)}") from exc
    version = str(getattr(vllm, "__version__", "?"))
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except Exception as exc:  # a plugin raising in register(): vLLM would fail the same way
        raise VerifyFailed(f"vLLM's general plugins failed to load: {exc_line(exc)}") from exc
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as exc:
        raise VerifyFailed(
            f"vLLM {version} has no MiniCPM-V 4.6 model ({MODULE} is missing; it exists from vLLM 0.22)"
        ) from exc
    except Exception as exc:
        raise VerifyFailed(f"importing {MODULE} failed: {exc_line(exc)}") from exc
    return module, version


def hotfix_state() -> tuple[bool, str, dict]:
    """``(active, one-line description, status())`` of the hotfix in *this* process."""
    import vllm_minicpm_hotfix

    st = vllm_minicpm_hotfix.status()
    if not st.get("hook_installed"):
        return False, (
            "not active (no activation path fired in this process; `vllm-minicpm-hotfix doctor` says why)"
        ), st
    boot = sys.modules.get("vllm_minicpm_hotfix._bootstrap")
    by = ", ".join(dict.fromkeys(getattr(boot, "activations", None) or [])) or "an explicit install()"
    parts = []
    for name, fix in sorted(st.get("fixes", {}).items()):
        if fix.get("error"):
            parts.append(f"{name}: hook ERROR ({fix['error']})")
        elif fix.get("applied"):
            parts.append(f"{name}: PATCHED (verdict {fix.get('verdict')})")
        else:
            parts.append(f"{name}: not applied ({fix.get('why')})")
    if not st.get("module_imported"):
        parts.append("the hook did not see the model module")
    return True, f"active (mode {st.get('mode')}, activated by {by}): " + "; ".join(parts), st


_distributed: set[str] = set()


def _ensure_distributed(device: str) -> None:
    if device == "cpu":
        from .vllm_cpu import ensure_distributed

        ensure_distributed()
        return
    if device in _distributed:
        return
    import torch.distributed as dist
    from vllm.distributed.parallel_state import init_distributed_environment

    from .vllm_cpu import _free_port

    if not dist.is_initialized():
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", local_rank=0,
            backend="nccl",
        )
    _distributed.add(device)


@dataclasses.dataclass
class Built:
    model: Any
    vllm_config: Any
    model_cls: type
    encoder_only: bool
    dtype: Any
    #: why the encoder-only build was not possible (then the whole model was built), or None
    fallback: str | None = None


def build_model(ckpt: Checkpoint, module: Any, *, device: str, dtype: str, full: bool) -> Built:
    """vLLM's model for ``ckpt`` on ``device``, not loaded. ``full=False``: vLLM's ``mm_encoder_only`` (the language
    model on ``meta`` behind a ``StageMissingLayer``); where this vLLM cannot build the model that way, the whole
    model, with the reason in :attr:`Built.fallback`."""
    if full:
        return _build(ckpt, module, device=device, dtype=dtype, encoder_only=False)
    try:
        return _build(ckpt, module, device=device, dtype=dtype, encoder_only=True)
    except Exception as exc:
        built = _build(ckpt, module, device=device, dtype=dtype, encoder_only=False)
        built.fallback = exc_line(exc, 240)
        return built


def _build(ckpt: Checkpoint, module: Any, *, device: str, dtype: str, encoder_only: bool) -> Built:
    import torch
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.parallel_state import (
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    _ensure_distributed(device)
    kwargs: dict[str, Any] = dict(model=str(ckpt.path), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True)
    if encoder_only:
        kwargs["mm_encoder_only"] = True
    try:
        model_config = ModelConfig(**kwargs)
    except TypeError:
        if not encoder_only:
            raise
        kwargs.pop("mm_encoder_only")  # a vLLM without the switch: build everything
        encoder_only = False
        model_config = ModelConfig(**kwargs)
    config_kwargs: dict[str, Any] = dict(model_config=model_config, device_config=DeviceConfig(device=device))
    if encoder_only:
        # An encoder-only instance has no KV cache: vLLM switches prefix caching off for it, but too late for
        # 0.30.0's hybrid-model check ("--mamba-block-size can only be set with --enable-prefix-caching").
        from vllm.config import CacheConfig

        config_kwargs["cache_config"] = CacheConfig(enable_prefix_caching=False)
    vllm_config = VllmConfig(**config_kwargs)
    torch_dtype = model_config.dtype
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, {"float": "float32", "half": "float16"}.get(torch_dtype, torch_dtype))
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
        try:
            from vllm.model_executor.model_loader.utils import get_model_architecture

            model_cls, _ = get_model_architecture(model_config)
        except Exception:  # an older/newer layout of vLLM's loader utils: the class this module defines
            model_cls = getattr(module, ARCHITECTURE)
        from .vllm_cpu import _default_dtype

        if vllm_config.quant_config is not None:  # as vLLM's initialize_model does (maps the quant config's lists)
            from vllm.model_executor.model_loader.utils import configure_quant_config

            configure_quant_config(vllm_config.quant_config, model_cls)
        with _default_dtype(torch_dtype), torch.device(device):
            model = model_cls(vllm_config=vllm_config)
    if encoder_only and not getattr(model, "_language_model_names", None):
        encoder_only = False  # this vLLM's model class does not mark its language model: it was built in full
    return Built(model, vllm_config, model_cls, encoder_only, torch_dtype)


def language_model_filter(built: Built, ckpt: Checkpoint) -> Callable[[str], bool]:
    """``keep(name)``: False for checkpoint tensors vLLM's loader would route to the (encoder-only: missing) language
    model or ignore, decided with the model's own ``hf_to_vllm_mapper``. The vit_merger tensors are always kept."""
    if not built.encoder_only:
        return lambda name: True
    roots = tuple(built.model._language_model_names)
    mapper = getattr(built.model_cls, "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "_map_name", None) or getattr(mapper, "map_name", None)

    def keep(name: str) -> bool:
        if name.startswith(ckpt.attn_prefix):
            return True
        try:
            mapped = map_name(name) if map_name is not None else name
        except Exception:
            return True
        if mapped is None:
            return False  # vLLM's mapper drops it (e.g. "mtp.")
        return not any(mapped == r or mapped.startswith(r + ".") for r in roots)

    return keep


def read_tensor(fh: Any, name: str, meta: TensorMeta) -> Any:
    """One tensor, read with plain ``readinto`` into memory it owns (no mmap: a memory-mapped read would leave the
    checkpoint's pages in this process's resident set on top of the model's copy)."""
    import torch

    dtype = getattr(torch, meta.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise BadInput(f"{meta.file}: tensor {name} has dtype {meta.dtype}, which torch cannot read")
    buf = bytearray(meta.nbytes)
    try:
        fh.seek(meta.offset)
        got = fh.readinto(buf)
    except OSError as exc:
        raise BadInput(f"{meta.file}: cannot read tensor {name}: {exc_line(exc)}") from exc
    if got != meta.nbytes:
        raise BadInput(f"{meta.file}: tensor {name} is cut short ({got} of {meta.nbytes} bytes): truncated file")
    count = 1
    for d in meta.shape:
        count *= d
    if count * torch.empty((), dtype=dtype).element_size() != meta.nbytes:
        raise BadInput(f"{meta.file}: tensor {name}: {meta.nbytes} bytes do not hold {meta.dtype} {list(meta.shape)}")
    if not meta.nbytes:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(meta.shape)


def stream_checkpoint(ckpt: Checkpoint, keep: Callable[[str], bool], progress: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` over the safetensors files in vLLM's order (files naturally sorted, names sorted within a
    file, as ``safetensors.safe_open(...).keys()`` yields them), one fresh tensor at a time, nothing kept; tensors
    ``keep`` rejects are not read at all."""
    for f in ckpt.files:
        names = sorted(n for n, m in ckpt.tensors.items() if m.file == f)
        try:
            fh = open(f, "rb", buffering=0)
        except OSError as exc:
            raise BadInput(f"{f}: cannot open: {exc_line(exc)}") from exc
        with fh:
            for name in names:
                if not keep(name):
                    continue
                meta = ckpt.tensors[name]
                tensor = read_tensor(fh, name, meta)
                if progress is not None:
                    progress.update(meta.nbytes)
                yield name, tensor


def read_reference(ckpt: Checkpoint) -> dict[str, Any]:
    """The vit_merger self-attention tensors, read on their own (small: 4 x hidden^2 + 4 x hidden values)."""
    out: dict[str, Any] = {}
    for name in ckpt.reference_names:
        meta = ckpt.tensors[name]
        try:
            with open(meta.file, "rb", buffering=0) as fh:
                out[name] = read_tensor(fh, name, meta)
        except OSError as exc:
            raise BadInput(f"{meta.file}: cannot read {name}: {exc_line(exc)}") from exc
    return out


@dataclasses.dataclass
class Row:
    tensor: str
    shape: str
    dtype: str
    ok: bool
    result: str


def _compare(got: Any, parts: list[tuple[str, Any]]) -> tuple[bool, str]:
    """``got`` (vLLM's parameter) against the checkpoint tensors ``parts`` stacked on dim 0."""
    import torch

    for name, t in parts:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            return False, f"FAIL checkpoint tensor {name} holds {bad} non-finite value(s) (NaN/Inf): corrupt"
    want_shape = [sum(t.shape[0] for _, t in parts), *parts[0][1].shape[1:]]
    if list(got.shape) != want_shape:
        return False, f"MISMATCH shape {list(got.shape)} != {want_shape} from {', '.join(n for n, _ in parts)}"
    start, bad_parts = 0, []
    for name, t in parts:
        rows = t.shape[0]
        mine = got[start:start + rows]
        ref = t.to(got.dtype)
        if not torch.equal(mine, ref):
            differ = int((mine != ref).sum())
            diff = (mine.double() - ref.double()).abs()
            diff = diff[torch.isfinite(diff)]
            worst = f", max |diff| {float(diff.max()):.3g}" if diff.numel() else ""
            where = f"rows {start}:{start + rows} " if len(parts) > 1 else ""
            bad_parts.append(f"{where}!= checkpoint {name} ({differ}/{mine.numel()} values differ{worst})")
        start += rows
    if bad_parts:
        return False, "MISMATCH " + "; ".join(bad_parts)
    what = "cat(" + ", ".join(n.rsplit(".", 2)[-2] for n, _ in parts) + ")" if len(parts) > 1 else "checkpoint"
    return True, f"OK == {what}"


def compare(built: Built, ckpt: Checkpoint, reference: dict[str, Any]) -> list[Row]:
    params = dict(built.model.named_parameters())
    rows = []
    targets = [("qkv_proj", QKV), ("out_proj", ("out_proj",))]
    for fused, sources in targets:
        for suffix in SUFFIXES:
            pname = f"{PARAM_PREFIX}{fused}.{suffix}"
            parts = [(ckpt.attn(p, suffix), reference[ckpt.attn(p, suffix)]) for p in sources]
            ck_dtype = str(parts[0][1].dtype).replace("torch.", "")
            param = params.get(pname)
            if param is None:
                rows.append(Row(pname, "-", "-", False, f"FAIL vLLM's model has no parameter {pname}"))
                continue
            got = param.detach()
            if got.device.type == "meta":
                rows.append(Row(pname, str(list(got.shape)), "-", False, "FAIL parameter is on the meta device"))
                continue
            got = got.to("cpu")
            dtype = str(got.dtype).replace("torch.", "")
            if dtype != ck_dtype:
                dtype = f"{dtype} (checkpoint {ck_dtype})"
            ok, result = _compare(got, parts)
            rows.append(Row(pname, str(list(got.shape)), dtype, ok, result))
    return rows


# --------------------------------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-minicpm-hotfix verify",
        description="Load a MiniCPM-V 4.6 checkpoint through this environment's vLLM (with the hotfix as the "
        "environment activates it) and compare every vit_merger qkv_proj / out_proj tensor with the checkpoint, "
        "bit for bit.",
        epilog="Exit status: 0 all match; 1 a tensor differs or vLLM's own load raised; 2 bad input.",
    )
    p.add_argument("--model", metavar="DIR|HUB_ID", default=None,
                   help="checkpoint directory or Hugging Face hub id (default: the tiny checkpoint in the package)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where vLLM builds the model (cpu)")
    p.add_argument("--dtype", default="checkpoint",
                   choices=("checkpoint", "auto", "float32", "bfloat16", "float16"),
                   help="model dtype: 'checkpoint' (the dtype the vit_merger tensors are stored in: no rounding, "
                   "default), 'auto' (what `vllm serve` picks), float32, bfloat16, float16")
    p.add_argument("--full-model", action="store_true",
                   help="build and load the language model too (default: left out through vLLM's mm_encoder_only)")
    p.add_argument("--debug", action="store_true", help="tracebacks and vLLM's own INFO logging")
    return p


def _vllm_label() -> str:
    dists = vllm_distributions()
    return ", ".join(f"{d} {v}" for d, v in dists) if dists else "absent"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    t0 = time.perf_counter()
    if not args.debug:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        return _run(args, t0)
    except BadInput as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {one_line(exc, 1000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except VerifyFailed as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        print_verdict(False, f"FAIL: {one_line(exc, 1000)}")
        return EXIT_FAIL
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, t0: float) -> int:
    times: dict[str, float] = {}
    path, source = resolve_model(args.model)
    ckpt = inspect_checkpoint(path, source)
    stored = ckpt.tensors[ckpt.attn("q_proj", "weight")].dtype
    dtype = stored if args.dtype == "checkpoint" else args.dtype

    print("vllm-minicpm-hotfix verify")
    n_files = f"{len(ckpt.files)} safetensors file{'s' if len(ckpt.files) > 1 else ''}" + (
        " (sharded)" if ckpt.sharded else "")
    print(f"  checkpoint  {ckpt.source}")
    print(f"              {n_files}, {len(ckpt.tensors)} tensors, {fmt_bytes(ckpt.nbytes)}; "
          f"vit_merger at {ckpt.attn_prefix}*")
    print(f"  vLLM        {_vllm_label()}; device {args.device}; dtype {dtype}"
          + (f" (stored {stored})" if args.dtype == "checkpoint" else ""))
    sys.stdout.flush()

    t = time.perf_counter()
    module, version = start_vllm_like_its_processes(args.device)
    times["import vLLM"] = time.perf_counter() - t
    active, hotfix_line, _status = hotfix_state()
    print(f"  hotfix      {hotfix_line}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise VerifyFailed("--device cuda: torch sees no CUDA device here")

    if quant_layout.quant_method(path) is not None:  # a quantized checkpoint: its vision layers, stored vs built
        for i, text in enumerate(quant_layout.report_lines(quant_layout.report(path))[1]):
            print(f"  {'quantized' if i == 0 else '':10}  {text}")
    reference = read_reference(ckpt)

    t = time.perf_counter()
    try:
        built = build_model(ckpt, module, device=args.device, dtype=dtype, full=args.full_model)
    except (BadInput, VerifyFailed):
        raise
    except Exception as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        raise VerifyFailed(f"vLLM {version} could not build the model: {exc_line(exc)}") from exc
    times["build"] = time.perf_counter() - t
    keep = language_model_filter(built, ckpt)
    fed = [n for n in ckpt.tensors if keep(n)]
    left_out = len(ckpt.tensors) - len(fed)
    fed_bytes = sum(ckpt.tensors[n].nbytes for n in fed)
    if built.encoder_only:
        scope = (f"language model left out (vLLM's mm_encoder_only: built on meta, {left_out} of its tensors not "
                 f"read); the vision tensors take vLLM's normal path")
    elif built.fallback:
        scope = (f"whole model built and loaded (vLLM {version} cannot build it with the language model left out: "
                 f"{built.fallback})")
    else:
        scope = "whole model built and loaded"
    print(f"  load        {built.model_cls.__name__}.load_weights over {len(fed)} tensors ({fmt_bytes(fed_bytes)}); "
          f"{scope}")
    sys.stdout.flush()

    progress = None
    try:
        from tqdm.auto import tqdm

        progress = tqdm(total=fed_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="loading",
                        file=sys.stderr, disable=None, leave=False)
    except Exception:
        progress = None
    t = time.perf_counter()
    from vllm.config import set_current_vllm_config

    try:
        with set_current_vllm_config(built.vllm_config):
            built.model.load_weights(stream_checkpoint(ckpt, keep, progress))
    except BadInput:
        raise
    except Exception as exc:
        if args.debug:
            import traceback

            traceback.print_exc()
        state = "hotfix active" if active else "hotfix not active"
        raise VerifyFailed(f"vLLM {version}'s own load_weights raised ({state}): {exc_line(exc)}") from exc
    finally:
        if progress is not None:
            progress.close()
    times["load"] = time.perf_counter() - t

    t = time.perf_counter()
    rows = compare(built, ckpt, reference)
    times["compare"] = time.perf_counter() - t
    print()
    print_table(["tensor", "shape", "dtype", "result"], [(r.tensor, r.shape, r.dtype, r.result) for r in rows],
                style_col=3)
    total = time.perf_counter() - t0
    rss = peak_rss_mib()
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
    print(f"\n  time {total:.1f} s ({timing}); peak RSS {fmt_bytes(rss * 2**20) if rss else '?'}")
    bad = [r for r in rows if not r.ok]
    state = "hotfix active" if active else "hotfix not active"
    if not bad:
        print_verdict(True, f"PASS: all {len(rows)} vit_merger qkv_proj/out_proj tensors equal the checkpoint bit "
                            f"for bit through vLLM {version}'s own load_weights ({state})")
        return EXIT_OK
    first = bad[0]
    print_verdict(False, f"FAIL: {len(bad)} of {len(rows)} vit_merger tensors do not match the checkpoint ({state}); "
                         f"{first.tensor}: {first.result}")
    return EXIT_FAIL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
