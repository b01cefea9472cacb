"""The decision: is the installed vLLM's MiniCPM-V 4.6 q/k/v loading broken, and should the fix be applied?

The verdict comes from running vLLM's own code, not from a list of version strings (dev builds, vendor forks and
future releases carry versions no list knows). :func:`probe_qkv_loading` builds a stand-in of the model with nothing
but the window-merger self-attention in it -- instances of vLLM's real classes (``MiniCPMV4_6ForConditionalGeneration``,
``MiniCPMV4_6ViTWindowAttentionSelfAttn``, ``QKVParallelLinear``) created without their ``__init__``, so no
distributed state, config or device is needed -- whose parameters record what their weight loader is handed. It then
feeds vLLM's real top-level ``load_weights`` the six q/k/v tensor names of the real checkpoint (in the sorted order
safetensors yields them) and checks that each one reached ``qkv_proj.{weight,bias}`` as the right shard with its own
values. That one path covers every way vLLM has packed these tensors: the hand-written loop of 0.22-0.24, the
self-attention ``WeightsMapper`` of 0.25-0.29 (``qkqkv_proj`` / ``k_proj`` errors), the top-level stacked mapper of
0.30+ and 0.32's ``_stack_vit_merger_qkv``, and main builds that stacked nothing at all.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

ENV_VAR = "VLLM_MINICPM_HOTFIX"

MODEL_CLASS = "MiniCPMV4_6ForConditionalGeneration"
ATTN_CLASS = "MiniCPMV4_6ViTWindowAttentionSelfAttn"

#: Checkpoint names fed to the probe, in the order safetensors yields them (sorted).
PROBE_NAMES = tuple(
    sorted(f"model.vision_tower.vit_merger.self_attn.{p}_proj.{s}" for p in "qkv" for s in ("weight", "bias"))
)


class Mode(str, enum.Enum):
    """``VLLM_MINICPM_HOTFIX``: ``auto`` (default) patches where vLLM is broken, ``force`` wherever the class
    exists, ``off`` never."""

    AUTO = "auto"
    FORCE = "force"
    OFF = "off"


#: Values of ``VLLM_MINICPM_HOTFIX`` that mean ``off`` (the start-up module ``_vllm_minicpm_hotfix_arm`` keeps a copy,
#: since it may import nothing; tests/test_hook.py keeps the two equal).
OFF_VALUES = frozenset(("off", "0", "false", "no", "disable", "disabled"))


def mode_from_env(environ: Mapping[str, str] | None = None) -> tuple[Mode, str | None]:
    """Read ``VLLM_MINICPM_HOTFIX``. Returns ``(mode, problem)``: an unknown value yields ``AUTO`` and a message."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in ("", "auto", "1", "on", "true", "yes"):
        return Mode.AUTO, None
    if value in ("force", "always"):
        return Mode.FORCE, None
    if value in OFF_VALUES:
        return Mode.OFF, None
    return Mode.AUTO, f"{ENV_VAR}={raw!r} is not one of auto, force, off; using auto"


class State(str, enum.Enum):
    BROKEN = "broken"  #: vLLM's own path loads the split q/k/v wrongly or not at all
    CORRECT = "correct"  #: vLLM's own path packs q/k/v correctly
    UNRECOGNISED = "unrecognised"  #: the classes or the fused ``qkv_proj`` this fix targets are not there
    UNDETERMINED = "undetermined"  #: the probe itself could not run on this vLLM


@dataclasses.dataclass(frozen=True)
class Verdict:
    state: State
    reason: str

    @property
    def broken(self) -> bool:
        return self.state is State.BROKEN


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


def probe_qkv_loading(module: ModuleType, load_weights: Any = None) -> Verdict:
    """Run vLLM's own top-level ``load_weights`` on a stand-in model and judge where the split q/k/v tensors land.

    Args:
        module: the imported ``vllm.model_executor.models.minicpmv4_6``.
        load_weights: the top-level loader to probe; default ``MiniCPMV4_6ForConditionalGeneration.load_weights``.

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
        loader = load_weights or getattr(module, MODEL_CLASS).load_weights
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


@dataclasses.dataclass(frozen=True)
class Decision:
    apply: bool
    why: str


def decide(mode: Mode, verdict: Verdict) -> Decision:
    """Combine the mode and the verdict. ``force`` applies wherever the layout is recognised."""
    if mode is Mode.OFF:
        return Decision(False, f"{ENV_VAR}=off")
    if verdict.state is State.UNRECOGNISED:
        return Decision(False, f"layout not recognised, vLLM left untouched: {verdict.reason}")
    if mode is Mode.FORCE:
        return Decision(True, f"{ENV_VAR}=force (verdict: {verdict.state.value})")
    if verdict.state is State.BROKEN:
        return Decision(True, f"vLLM's q/k/v loading is broken here: {verdict.reason}")
    if verdict.state is State.CORRECT:
        return Decision(False, "not needed: vLLM's own q/k/v loading is correct")
    return Decision(
        False,
        f"could not tell whether vLLM's q/k/v loading is broken ({verdict.reason}); vLLM left untouched, "
        f"set {ENV_VAR}=force to apply the fix anyway",
    )
