"""A check-only guard: a MiniCPM-V 4.6 checkpoint missing a vit_merger q/k/v shard fails to load instead of loading.

What breaks
-----------
vLLM's "weights not initialized" check (``DefaultModelLoader``) exempts every layer whose quantization method has
``process_weights_after_loading`` -- every unquantized linear layer, the window merger's ``qkv_proj``
(``QKVParallelLinear``) included. So on releases whose own q/k/v loading is correct (0.22-0.24, 0.30+), a checkpoint
without ``model.vision_tower.vit_merger.self_attn.k_proj.bias``, or without the whole q/k/v set, loads "successfully"
and the missing rows keep whatever memory ``torch.empty`` handed out: a server that answers, wrongly. The q/k/v loader
fix (:mod:`.qkv_loader`) refuses such a checkpoint, but it is applied only where vLLM's own loading is broken.

What the fix does
-----------------
Nothing about *how* vLLM loads changes. It wraps ``MiniCPMV4_6ForConditionalGeneration.load_weights`` (the call
vLLM's ``DefaultModelLoader.load_weights`` makes; vLLM 0.22-0.33) so that for the duration of one model load each
``qkv_proj`` parameter of each ``MiniCPMV4_6ViTWindowAttentionSelfAttn`` in the model has its ``weight_loader``
observed: the observer calls the parameter's own weight loader with the same arguments, and only after it returned
records the shard id it was called with (``"q"``, ``"k"``, ``"v"``; ``None``, an already fused tensor, counts as all
three). Afterwards the original weight loaders are put back. When vLLM's load returns, a parameter that received
some shards but not all three in this load, or that no load has ever filled, is an error: :class:`QKVLoadError`
(the q/k/v loader fix's ``ValueError``), with the same text the loader uses, naming the parameter, the missing and
the received shards. ``DefaultModelLoader.load_model`` then returns nothing and the engine start-up aborts with it.

A later load that carries no vit_merger tensors at all (a partial weight update) is not an error once an earlier load
filled every shard; one that brings some shards of a parameter but not all is.

The decision
------------
:func:`probe` judges the path a user's load takes: the installed top-level ``load_weights`` -- as it is at that
moment, so with the q/k/v loader fix where that was applied before this fix (the registry's order) -- then, on the
names it returns, vLLM's own "weights not initialized" check, ``DefaultModelLoader.track_weights_loading`` (what
``DefaultModelLoader.load_weights`` runs for an unquantized checkpoint). The model is the q/k/v loader fix's stand-in
(vLLM's real classes created without ``__init__``, parameters that record what their weight loader receives), its
``qkv_proj`` given what the check reads: vLLM's ``UnquantizedLinearMethod`` and, where the layer class keeps vLLM's
shard bookkeeping (``StackedColumnParallelLinear``, 0.34+), that state, each weight loader reporting its shard to
``validate_shard_id`` as vLLM's own do. It is fed the six q/k/v tensors, them without ``k_proj.bias``, and none of
them (the rest of the stand-in counts as loaded).

* ``CORRECT`` (not needed), *not applicable*, if ``load_weights`` does not even load the complete q/k/v set: stock
  0.25-0.29, whose q/k/v loading is broken -- the q/k/v loader fix is the one for them (it checks completeness itself);
* ``BROKEN`` (needed) if either incomplete set gets through without an error -- stock vLLM 0.22-0.24 and 0.30-0.33
  (both sets; their check exempts every unquantized linear layer), and 0.34 (its check refuses the set without
  ``k_proj.bias``, naming ``qkv_proj.bias.k``, but a layer that received no shard at all is left to the per-parameter
  rule, which exempts it: no q/k/v at all still loads). The reason names the sets the loader refuses;
* ``CORRECT`` (not needed), *not applicable*, if both are refused: the q/k/v loader fix is applied, or a vLLM whose
  own load refuses both. Not applicable, so ``force`` (which applies the loader everywhere) does not stack a second
  check on the loader's: one clear error per bad checkpoint, never two.
* Applicable only if the installed ``load_weights``, wrapped by this guard, loads the complete q/k/v set without an
  error (i.e. it passes every shard through the parameters' weight loaders, which the guard observes), and vLLM's
  check accepts the complete set; otherwise ``UNDETERMINED`` and not applied, ``force`` included -- a guard that
  cannot see the shards would refuse a good checkpoint.
* ``UNRECOGNISED`` where the q/k/v loader fix does not recognise the layout.

Where it is needed and not applied (no hotfix, or ``VLLM_MINICPM_HOTFIX=off``), ``doctor`` shows a ``WARN`` row, not a
``FAIL``: a complete checkpoint loads correctly without it (:data:`SCOPE`); ``vllm-minicpm-hotfix verify --model DIR``
tells whether a given checkpoint holds every vit_merger q/k/v tensor.

Upstream
--------
none known. vLLM 0.34.0's ``DefaultModelLoader`` refuses a checkpoint without ``k_proj.bias`` itself (``Following
weights were not initialized from checkpoint: {'vit_merger.self_attn.qkv_proj.bias.k'}``, project issue 51); the
change that did so was not found.

Remove when
-----------
its probe sees stock vLLM, on the path a user's load takes, refuse both incomplete q/k/v sets (without
``k_proj.bias``, and without any q/k/v tensor) on every release the hotfix supports; on 0.34.0 the first is refused,
the second unmeasured.
"""

