"""A correct q/k/v-packing ``load_weights`` for vLLM's MiniCPM-V 4.6 window-merger self-attention.

What breaks
-----------
MiniCPM-V 4.6 checkpoints store the ViT window-merger attention split::

    model.vision_tower.vit_merger.self_attn.{q,k,v,out}_proj.{weight,bias}

while vLLM's ``MiniCPMV4_6ViTWindowAttentionSelfAttn`` holds one fused ``qkv_proj`` (a ``QKVParallelLinear``) and
``out_proj`` (a ``RowParallelLinear``). vLLM packed them wrongly in three ways: main builds before 0.22 stacked
nothing (``There is no module or parameter named 'vit_merger.self_attn.k_proj'``); 0.25-0.26's self-attention
``WeightsMapper`` matched substrings and chained (``'qkqkv_proj'``); 0.27-0.29's dotted keys never matched the
prefix-stripped names a child module receives (``'k_proj'``). Each error comes after the whole language model has
loaded.

What the fix does
-----------------
:func:`load_weights` is attached to the self-attention class at run time; vLLM's ``AutoWeightsLoader`` then hands it
the self-attention's weights with the module prefix stripped (``q_proj.weight``, ...), exactly as it hands them to any
child module's ``load_weights``. It mirrors the stacked-parameter loop of vLLM's own model loaders (e.g.
``Qwen2Model.load_weights`` in ``vllm/model_executor/models/qwen2.py`` and the hand-written
``MiniCPMV4_6ViTWindowAttentionSelfAttn.load_weights`` of vLLM 0.22-0.24), with two additions vLLM lacks: every q/k/v
shard must arrive exactly once (vLLM exempts linear layers from its "weights not initialized" check, so a missing
shard would otherwise stay silently random), and every name must match a parameter. The model's top-level
``load_weights`` is wrapped so completeness is judged over the whole model load.

The decision
------------
:func:`probe` runs vLLM's own top-level ``load_weights`` on a stand-in model -- instances of vLLM's real classes
(``MiniCPMV4_6ForConditionalGeneration``, ``MiniCPMV4_6ViTWindowAttentionSelfAttn``, ``QKVParallelLinear``) created
without their ``__init__``, so no distributed state, config or device is needed -- whose parameters record what their
weight loader is handed. It feeds the six q/k/v tensor names of the real checkpoint (in the sorted order safetensors
yields them) and checks that each one reached ``qkv_proj.{weight,bias}`` as the right shard with its own values. That
one path covers every way vLLM has packed these tensors: the hand-written loop of 0.22-0.24, the self-attention
``WeightsMapper`` of 0.25-0.29, the top-level stacked mapper of 0.30+ and 0.32's ``_stack_vit_merger_qkv``, and main
builds that stacked nothing at all. Nothing here imports vLLM or torch at import time.

Upstream
--------
vllm-project/vllm#49417 (merged 2026-07-22) fixed the loading; in 0.32 ``_stack_vit_merger_qkv`` replaced the
self-attention ``load_weights`` this fix sets. Still open: vllm-project/vllm#48449 (0.25.0, ``'qkqkv_proj'``) and
vllm-project/vllm#51842 (0.27.0, ``'k_proj'``), with the fix vllm-project/vllm#52036 proposed for the latter. The
breakages came with vllm-project/vllm#47058 (the self-attention ``WeightsMapper``: ``'qkqkv_proj'``) and
vllm-project/vllm#49193 (its keys prefixed with a dot: ``'k_proj'``); vllm-project/vllm#43213 added the hand-written
loader of 0.22-0.24.

Remove when
-----------
its probe sees every one of the six q/k/v tensors reach ``qkv_proj`` as its own shard with its own values through
stock vLLM's ``load_weights`` on every release the hotfix supports, i.e. once 0.25-0.29 (and pre-0.22 main builds) are
no longer supported: 0.22-0.24 and 0.30+ already pass.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import contextvars
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import ATTN_CLASS, EVERY_CALL, MODEL_CLASS, V46, V47, VOCR, replace, wrap

NAME = "qkv_loader"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR's model is 4.6's: its load_weights and its window attention
LABEL = "vit_merger q/k/v loader"

#: Checkpoint module name -> ``QKVParallelLinear`` shard id.
SHARD_IDS: dict[str, str] = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
#: The fused module vLLM holds.
FUSED = "qkv_proj"
_ALL_SHARDS = frozenset(SHARD_IDS.values())

# Attribute this module keeps on loaded self-attention modules.
_EVER_LOADED_ATTR = "_vllm_minicpm_hotfix_qkv_complete"


class QKVLoadError(ValueError):
    """A MiniCPM-V 4.6 vit_merger weight could not be loaded correctly.

    A ``ValueError`` like the errors vLLM's own loaders raise, so callers that handle those handle this too.
    """


# --------------------------------------------------------------------------------------------------------------------
# Load sessions: which shards each qkv_proj parameter received.
#
# vLLM's AutoWeightsLoader groups names by their first component with itertools.groupby, so a checkpoint sharded over
# several files can hand one self-attention module its q/k/v in more than one call. Completeness is therefore judged
# at the end of the enclosing *model* load when there is one (the top-level ``load_weights`` wrapper opens a session),
# and at the end of this module's own call otherwise.
# --------------------------------------------------------------------------------------------------------------------


class _Session:
    """Per load: for each (module, parameter name), the shard ids received and the tensor names that brought them."""

    def __init__(self) -> None:
        self.shards: dict[tuple[int, str], dict[str, str]] = {}
        self.modules: dict[int, Any] = {}

    def record(self, module: Any, param_name: str, shard_id: str, tensor_name: str, prefix: str) -> None:
        got = self.shards.setdefault((id(module), param_name), {})
        self.modules[id(module)] = module
        if shard_id in got:
            raise QKVLoadError(
                f"vit_merger q/k/v: shard {shard_id!r} of {prefix}{param_name} arrived twice in one load "
                f"(from checkpoint tensors {got[shard_id]!r} and {tensor_name!r}); a checkpoint must hold each of "
                f"q_proj, k_proj, v_proj once"
            )
        got[shard_id] = tensor_name

    def finish(self) -> None:
        """Raise :class:`QKVLoadError` if a ``qkv_proj`` parameter got some shards but not all three."""
        problems = []
        for (module_id, param_name), got in sorted(self.shards.items(), key=lambda kv: kv[0][1]):
            module = self.modules[module_id]
            missing = sorted(_ALL_SHARDS - got.keys())
            if missing:
                problems.append(
                    f"{_prefix(module)}{param_name}: shard(s) {', '.join(map(repr, missing))} missing "
                    f"(received {', '.join(f'{s!r} from {n!r}' for s, n in sorted(got.items()))})"
                )
            else:
                complete = getattr(module, _EVER_LOADED_ATTR, None)
                if complete is None:
                    complete = set()
                    object.__setattr__(module, _EVER_LOADED_ATTR, complete)
                complete.add(param_name)
        if problems:
            raise QKVLoadError(
                "vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                + "; ".join(problems)
            )


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("vllm_minicpm_hotfix_session", default=None)


@contextlib.contextmanager
def load_session() -> Iterator[_Session]:
    """Open a load session (or join the one already open) and check q/k/v completeness when the outermost one ends.

    Raises:
        QKVLoadError: when the outermost session ends and a ``qkv_proj`` parameter received some but not all of
            the shards ``"q"``, ``"k"``, ``"v"``.
    """
    current = _SESSION.get()
    if current is not None:
        yield current
        return
    session = _Session()
    token = _SESSION.set(session)
    try:
        yield session
    finally:
        _SESSION.reset(token)
    session.finish()


def qkv_params_never_loaded(model: Any, attn_cls: type) -> list[str]:
    """Names of ``qkv_proj`` parameters of ``attn_cls`` modules in ``model`` that no load ever filled completely.

    Used after a whole-model load: vLLM would otherwise serve such a parameter with its uninitialised values.
    """
    missing = []
    for module_name, module in model.named_modules():
        if not isinstance(module, attn_cls):
            continue
        complete = getattr(module, _EVER_LOADED_ATTR, set())
        for param_name, _ in module.named_parameters():
            if param_name.startswith(FUSED + ".") and param_name not in complete:
                missing.append(f"{module_name}.{param_name}" if module_name else param_name)
    return missing


# --------------------------------------------------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------------------------------------------------


def _prefix(module: Any) -> str:
    """``vit_merger.self_attn.`` for vLLM's module, read from the prefix vLLM gave its ``qkv_proj``."""
    qkv = getattr(module, FUSED, None)
    prefix = getattr(qkv, "prefix", "") or ""
    if prefix.endswith("." + FUSED):
        return prefix[: -len(FUSED)]
    return ""


