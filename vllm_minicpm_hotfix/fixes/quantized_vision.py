"""Build the vision side of a quantized MiniCPM-V 4.6 checkpoint as the checkpoint stores it.

What breaks
-----------
vLLM hands the model's one quantization config to the vision tower (``vpm``, vLLM's ``Idefics2VisionTransformer``)
and the window merger (``vit_merger``) as well as to the language model
(``MiniCPMV4_6ForConditionalGeneration.__init__`` in ``vllm/model_executor/models/minicpmv4_6.py``, 0.22-0.33). Each
linear layer then asks ``quant_config.get_quant_method(layer, prefix)`` whether to be quantized, and the config
answers from its own lists: AWQ's ``modules_to_not_convert`` (substring match), GPTQ's
``modules_in_block_to_quantize`` (substring match), bitsandbytes' ``llm_int8_skip_modules``. The lists a quantizer
writes name modules as transformers does (``model.vision_tower``, ``model.merger``, ``self_attn.q_proj``); vLLM maps
them through the model's ``hf_to_vllm_mapper``, whose prefix rules end in a dot (``"model.vision_tower."``), so
``model.vision_tower`` never becomes ``vpm`` and the vision layers are built quantized although the checkpoint stores
them as plain bf16 -- or, with a GPTQ list of ``self_attn.q_proj``…, the vision attention is built GPTQ because the
substring also matches ``vpm.encoder.layers.N.self_attn.q_proj``. Construction then fails on a 4-bit kernel that
cannot take the vision dimensions, or loading fails on ``….mlp.fc1.weight``.

What the fix does
-----------------
It wraps ``MiniCPMV4_6ForConditionalGeneration.__init__``: while the model is constructed, every linear layer of
``vpm``, ``vit_merger`` and ``merger`` gets the quant method the checkpoint's own tensors call for, read from the
safetensors headers (:mod:`vllm_minicpm_hotfix.quant_layout`; no tensor data is read):

* all tensors of the layer's checkpoint modules floating (``F16``/``BF16``/``F32``) -> vLLM's
  ``UnquantizedLinearMethod``;
* quantized (int32 ``qweight``…, uint8 bitsandbytes ``weight``) -> whatever vLLM's config returns, which must then be
  a quantized method (else :class:`QuantizedVisionError`);
* some shards of a fused layer (``qkv_proj`` = q, k, v) float and some quantized -> :class:`QuantizedVisionError`;
* no checkpoint tensor for the layer, or the checkpoint not readable -> vLLM's own answer, unchanged.

The language model is left to vLLM. After construction, a vision layer vLLM builds as a plain ``torch.nn.Linear``
(the merger, ``vit_merger.linear_1/2``) whose checkpoint tensors are quantized raises :class:`QuantizedVisionError`
at once, instead of an ``AssertionError`` deep in the weight loader.

The decision
------------
Probed at the first construction that gets a quantization config (``DEFER_AT``): :func:`probe` builds vLLM's AWQ
config from the skip list quantizers write (``modules_to_not_convert: ["model.vision_tower", "model.merger"]``),
mapped as vLLM maps it, and starts the model class's ``__init__`` as it now stands on a stand-in instance for a
checkpoint folder whose vision layer ``vpm.encoder.layers.0.mlp.fc1`` is stored bf16; the first thing vLLM's own
``__init__`` reads from the config stops it, after asking the config which quant method that layer gets.
``broken``: a quantized one (stock 0.22-0.33); ``correct``: unquantized (a vLLM that honours the names, or this fix
applied); ``undetermined`` if the stand-in cannot be set up.

Upstream
--------
none known.

Remove when
-----------
its probe sees vLLM's AWQ config, built from the skip list quantizers write (``model.vision_tower``,
``model.merger``), give the bf16 vision layer an unquantized method in stock ``__init__`` on every release the hotfix
supports; every release measured so far quantizes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .. import decision
from ._base import MODEL_CLASS, V46, V47, deferred, wrap

if TYPE_CHECKING:  # annotations only: the module is imported at first use (_layout)
    from ..quant_layout import LayerRow, ModuleStorage

NAME = "quantized_vision"
LABEL = "quantized-checkpoint vision layers"
MODELS = (V46, V47)
#: Matters only for these checkpoints: doctor reports it unapplied as WARN, not FAIL (``doctor --model`` judges a
#: given checkpoint).
SCOPE = "quantized checkpoints"

#: Probed at first use (:mod:`._base.deferred`): the first model construction that gets a quantization config. An
#: unquantized checkpoint never takes this path, and the probe (an AWQ config and vLLM's quantization machinery,
#: 0.2-0.4 s of CPU) would otherwise run in every vLLM process.
DEFER_AT = f"{MODEL_CLASS}.__init__"
PATH = "gets a quantization config"

#: vLLM's top-level names of the vision side.
VISION_VLLM_PREFIXES = ("vpm.", "vit_merger.", "merger.")
#: Used when the model class has no ``packed_modules_mapping``.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
#: Attribute on the constructed model: the per-layer rows this fix decided (for tests, ``verify``).
ROWS_ATTR = "_vllm_minicpm_hotfix_vision_rows"

log = logging.getLogger("vllm.minicpm_hotfix")


class QuantizedVisionError(ValueError):
    """A vision layer of a quantized checkpoint cannot be built the way the checkpoint stores it."""


# --------------------------------------------------------------------------------------------------------------------
# The plan: checkpoint storage, in vLLM's names
# --------------------------------------------------------------------------------------------------------------------


def _rename(model_cls: type) -> Callable[[str], str | None]:
    """Checkpoint module name -> vLLM module name, by the model's ``hf_to_vllm_mapper`` without its stacked rules
    (what vLLM's ``get_rename_mapper()`` / ``get_unstacked_mapper()`` give quantization configs)."""
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    if mapper is None:
        return lambda m: m
    if getattr(mapper, "orig_to_new_stacked", None):
        mapper = dataclasses.replace(mapper, orig_to_new_stacked={})

    def rename(module: str) -> str | None:
        out = mapper._map_name(module + ".weight")
        if isinstance(out, tuple):  # a (name, shard id) form
            out = out[0]
        return None if out is None else out[: -len(".weight")] if out.endswith(".weight") else out

    return rename



def _layout() -> ModuleType:
    """:mod:`vllm_minicpm_hotfix.quant_layout`, imported at the first quantized construction (its dataclasses cost
    the hook a few milliseconds in every process otherwise)."""
    from .. import quant_layout

    return quant_layout

@dataclasses.dataclass
class VisionPlan:
    """The checkpoint's vision storage, keyed by vLLM module name."""

    source: str
    storage: dict[str, ModuleStorage]  #: by checkpoint module name
    by_vllm: dict[str, str]  #: vLLM module name -> checkpoint module name
    packed: Mapping[str, list[str]]
    rows: list[LayerRow] = dataclasses.field(default_factory=list)

    @classmethod
    def build(cls, storage: Mapping[str, ModuleStorage], model_cls: type, source: str) -> VisionPlan:
        rename = _rename(model_cls)
        by_vllm = {}
        for module in storage:
            new = rename(module)
            if new is not None:
                by_vllm[new] = module
        packed = getattr(model_cls, "packed_modules_mapping", None) or DEFAULT_PACKED
        return cls(source, dict(storage), by_vllm, packed)

    def checkpoint_modules(self, layer: str) -> list[str]:
        """The checkpoint modules vLLM's layer ``layer`` (a fused ``qkv_proj`` too) loads from."""
        head, _, last = layer.rpartition(".")
        names = [f"{head}.{s}" if head else s for s in self.packed.get(last, [])] or [layer]
        return [self.by_vllm[n] for n in names if n in self.by_vllm]

    def stored(self, layer: str) -> tuple[str, list[str]]:
        modules = self.checkpoint_modules(layer)
        return _layout().stored_kind(modules, self.storage), modules

    def describe(self, modules: list[str]) -> str:
        return "; ".join(f"{m}: {self.storage[m].describe()}" for m in modules if m in self.storage)


def _resolve_folder(model: str, revision: str | None) -> tuple[str, dict] | None:
    """``(description, {tensor: TensorInfo})`` for a local folder, a hub id in the huggingface_hub cache, or a hub id
    whose safetensors headers the hub serves (``huggingface_hub.get_safetensors_metadata``); None if none works."""
    if os.path.isdir(model):
        return model, _layout().read_tensor_info(model)
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"],
                                  local_files_only=True)  # fmt: skip
        return local, _layout().read_tensor_info(local)
    except Exception:  # noqa: BLE001 - not cached: ask the hub for the headers
        pass
    try:
        from huggingface_hub import get_safetensors_metadata

        meta = get_safetensors_metadata(model, revision=revision)
        tensors = {
            name: _layout().TensorInfo(str(info.dtype), tuple(info.shape))
            for fmeta in meta.files_metadata.values()
            for name, info in fmeta.tensors.items()
        }
        return f"{model} (hub headers)", tensors
    except Exception:  # noqa: BLE001
        return None


