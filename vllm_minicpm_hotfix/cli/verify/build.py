"""What ``verify`` gathers from vLLM: vLLM started as its processes start, the hotfix as this environment activated
it, and the model vLLM resolves for the checkpoint, built and loaded through vLLM's own ``load_weights``.

* :func:`start_vllm_like_its_processes` -- ``import vllm``, ``vllm.plugins.load_general_plugins()`` (as EngineCore and
  the workers do), the import of the model module. ``verify`` never installs the hook itself.
* :func:`hotfix_state` -- what the hotfix did in this process: a count, and a row per fix of the registry.
* :func:`build_model` -- the model class vLLM resolves (``get_model_architecture``) built on the device, by default
  with the language model left out through vLLM's ``mm_encoder_only``; :func:`language_model_filter` -- which
  checkpoint tensors that model takes (decided with the model's own ``hf_to_vllm_mapper``).
* :func:`load` -- the model's own top-level ``load_weights`` over the streamed checkpoint, the call vLLM's
  ``DefaultModelLoader`` makes.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .._util import exc_line, one_line, vllm_distributions
from ...fixes import REGISTRY
from ...hook import TARGET_MODULE
from .checkpoint import ARCHITECTURE, Checkpoint


class VerifyFailed(Exception):
    """vLLM could not be used or its own load raised: exit 1."""


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
        module = importlib.import_module(TARGET_MODULE)
    except ModuleNotFoundError as exc:
        raise VerifyFailed(
            f"vLLM {version} has no MiniCPM-V 4.6 model ({TARGET_MODULE} is missing; it exists from vLLM 0.22)"
        ) from exc
    except Exception as exc:
        raise VerifyFailed(f"importing {TARGET_MODULE} failed: {exc_line(exc)}") from exc
    return module, version


def hotfix_state() -> tuple[bool, str, list[tuple[str, str, str]]]:
    """``(active, one line, rows)`` of the hotfix in *this* process: the line counts (``patched 11 of 18 fixes``) and
    names only a fix that failed in the hook; ``rows`` is one ``(fix, result, why)`` per fix of the registry, for
    ``--fixes``."""
    import vllm_minicpm_hotfix

    st = vllm_minicpm_hotfix.status()
    if not st.get("hook_installed"):
        return False, (
            "not active (no activation path fired in this process; `vllm-minicpm-hotfix doctor` says why)"
        ), []
    boot = sys.modules.get("vllm_minicpm_hotfix._bootstrap")
    by = ", ".join(dict.fromkeys(getattr(boot, "activations", None) or [])) or "an explicit install()"
    recorded = st.get("fixes", {})
    rows = []
    for name in [f.NAME for f in REGISTRY] + sorted(set(recorded) - {f.NAME for f in REGISTRY}):
        fix = recorded.get(name)
        if fix is None:
            continue
        if fix.get("error"):
            rows.append((name, "ERROR", one_line(fix["error"], 160)))
        elif fix.get("applied"):
            rows.append((name, "PATCHED", f"verdict {fix.get('verdict')}"))
        else:
            rows.append((name, "not applied", one_line(fix.get("why"), 160)))
    patched = sum(r[1] == "PATCHED" for r in rows)
    line = f"active (mode {st.get('mode')}, activated by {by}): patched {patched} of {len(rows)} fixes"
    failed = [r[0] for r in rows if r[1] == "ERROR"]
    if failed:
        line += f"; hook ERROR in {', '.join(failed)}"
    if not st.get("module_imported"):
        line += "; the hook did not see the model module"
    return True, line + " (--fixes: each with its reason)", rows


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
    except Exception as exc:  # noqa: BLE001 - whatever stops the encoder-only build: build it whole, say why
        built = _build(ckpt, module, device=device, dtype=dtype, encoder_only=False)
        built.fallback = exc_line(exc, 240)
        return built


def _build(ckpt: Checkpoint, module: Any, *, device: str, dtype: str, encoder_only: bool) -> Built:
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )

    from ..vllm_cpu import construct_model, ensure_distributed, model_dtype

    ensure_distributed("gloo" if device == "cpu" else "nccl")
    kwargs: dict[str, Any] = {"model": str(ckpt.path), "skip_tokenizer_init": True, "dtype": dtype,
                              "enforce_eager": True}
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
    config_kwargs: dict[str, Any] = {"model_config": model_config, "device_config": DeviceConfig(device=device)}
    if encoder_only:
        # An encoder-only instance has no KV cache: vLLM switches prefix caching off for it, but too late for
        # 0.30.0's hybrid-model check ("--mamba-block-size can only be set with --enable-prefix-caching").
        from vllm.config import CacheConfig

        config_kwargs["cache_config"] = CacheConfig(enable_prefix_caching=False)
    vllm_config = VllmConfig(**config_kwargs)
    with set_current_vllm_config(vllm_config):
        try:
            from vllm.model_executor.model_loader.utils import get_model_architecture

            model_cls, _ = get_model_architecture(model_config)
        except Exception:  # noqa: BLE001 - an older/newer layout of vLLM's loader utils: the module's own class
            if ckpt.architecture != ARCHITECTURE:
                raise  # another member's class is not the 4.6 module's: vLLM's own error says why
            model_cls = getattr(module, ARCHITECTURE)
    model = construct_model(model_cls, vllm_config, device)
    if encoder_only and not getattr(model, "_language_model_names", None):
        encoder_only = False  # this vLLM's model class does not mark its language model: it was built in full
    return Built(model, vllm_config, model_cls, encoder_only, model_dtype(vllm_config))


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
        except Exception:  # noqa: BLE001 - a name the mapper chokes on: feed it, vLLM's loader decides
            return True
        if mapped is None:
            return False  # vLLM's mapper drops it (e.g. "mtp.")
        return not any(mapped == r or mapped.startswith(r + ".") for r in roots)

    return keep


def load(built: Built, tensors: Iterator[tuple[str, Any]]) -> None:
    """``built.model.load_weights(tensors)`` under the model's vLLM config -- the call vLLM's ``DefaultModelLoader``
    makes. Raises what it raises."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(built.vllm_config):
        built.model.load_weights(tensors)