def _shape(t: Any) -> list[int]:
    return list(getattr(t, "shape", ()))


def _expected_qkv_shape(layer: Any, param: Any, shard_id: str | None) -> list[int] | None:
    """The checkpoint shape (unsharded, as on disk) a q/k/v shard or the fused tensor must have, or None if unknown.

    Known for vLLM's unquantized ``QKVParallelLinear`` ``weight`` (``[out, in]``) and ``bias`` (``[out]``): q is
    ``total_num_heads * head_size`` rows, k ``total_num_kv_heads * head_size``, v ``total_num_kv_heads * v_head_size``,
    the fused tensor their sum. Packed or quantized parameters return None and are left to vLLM's weight loader.
    """
    output_dim = getattr(param, "output_dim", None)
    if output_dim is None or getattr(param, "packed_dim", None) is not None:
        return None
    try:
        heads, kv_heads, head = int(layer.total_num_heads), int(layer.total_num_kv_heads), int(layer.head_size)
        v_head = int(getattr(layer, "v_head_size", head) or head)
    except (AttributeError, TypeError, ValueError):
        return None
    rows = {"q": heads * head, "k": kv_heads * head, "v": kv_heads * v_head}
    expected = _shape(param)
    if len(expected) <= output_dim:
        return None
    expected[output_dim] = rows[shard_id] if shard_id is not None else sum(rows.values())
    return expected