def plan_for(model_config: Any, model_cls: type) -> VisionPlan | None:
    """The plan for the checkpoint ``model_config.model`` names; None (and a warning) if its headers can't be read."""
    model = str(getattr(model_config, "model", "") or "")
    try:
        found = _resolve_folder(model, getattr(model_config, "revision", None))
    except Exception as exc:  # noqa: BLE001 - unreadable headers: vLLM decides as it would without us
        found = None
        log.warning("vllm-minicpm-hotfix: %s: cannot read the safetensors headers of %s (%s)", LABEL, model, exc)
    if found is None:
        log.warning("vllm-minicpm-hotfix: %s: no safetensors headers found for %s; vLLM decides the vision layers' "
                    "quantization from the config alone", LABEL, model)  # fmt: skip
        return None
    source, tensors = found
    storage = {m: s for m, s in _layout().module_storage(tensors).items() if _layout().is_vision(m)}
    return VisionPlan.build(storage, model_cls, source)


# --------------------------------------------------------------------------------------------------------------------
# The decision for one layer, and the wrapped __init__
# --------------------------------------------------------------------------------------------------------------------


def decide(plan: VisionPlan, quant_config: Any, layer: Any, prefix: str, original: Callable[[], Any], *,
           model_prefix: str = "") -> Any:  # fmt: skip
    """The quant method for ``layer`` (a vLLM ``LinearBase``) named ``prefix``: see the module docstring.

    Raises:
        QuantizedVisionError: shards stored differently; or stored quantized but vLLM's config would build it
            unquantized.
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    rel = prefix[len(model_prefix) + 1 :] if model_prefix and prefix.startswith(model_prefix + ".") else prefix
    if not isinstance(layer, LinearBase) or not rel.startswith(VISION_VLLM_PREFIXES):
        return original()
    kind, modules = plan.stored(rel)
    if kind == "absent":
        return original()
    if kind == "mixed":
        raise QuantizedVisionError(
            f"{rel}: the checkpoint stores the shards of this fused layer differently ({plan.describe(modules)}); "
            f"vLLM builds one layer for all of them, so all must be quantized or all float"
        )
    if kind == "float":
        method = UnquantizedLinearMethod()
    else:
        method = original()
        if method is None or isinstance(method, UnquantizedLinearMethod):
            raise QuantizedVisionError(
                f"{rel}: the checkpoint stores it quantized ({plan.describe(modules)}) but vLLM's "
                f"{type(quant_config).__name__} would build it unquantized; this layout cannot be loaded"
            )
    plan.rows.append(_layout().LayerRow(rel, kind, tuple(modules), type(method).__name__))
    return method


@contextlib.contextmanager
def intercept(quant_config: Any, plan: VisionPlan, model_prefix: str = "") -> Iterator[None]:
    """While the block runs, ``quant_config.get_quant_method`` answers for vision layers by :func:`decide`.

    Set on the config *instance* (its class and every other instance untouched) and removed on exit."""
    had = "get_quant_method" in vars(quant_config)
    previous = vars(quant_config).get("get_quant_method")
    original = quant_config.get_quant_method

    def get_quant_method(layer: Any, prefix: str = "") -> Any:
        return decide(plan, quant_config, layer, prefix, lambda: original(layer, prefix), model_prefix=model_prefix)

    try:
        quant_config.get_quant_method = get_quant_method
    except (AttributeError, TypeError) as exc:  # a config class that takes no instance attributes: leave it to vLLM
        log.warning("vllm-minicpm-hotfix: %s: cannot intercept %s.get_quant_method (%s); vLLM decides the vision "
                    "layers' quantization from the config alone", LABEL, type(quant_config).__name__, exc)  # fmt: skip
        yield
        return
    try:
        yield
    finally:
        if had:
            quant_config.get_quant_method = previous
        else:
            vars(quant_config).pop("get_quant_method", None)


def check_plain_linears(model: Any, plan: VisionPlan, model_prefix: str = "") -> None:
    """Raise :class:`QuantizedVisionError` for a vision ``torch.nn.Linear`` whose checkpoint tensors are quantized."""
    from torch import nn

    bad = []
    for name, mod in model.named_modules():
        rel = name[len(model_prefix) + 1 :] if model_prefix and name.startswith(model_prefix + ".") else name
        if type(mod) is nn.Linear and rel.startswith(VISION_VLLM_PREFIXES):
            kind, modules = plan.stored(rel)
            if kind in ("quantized", "mixed"):
                bad.append(f"{rel} ({plan.describe(modules)})")
    if bad:
        raise QuantizedVisionError(
            f"the checkpoint stores vision layers quantized that vLLM builds as plain torch.nn.Linear and cannot load "
            f"quantized: {'; '.join(bad)}. Use a checkpoint whose vision tower, vit_merger and merger are bf16 "
            f"(GPTQ or AWQ of the language model only)"
        )


def _quant_config(args: tuple, kwargs: dict) -> Any:
    """The ``quant_config`` of the ``vllm_config`` a ``__init__(self, *, vllm_config, prefix)`` call gets."""
    vllm_config = kwargs.get("vllm_config", args[1] if len(args) > 1 else None)
    return getattr(vllm_config, "quant_config", None)


def uses_path(*args: Any, **kwargs: Any) -> bool:
    """For a call of ``MiniCPMV4_6ForConditionalGeneration.__init__`` (``self`` first): whether it builds the model
    with a quantization config, the only construction this fix changes (:func:`init`)."""
    return _quant_config(args, kwargs) is not None


def init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> None:
    """Around ``MiniCPMV4_6ForConditionalGeneration.__init__(self, *, vllm_config, prefix="")``: constructs the vision
    layers as the checkpoint stores them (see the module docstring). Without a quantization config, or where the
    checkpoint's headers cannot be read, it is vLLM's ``__init__`` unchanged. Raises :class:`QuantizedVisionError`."""
    vllm_config = kwargs.get("vllm_config", args[0] if args else None)
    quant_config = getattr(vllm_config, "quant_config", None)
    plan = None
    if quant_config is not None:
        plan = plan_for(getattr(vllm_config, "model_config", None), type(instance))
    if plan is None:
        wrapped(*args, **kwargs)
        return
    prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "") or ""
    with intercept(quant_config, plan, prefix):
        wrapped(*args, **kwargs)
    check_plain_linears(instance, plan, prefix)
    object.__setattr__(instance, ROWS_ATTR, list(plan.rows))


PATCHES = {DEFER_AT: wrap(init)}


# --------------------------------------------------------------------------------------------------------------------
# probe / apply
# --------------------------------------------------------------------------------------------------------------------

#: The skip list AutoAWQ-style quantizers write for MiniCPM-V 4.6, in transformers' names.
PROBE_AWQ_CONFIG = {
    "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
    "modules_to_not_convert": ["model.vision_tower", "model.merger"],
}  # fmt: skip
PROBE_LAYER = "vpm.encoder.layers.0.mlp.fc1"


def _stand_in_linear() -> Any:
    """A ``ColumnParallelLinear`` made without ``__init__`` (no distributed state), with the sizes configs read."""
    from torch import nn
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear.__new__(ColumnParallelLinear)
    nn.Module.__init__(layer)
    for attr, value in dict(input_size=64, output_size=128, input_size_per_partition=64,
                            output_size_per_partition=128, output_partition_sizes=[128], prefix=PROBE_LAYER,
                            params_dtype=None, tp_size=1, tp_rank=0).items():  # fmt: skip
        object.__setattr__(layer, attr, value)
    return layer


class _Stop(Exception):
    """Raised by the probe's stand-in config to stop ``__init__`` once the layer's quant method is known."""


#: The probe's stand-in checkpoint: one vision layer stored bf16, in transformers' names.
PROBE_TENSORS = {"model.vision_tower.encoder.layers.0.mlp.fc1.weight": (128, 64),
                 "model.vision_tower.encoder.layers.0.mlp.fc1.bias": (128,)}


def method_at_construction(model_cls: type, quant_config: Any, layer: Any) -> Any:
    """The quant method ``quant_config`` gives ``layer`` (named :data:`PROBE_LAYER`) while ``model_cls.__init__`` as
    it now stands (a first-use trigger looked through: vLLM's own then) constructs a model of a folder holding
    :data:`PROBE_TENSORS` as bf16: asked when vLLM's ``__init__`` first reads its config, then construction stops.
    Raises ``RuntimeError`` if ``__init__`` never reads it."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from torch import nn

    # The constructor that hands the quant config to the vision tower: the 4.6 class's (a member's own ``__init__``
    # that reads its config first and then calls it, as the 4.7 backport's does, would stop the stand-in early).
    owners = [c for c in model_cls.__mro__ if "__init__" in vars(c)]
    init_fn = vars(next((c for c in owners if c.__name__ == MODEL_CLASS), owners[0]))["__init__"]
    if deferred.is_trigger(init_fn):
        init_fn = init_fn.__wrapped__
    seen: list[Any] = []

    class StandInConfig:
        """A config whose every attribute but the checkpoint's name asks for the method, then stops."""

        def __init__(self, **known: Any) -> None:
            self.__dict__.update(known)

        def __getattr__(self, name: str) -> Any:
            seen.append(quant_config.get_quant_method(layer, PROBE_LAYER))
            raise _Stop

    with tempfile.TemporaryDirectory(prefix="vmh-quantized-vision-") as folder:
        save_file({k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in PROBE_TENSORS.items()},
                  os.path.join(folder, "model.safetensors"))
        model = model_cls.__new__(model_cls)
        nn.Module.__init__(model)
        vllm_config = StandInConfig(quant_config=quant_config, model_config=StandInConfig(model=folder, revision=None))
        try:
            init_fn(model, vllm_config=vllm_config)
        except _Stop:
            pass
    if not seen:
        raise RuntimeError(f"{model_cls.__name__}.__init__ never read its config")
    return seen[0]


def probe(module: ModuleType) -> decision.Verdict:
    """Ask the installed code which quant method a vision-tower linear layer gets from an AWQ config whose
    ``modules_to_not_convert`` names ``model.vision_tower`` (as quantizers write it), mapped the way vLLM's
    ``configure_quant_config`` maps it, while the checkpoint stores that layer as float.

    ``BROKEN``: a quantized method (vLLM would build the bf16 vision tower as AWQ). ``CORRECT``: unquantized (stock
    vLLM that honours the names, or this fix applied: the patched ``__init__``'s decision is asked). Never raises.
    """
    model_cls = getattr(module, MODEL_CLASS, None)
    if not isinstance(model_cls, type) or not callable(getattr(model_cls, "__init__", None)):
        return decision.Verdict(decision.State.UNRECOGNISED, f"{module.__name__} has no {MODEL_CLASS}")
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization import get_quantization_config
        from vllm.model_executor.model_loader.utils import configure_quant_config

        qc = get_quantization_config("awq").from_config(dict(PROBE_AWQ_CONFIG))
        configure_quant_config(qc, model_cls)
        layer = _stand_in_linear()
    except Exception as exc:  # noqa: BLE001
        return decision.Verdict(decision.State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    try:
        method = method_at_construction(model_cls, qc, layer)
    except Exception as exc:  # noqa: BLE001 - e.g. a kernel check refusing the stand-in
        return decision.Verdict(decision.State.UNDETERMINED, f"probe failed in get_quant_method: {type(exc).__name__}: {exc}")
    name = type(method).__name__
    if isinstance(method, UnquantizedLinearMethod):
        return decision.Verdict(decision.State.CORRECT, f"a bf16 vision layer skipped in transformers' names is built unquantized ({name})")
    return decision.Verdict(
        decision.State.BROKEN,
        f"vLLM builds {PROBE_LAYER} as {name} although the AWQ config's modules_to_not_convert names "
        f"model.vision_tower (transformers' name, unmapped: {getattr(qc, 'modules_to_not_convert', '?')})",
    )