from __future__ import annotations

import contextvars
import functools
from types import MethodType, ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import V46, V47, VOCR, wrap
from .qkv_loader import (ATTN_CLASS, FUSED, MODEL_CLASS, PROBE_NAMES, QKVLoadError, _stand_in_model, attn_class_of,
                         recognise_layout)

NAME = "qkv_completeness_guard"
MODELS = (V46, V47, VOCR)  # MiniCPM-OCR's load_weights is 4.6's, its window attention 4.6's class
LABEL = "vit_merger q/k/v completeness guard"
#: Its probe reads whether the q/k/v loader (which checks completeness itself) is applied, and it wraps outside the
#: loader's ``load_weights``.
AFTER = ("qkv_loader",)
#: A check, not a repair: vLLM loads a complete checkpoint correctly without it, so it matters only for these
#: checkpoints. ``doctor`` reports it unapplied as a WARN row, never a FAIL (the quantized fixes' mechanism), and
#: names the command that checks a given checkpoint for them.
SCOPE = "checkpoints missing a vit_merger q/k/v tensor"
SCOPE_CHECK = "vllm-minicpm-hotfix verify --model DIR"

_ALL_SHARDS = ("q", "k", "v")
#: Attribute kept on a self-attention module: the ``qkv_proj`` parameter names some load has filled completely.
_COMPLETE_ATTR = "_vllm_minicpm_hotfix_guard_complete"
_MISSING = object()

#: The watch of the model load in progress (a nested top-level call, e.g. a subclass's ``load_weights`` calling the
#: base class's, joins it).
_ACTIVE: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar("vllm_minicpm_hotfix_guard", default=None)