def _load_one(param: Any, tensor: Any, *, loader_args: tuple, what: str) -> None:
    """Call the parameter's weight loader; turn its bare assertion/shape errors into one clear QKVLoadError."""
    weight_loader = getattr(param, "weight_loader", None)
    if weight_loader is None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        weight_loader = default_weight_loader
    try:
        weight_loader(param, tensor, *loader_args)
    except QKVLoadError:
        raise
    except Exception as exc:  # vLLM's loaders raise AssertionError / RuntimeError with bare shapes
        raise QKVLoadError(
            f"{what}: vLLM's weight loader rejected checkpoint shape {_shape(tensor)} ({getattr(tensor, 'dtype', '?')}) "
            f"for parameter shape {_shape(param)} ({getattr(param, 'dtype', '?')}): {type(exc).__name__}: {exc}"
        ) from exc


def _route(name: str, tensor: Any) -> tuple[str, str | None, bool]:
    """Map a prefix-stripped checkpoint name to ``(parameter name, shard id, is_qkv)``.

    * ``q_proj.S`` / ``k_proj.S`` / ``v_proj.S`` -> ``qkv_proj.S`` with shard id ``q`` / ``k`` / ``v``;
    * ``qkv_proj.S`` -> ``qkv_proj.S`` with the tensor's ``shard_id`` attribute (set by vLLM >= 0.30's
      ``WeightsMapper.apply`` / 0.32's ``_stack_vit_merger_qkv``), or None for an already-fused tensor;
    * anything else -> itself, no shard id.
    """
    head, dot, suffix = name.partition(".")
    if dot and head in SHARD_IDS:
        return f"{FUSED}.{suffix}", SHARD_IDS[head], True
    if dot and head == FUSED:
        shard_id = getattr(tensor, "shard_id", None)
        if shard_id is not None and shard_id not in _ALL_SHARDS:
            raise QKVLoadError(
                f"vit_merger q/k/v: checkpoint tensor {name!r} carries shard_id {shard_id!r}; "
                f"QKVParallelLinear takes 'q', 'k', 'v' or none (already fused)"
            )
        return name, shard_id, True
    return name, None, False


def load_weights(self: Any, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """Load MiniCPM-V 4.6 window-merger self-attention weights into vLLM's fused ``qkv_proj`` and ``out_proj``.

    Attached as ``MiniCPMV4_6ViTWindowAttentionSelfAttn.load_weights`` (``vllm/model_executor/models/minicpmv4_6.py``,
    vLLM 0.22-0.33); it has the signature vLLM's ``AutoWeightsLoader._load_module`` calls child modules with.

    Args:
        self: the vLLM ``MiniCPMV4_6ViTWindowAttentionSelfAttn`` module.
        weights: ``(name, tensor)`` pairs with names relative to this module, as vLLM passes them to a child module:
            ``q_proj.weight`` ``[H, D]``, ``q_proj.bias`` ``[H]`` (likewise ``k_proj``, ``v_proj``; ``H`` = heads x
            head size, ``D`` = vision hidden size, any dtype: vLLM's loaders cast on copy), ``out_proj.weight``
            ``[D, H]``, ``out_proj.bias`` ``[D]``; or ``qkv_proj.{weight,bias}`` ``[3H, D]`` / ``[3H]`` already fused,
            or one shard of it with ``tensor.shard_id`` in ``{"q", "k", "v"}`` (how vLLM >= 0.30 pre-stacks). Any
            suffix (``qweight``, ``scales``, ...) is passed through to the parameter of that name. The iterable is
            consumed once, lazily; no tensor is kept after its copy into the parameter.

    Each q/k/v shard goes through the parameter's own ``weight_loader(param, tensor, shard_id)`` so that tensor
    parallel slicing (vLLM's head-sharded layout) and quantized parameter classes behave as in vLLM; every other
    parameter through its ``weight_loader`` or vLLM's ``default_weight_loader``.

    Returns:
        The set of *parameter* names loaded (``qkv_proj.weight``, ``qkv_proj.bias``, ``out_proj.weight``, ...),
        which ``AutoWeightsLoader`` re-qualifies with the module prefix.

    Raises:
        QKVLoadError (a ``ValueError``): a name matching no parameter (lists the module's parameters); a q/k/v
            tensor of the wrong shape (names the tensor, the shard and both shapes); a shard that arrives twice;
            a ``qkv_proj`` parameter that got some shards but not all three when the load ends; any error of
            vLLM's weight loader, re-raised naming the tensor and both shapes.
    """
    params = dict(self.named_parameters())
    prefix = _prefix(self)
    qkv_layer = getattr(self, FUSED, None)
    loaded: set[str] = set()

    with load_session() as session:
        for name, tensor in weights:
            param_name, shard_id, is_qkv = _route(name, tensor)
            param = params.get(param_name)
            if param is None:
                raise QKVLoadError(
                    f"vit_merger: checkpoint tensor {prefix + name!r} (shape {_shape(tensor)}) matches no parameter of "
                    f"{type(self).__name__}; its parameters are {sorted(params)}"
                )
            if is_qkv and shard_id is not None and name.startswith(FUSED + "."):
                # vLLM >= 0.30 renamed the checkpoint's q_proj/k_proj/v_proj before handing it over: say which.
                name = f"{shard_id}_proj{name[len(FUSED):]} (renamed by vLLM to {name})"
            what = f"checkpoint tensor {prefix}{name} -> {prefix}{param_name}"
            if is_qkv:
                what += f" (shard {shard_id!r})" if shard_id is not None else " (already fused)"
                expected = _expected_qkv_shape(qkv_layer, param, shard_id)
                if expected is not None and _shape(tensor) != expected:
                    raise QKVLoadError(
                        f"{what}: checkpoint shape {_shape(tensor)} but {prefix}{param_name} needs "
                        f"{expected} for this shard (parameter shape on this rank {_shape(param)})"
                    )
                for s in [shard_id] if shard_id is not None else sorted(_ALL_SHARDS):
                    session.record(self, param_name, s, name, prefix)
                _load_one(param, tensor, loader_args=(shard_id,), what=what)
            else:
                _load_one(param, tensor, loader_args=(), what=what)
            loaded.add(param_name)
    return loaded


def attn_class_of(model_cls: type) -> type:
    """The window self-attention class of the model module that defines ``model_cls``."""
    return getattr(sys.modules[model_cls.__module__], ATTN_CLASS)


def model_load_weights(wrapped: Any, instance: Any, args: tuple, kwargs: dict, *, attn_cls: type) -> set[str]:
    """Around ``MiniCPMV4_6ForConditionalGeneration.load_weights(self, weights: Iterable[tuple[str, Tensor]]) ->
    set[str]``: one load session around vLLM's own top-level ``load_weights`` (so shards that reach the self-attention
    in several calls, e.g. from a sharded checkpoint, are counted together); afterwards every ``qkv_proj`` parameter
    of every ``attn_cls`` module must have been filled completely by this or an earlier load.

    Raises:
        QKVLoadError: see :func:`load_session`; or a ``qkv_proj`` parameter that no load has filled (the checkpoint
            has no ``vit_merger.self_attn.{q,k,v}_proj`` at all).
    """
    with load_session():
        loaded = wrapped(*args, **kwargs)
    never = qkv_params_never_loaded(instance, attn_cls)
    if never:
        raise QKVLoadError(
            f"vit_merger q/k/v never loaded: {never} received no q_proj/k_proj/v_proj (or qkv_proj) tensor from "
            f"the checkpoint and would keep uninitialised values"
        )
    return loaded


#: The window attention class is shared by every member's model (4.7 builds 4.6's): its loader is the fix's for every
#: call, and the model's ``load_weights`` -- where the class policy applies -- decides for which models it is judged.
PATCHES = {
    f"{ATTN_CLASS}.load_weights": replace(load_weights, model=EVERY_CALL),
    f"{MODEL_CLASS}.load_weights": lambda old, owner: wrap(
        functools.partial(model_load_weights, attn_cls=attn_class_of(owner))),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------------------------

#: Checkpoint names fed to the probe, in the order safetensors yields them (sorted).
PROBE_NAMES = tuple(
    sorted(f"model.vision_tower.vit_merger.self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias"))
)


def recognise_layout(module: ModuleType) -> str | None:
    """None if ``module`` has the layout the fix targets; else why not (one line)."""
    model_cls = getattr(module, MODEL_CLASS, None)
    attn_cls = getattr(module, ATTN_CLASS, None)
    if not isinstance(model_cls, type) or not isinstance(attn_cls, type):
        return f"{module.__name__} has no {MODEL_CLASS} / {ATTN_CLASS}"
    init = getattr(attn_cls.__init__, "__code__", None)
    if init is None or "qkv_proj" not in init.co_names:
        return f"{ATTN_CLASS} in {module.__name__} does not build a fused qkv_proj"
    if not callable(getattr(model_cls, "load_weights", None)):
        return f"{MODEL_CLASS} in {module.__name__} has no load_weights"
    return None


class _Recorder:
    """A parameter's ``weight_loader`` that records ``(parameter, shard id, tensor)`` instead of copying."""

    def __init__(self, calls: list, param_name: str) -> None:
        self.calls = calls
        self.param_name = param_name

    def __call__(self, param: Any, loaded_weight: Any, loaded_shard_id: Any = None) -> None:
        self.calls.append((self.param_name, loaded_shard_id, loaded_weight.clone()))


def _stand_in_model(module: ModuleType, calls: list) -> Any:
    import torch
    from torch import nn

    from vllm.model_executor.layers.linear import QKVParallelLinear

    def bare(cls: type) -> Any:
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        return obj

    def param(shape: tuple[int, ...], name: str, **attrs: Any) -> nn.Parameter:
        p = nn.Parameter(torch.zeros(shape), requires_grad=False)
        p.weight_loader = _Recorder(calls, name)
        for k, v in attrs.items():
            setattr(p, k, v)
        return p

    qkv = bare(QKVParallelLinear)
    qkv.prefix = "vit_merger.self_attn.qkv_proj"
    qkv.weight = param((3, 1), "qkv_proj.weight", output_dim=0, input_dim=1)
    qkv.bias = param((3,), "qkv_proj.bias", output_dim=0)
    out = nn.Module()
    out.weight = param((1, 1), "out_proj.weight")
    out.bias = param((1,), "out_proj.bias")
    attn = bare(getattr(module, ATTN_CLASS))
    attn.qkv_proj = qkv
    attn.out_proj = out
    merger = nn.Module()
    merger.self_attn = attn
    model = bare(getattr(module, MODEL_CLASS))
    model.vit_merger = merger
    return model


def probe(module: ModuleType, loader: Any = None) -> Verdict:
    """Run vLLM's own top-level ``load_weights`` on a stand-in model and judge where the split q/k/v tensors land.

    Args:
        module: the imported ``vllm.model_executor.models.minicpmv4_6``.
        loader: the top-level ``load_weights`` to probe; default ``MiniCPMV4_6ForConditionalGeneration.load_weights``.

    Returns:
        ``BROKEN`` if vLLM raises (e.g. ``There is no module or parameter named 'k_proj'``) or routes any tensor to
        the wrong parameter or shard; ``CORRECT`` if all six reach ``qkv_proj.{weight,bias}`` once each as shards
        q, k, v with their own values; ``UNRECOGNISED`` / ``UNDETERMINED`` if the layout is not the one this fix
        targets or the probe could not run. Never raises; leaves ``module`` unchanged. Costs a few milliseconds.
    """
    why = recognise_layout(module)
    if why is not None:
        return Verdict(State.UNRECOGNISED, why)
    try:
        import torch

        calls: list = []
        model = _stand_in_model(module, calls)
        values = {name: float(i + 1) for i, name in enumerate(PROBE_NAMES)}
        weights = [
            (name, torch.full((1,) if name.endswith("bias") else (1, 1), value)) for name, value in values.items()
        ]
        loader = loader or getattr(module, MODEL_CLASS).load_weights
    except Exception as exc:  # an unknown layout of vLLM's own classes
        return Verdict(State.UNDETERMINED, f"probe could not be set up: {type(exc).__name__}: {exc}")
    try:
        loader(model, iter(weights))
    except (ValueError, KeyError, RuntimeError, AssertionError) as exc:
        return Verdict(State.BROKEN, f"vLLM's own load_weights fails on the split q/k/v: {type(exc).__name__}: {exc}")
    except Exception as exc:
        return Verdict(State.UNDETERMINED, f"probe failed inside vLLM's load_weights: {type(exc).__name__}: {exc}")

    got = sorted((p, str(s), float(t.flatten()[0])) for p, s, t in calls)
    want = sorted(
        (f"qkv_proj.{name.rsplit('.', 1)[1]}", name.rsplit(".", 2)[1][0], value) for name, value in values.items()
    )
    if got == want:
        return Verdict(State.CORRECT, "vLLM's own load_weights packs the split q/k/v into qkv_proj correctly")
    return Verdict(
        State.BROKEN,
        f"vLLM's own load_weights routes the split q/k/v wrongly: expected (param, shard, value) {want}, got {got}",
    )