class _Watch:
    """One model load: observes the weight loaders of every vit_merger ``qkv_proj`` parameter of ``model``."""

    def __init__(self, model: Any, attn_cls: type) -> None:
        #: (module name, module, parameter name, parameter, weight loader before, whether it had one)
        self.watched: list[tuple[str, Any, str, Any, Any, bool]] = []
        self.shards: dict[tuple[int, str], set] = {}
        for module_name, module in model.named_modules():
            if not isinstance(module, attn_cls):
                continue
            qkv = getattr(module, FUSED, None)
            if qkv is None:
                continue
            for param_name, param in qkv.named_parameters(recurse=False):
                self._observe(module_name, module, f"{FUSED}.{param_name}", param)

    def _observe(self, module_name: str, module: Any, param_name: str, param: Any) -> None:
        try:
            loader, had = param.weight_loader, True
        except AttributeError:  # no weight loader: vLLM's AutoWeightsLoader would use default_weight_loader
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader

            loader, had = default_weight_loader, False
        got = self.shards.setdefault((id(module), param_name), set())

        def observed(p: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
            result = loader(p, loaded_weight, *args, **kwargs)
            shard = args[0] if args else kwargs.get("loaded_shard_id", kwargs.get("shard_id"))
            got.update(_ALL_SHARDS if shard is None else (shard,))
            return result

        self.watched.append((module_name, module, param_name, param, loader, had))
        param.weight_loader = observed

    def stop(self) -> None:
        """Put every observed parameter's weight loader back (never raises)."""
        for _, _, _, param, loader, had in self.watched:
            try:
                if had:
                    param.weight_loader = loader
                else:
                    del param.weight_loader
            except Exception:  # noqa: BLE001 - leave the rest restored
                pass

    def check(self) -> None:
        """Raise :class:`QKVLoadError` if a parameter got some shards but not all in this load, or none ever."""
        incomplete, never = [], []
        for module_name, module, param_name, _, _, _ in self.watched:
            full = f"{module_name}.{param_name}" if module_name else param_name
            got = self.shards[(id(module), param_name)]
            complete = getattr(module, _COMPLETE_ATTR, None)
            if got:
                missing = [s for s in _ALL_SHARDS if s not in got]
                if missing:
                    incomplete.append(
                        f"{full}: shard(s) {', '.join(map(repr, missing))} missing "
                        f"(received {', '.join(repr(s) for s in sorted(got, key=str))})"
                    )
                    continue
                if complete is None:
                    complete = set()
                    object.__setattr__(module, _COMPLETE_ATTR, complete)
                complete.add(param_name)
            elif complete is None or param_name not in complete:
                never.append(full)
        if incomplete:
            raise QKVLoadError(
                "vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                + "; ".join(incomplete)
            )
        if never:
            raise QKVLoadError(
                f"vit_merger q/k/v never loaded: {never} received no q_proj/k_proj/v_proj (or qkv_proj) tensor from "
                f"the checkpoint and would keep uninitialised values"
            )


def model_load_weights(wrapped: Any, instance: Any, args: tuple, kwargs: dict, *, attn_cls: type) -> Any:
    """Around ``MiniCPMV4_6ForConditionalGeneration.load_weights(self, weights)``: observe, call vLLM's unchanged,
    check. Returns what vLLM's returns. Raises what vLLM's raises (the observers are removed first), then
    :class:`QKVLoadError` if a ``qkv_proj`` parameter of an ``attn_cls`` module got some but not all of the shards
    ``"q"``, ``"k"``, ``"v"`` in this load, or none in any load. A nested call (a subclass's ``load_weights`` calling
    the base class's) joins the load in progress."""
    if _ACTIVE.get() is not None:
        return wrapped(*args, **kwargs)
    watch = _Watch(instance, attn_cls)
    token = _ACTIVE.set(watch)
    try:
        loaded = wrapped(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)
        watch.stop()
    watch.check()
    return loaded


PATCHES = {f"{MODEL_CLASS}.load_weights": lambda old, owner: wrap(
    functools.partial(model_load_weights, attn_cls=attn_class_of(owner)))}


# --------------------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------------------

_INCOMPLETE_SETS = {
    "the six q/k/v tensors without k_proj.bias": [n for n in PROBE_NAMES if not n.endswith("k_proj.bias")],
    "no q/k/v tensor at all": [],
}


def _loader_ready(model: Any) -> None:
    """Make the stand-in model's bare ``qkv_proj`` what vLLM's "weights not initialized" check looks at, as vLLM's
    ``LinearBase.__init__`` would leave it for an unquantized layer of one head of size 1 per shard: its
    ``quant_method`` (``UnquantizedLinearMethod``, whose ``process_weights_after_loading`` is what the check's
    exemption reads) and, where the class keeps vLLM's shard bookkeeping (``StackedColumnParallelLinear`` in 0.34+:
    ``validate_shard_id(shard, param)`` records, ``pop_missing_shards`` reports), that bookkeeping's state; each
    parameter's weight loader then reports its shard to ``validate_shard_id`` first, as vLLM's own QKV weight loaders
    do."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    qkv = model.vit_merger.self_attn.qkv_proj
    qkv.quant_method = UnquantizedLinearMethod()
    if not callable(getattr(type(qkv), "pop_missing_shards", None)):
        return  # 0.22-0.33: no shard bookkeeping; the check is per parameter only
    qkv.loaded_shard_ids = {}
    qkv.num_heads = qkv.num_kv_heads = qkv.head_size = qkv.v_head_size = 1
    qkv.total_num_heads = qkv.total_num_kv_heads = 1
    for p in qkv.parameters(recurse=False):
        def reported(param: Any, loaded_weight: Any, shard: Any = None, *, _record: Any = p.weight_loader) -> Any:
            qkv.validate_shard_id(shard, param)
            return _record(param, loaded_weight, shard)

        p.weight_loader = reported


class _LoaderRefused(Exception):
    """vLLM's ``DefaultModelLoader.track_weights_loading`` refused the probe's load (its error, shortened)."""


def _load(loader: Any, module: ModuleType, names: list[str]) -> None:
    """A model load as vLLM's ``DefaultModelLoader.load_weights`` does it for an unquantized checkpoint holding the
    vit_merger tensors ``names`` (and, for the rest of the stand-in model, everything): ``loader(model, weights)``
    (the top-level ``load_weights``), then, where it returns the loaded names, vLLM's own
    ``DefaultModelLoader.track_weights_loading`` on them (created without ``__init__``; it reads nothing of the
    instance). Raises what ``loader`` raises, and :class:`_LoaderRefused` for what the check raises."""
    import torch
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    model = _stand_in_model(module, [])
    _loader_ready(model)
    loaded = loader(model, iter([(n, torch.full((1,) if n.endswith("bias") else (1, 1), float(i + 1)))
                                 for i, n in enumerate(names)]))
    if loaded is None:  # vLLM tracks only a load_weights that returns the loaded names
        return
    rest = {n for n, _ in model.named_parameters() if f".{FUSED}." not in n}
    try:
        DefaultModelLoader.__new__(DefaultModelLoader).track_weights_loading(model, set(loaded) | rest)
    except Exception as exc:  # noqa: BLE001
        raise _LoaderRefused(f"{type(exc).__name__}: {str(exc)[:200]}") from exc


def probe(module: ModuleType) -> Verdict:
    """Does a model load -- the installed top-level ``load_weights``, then vLLM's own "weights not initialized" check
    (``DefaultModelLoader.track_weights_loading``), the path a user's load takes -- let an incomplete vit_merger q/k/v
    set through silently?

    Returns ``BROKEN`` (the guard is needed), ``CORRECT`` (not applicable: the installed load refuses already),
    ``UNDETERMINED`` (not applicable: the guard cannot observe this vLLM's q/k/v loading) or ``UNRECOGNISED``; see the
    module docstring. Never raises; leaves ``module`` unchanged; a few milliseconds.
    """
    why = recognise_layout(module)
    if why is not None:
        return Verdict(State.UNRECOGNISED, why, applicable=False)
    try:
        loader = getattr(module, MODEL_CLASS).load_weights
        attn_cls = getattr(module, ATTN_CLASS)
        try:
            _load(loader, module, list(PROBE_NAMES))
        except _LoaderRefused as exc:
            return Verdict(
                State.UNDETERMINED,
                f"vLLM's model loader refuses the probe's complete q/k/v set ({exc}): the probe cannot tell what it "
                f"does with an incomplete one",
                applicable=False,
            )
        except Exception as exc:  # noqa: BLE001
            return Verdict(
                State.CORRECT,
                f"not needed here: the installed load_weights does not load even a complete split q/k/v set "
                f"({type(exc).__name__}: {str(exc)[:200]}); the q/k/v loader fix, which checks completeness itself, "
                f"is the one for this vLLM",
                applicable=False,
            )
        silent, refused = [], []
        for label, names in _INCOMPLETE_SETS.items():
            try:
                _load(loader, module, names)
            except _LoaderRefused as exc:  # vLLM's model loader refuses it (0.34+: a shard missing)
                refused.append(f"{label}: vLLM's model loader refuses it ({exc})")
            except Exception as exc:  # noqa: BLE001 - refusing is what we look for
                refused.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            else:
                silent.append(label)
        if not silent:
            return Verdict(
                State.CORRECT,
                f"the installed load already refuses a checkpoint missing vit_merger q/k/v shards "
                f"({'; '.join(refused)})",
                applicable=False,
            )
        try:
            _load(lambda model, weights: model_load_weights(MethodType(loader, model), model, (weights,), {},
                                                            attn_cls=attn_cls), module, list(PROBE_NAMES))
        except Exception as exc:  # noqa: BLE001
            return Verdict(
                State.UNDETERMINED,
                f"vLLM's load lets {' and '.join(silent)} through without an error, but the guard cannot observe its "
                f"q/k/v loading (a complete set fails under the guard: {type(exc).__name__}: {exc})",
                applicable=False,
            )
    except Exception as exc:  # noqa: BLE001 - an unknown layout of vLLM's own classes
        return Verdict(State.UNDETERMINED, f"probe could not run: {type(exc).__name__}: {exc}", applicable=False)
    also = f"; it refuses {'; '.join(refused)}" if refused else ""
    return Verdict(
        State.BROKEN,
        f"vLLM's own load (load_weights and its model loader's check) lets {' and '.join(silent)} through without an "
        f"error (the missing rows of qkv_proj keep uninitialised memory){also}",
    )
