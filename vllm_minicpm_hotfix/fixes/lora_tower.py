"""Refuse, with one clear error, a LoRA adapter for the MiniCPM-V vision tower or connector that vLLM cannot apply.

What breaks
-----------
vLLM's LoRA manager (``LoRAModelManager`` in ``vllm/lora/model_manager.py``) wraps a multimodal model's vision tower
(``vpm``) and connectors (``vit_merger``, ``merger``: ``get_mm_mapping``) only with ``--enable-tower-connector-lora``
and only when the model tells it how many encoder tokens the tower sees: it asks the model's
``get_num_mm_encoder_tokens`` (0.22-0.26; 0.28 through ``get_mm_lora_token_counts``) or reads the model's
``supports_tower_connector_lora`` first (0.30+). The MiniCPM-V classes (4.6, and 4.7 which inherits them) define none
of these, so they keep ``SupportsMultiModal``'s stub, which answers None. Measured on vLLM 0.22.1-0.33.0 with the tiny
checkpoint and a peft adapter of the vision tower's attention and MLP layers:

* without the flag, the adapter loads (``WorkerLoRAManager._load_adapter`` accepts it: its module names end in
  ``q_proj`` ... ``fc2``, which the language model has too) and changes nothing: no tower layer is wrapped, the
  output is the base model's;
* with ``--enable-tower-connector-lora``, start-up dies in vLLM's ``get_punica_wrapper`` (0.22-0.26: ``TypeError:
  empty() received an invalid combination of arguments - got (NoneType, ...)``; 0.28: ``TypeError: '>' not supported
  between instances of 'NoneType' and 'NoneType'``), or vLLM logs that the flag "will be ignored" (0.30+), and the
  adapter is again silently ignored.

What the fix does
-----------------
* ``OpenAIServingModels.load_lora_adapter`` (``vllm/entrypoints/openai/models/serving.py``, the API server's load of
  a ``--lora-modules`` adapter at start-up and of ``POST /v1/load_lora_adapter``): before vLLM sends the adapter to
  the engine, an adapter folder whose ``adapter_model.safetensors`` names modules under the tower/connector prefixes
  (vLLM's ``parse_fine_tuned_lora_name`` with the class's ``hf_to_vllm_mapper``) of a MiniCPM-V class that cannot take
  tower LoRA gets vLLM's own ``ErrorResponse`` (HTTP 400 ``BadRequestError``) with the text below; vLLM's
  ``init_static_loras`` turns it into a start-up ``ValueError``. An adapter it cannot read goes to vLLM unchanged.
* ``WorkerLoRAManager._load_adapter`` (``vllm/lora/worker_manager.py``; the worker's load of a ``--lora-modules``
  adapter at start-up, of ``POST /v1/load_lora_adapter``, and of an ``LLM.generate(lora_request=...)``): after
  vLLM's own load, for a MiniCPM-V model this fix covers whose LoRA manager has no
  punica wrapper for a tower/connector prefix, an adapter with weights for modules under that prefix raises
  :class:`TowerLoRAError` naming the adapter, the modules (count and the first few), the model and what is allowed.
  Where the manager does wrap the tower (a vLLM that serves tower LoRA for the model), nothing is refused. This is
  the error an ``LLM(...)`` user sees, and a request that reaches the engine some other way (a resolver plugin).
  Both wrappers are set when vLLM imports their modules (``wrapt`` post-import hooks; only processes that serve or
  run LoRA import them), so the hook imports no LoRA or API-server code.
* ``MiniCPMV4_6ForConditionalGeneration.get_num_mm_encoder_tokens`` and ``get_mm_lora_token_counts`` (where the
  class has them): where vLLM's own answer is no count (the stub's None, or its ``NotImplementedError`` on 0.32+),
  :class:`TowerLoRAError` saying that ``--enable-tower-connector-lora`` cannot run for the model,
  instead of the ``TypeError`` in ``get_punica_wrapper``. vLLM calls them only for tower LoRA.

Other models get vLLM's own code.

The decision
------------
:func:`probe` asks the model class, on an instance created without ``__init__``, the question vLLM's LoRA manager
asks before it builds a tower wrapper: ``get_mm_lora_token_counts`` where the class has it, else
``get_num_mm_encoder_tokens``, for 64 image tokens. ``broken``: no positive ``int`` (stock 0.22-0.33), or the class
declares ``supports_tower_connector_lora`` false; ``correct``: a positive count and no such refusal (vLLM wraps the
tower), or a ``ValueError`` (the guard in place: refused clearly); ``unrecognised``: the class, its
``get_mm_mapping`` or both budget methods are not there. Under 1 ms; imports no LoRA code.

Upstream
--------
none known.

Remove when
-----------
its probe gets a positive ``int`` (vLLM wraps the tower) or a clear ``ValueError`` from stock vLLM's
``get_mm_lora_token_counts`` / ``get_num_mm_encoder_tokens`` for 64 image tokens on every release the hotfix supports;
every release measured so far answers no count.

"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import FAMILY, MODEL_CLASS, V46, V47, Call, Refusal, model_of, on_import, wrap

NAME = "lora_tower"
LABEL = "LoRA adapters of the vision tower / connector refused clearly (--lora-modules, load_lora_adapter)"
MODELS = (V46, V47)
#: The adapters it refuses are loaded by the LoRA that ``lora_support`` declares.
AFTER = ("lora_support",)
BUDGET = "get_num_mm_encoder_tokens"
WORKER_MODULE = "vllm.lora.worker_manager"
LOAD = "WorkerLoRAManager._load_adapter"
SERVING_MODULE = "vllm.entrypoints.openai.models.serving"
API_LOAD = "OpenAIServingModels.load_lora_adapter"
COUNTS = "get_mm_lora_token_counts"
#: safetensors file of a peft adapter folder.
ADAPTER_FILE = "adapter_model.safetensors"
#: Image tokens the probe asks the budget for.
PROBE_TOKENS = 64
#: How the probe's reason begins where the guard (a ValueError) answers.
REFUSED = "tower/connector LoRA is refused"
#: Module names quoted in the error.
SHOWN = 4

log = logging.getLogger("vllm.minicpm_hotfix")


class TowerLoRAError(Refusal):
    """A LoRA adapter (or ``--enable-tower-connector-lora``) asks for LoRA on the vision tower or connector of a
    MiniCPM-V model, which this vLLM's LoRA machinery cannot apply."""

    cause = "tower_lora"


def _prefixes(model: Any) -> list[str]:
    """The tower and connector prefixes of ``model.get_mm_mapping()`` (``["vpm", "vit_merger", "merger"]``)."""
    mapping = model.get_mm_mapping()
    out: list[str] = []
    for field in ("tower_model", "connector"):
        value = getattr(mapping, field, None) or []
        out.extend([value] if isinstance(value, str) else list(value))
    return [p for p in out if p]


def unapplied_modules(manager: Any, names: list[str]) -> list[str]:
    """Of the adapter's module ``names`` (vLLM names, e.g. ``vpm.encoder.layers.0.self_attn.q_proj``), those under a
    tower/connector prefix of ``manager.model`` for which ``manager`` (vLLM's ``LoRAModelManager``) has no punica
    wrapper, i.e. which it would silently leave out."""
    prefixes = _prefixes(manager.model)
    wrapped = set(getattr(manager, "punica_wrapper_mapping", {}) or {})
    out = []
    for name in names:
        hit = next((p for p in prefixes if name == p or name.startswith(p + ".")), None)
        if hit is not None and hit not in wrapped:
            out.append(name)
    return out


def refusal(model: Any, lora_name: str, lora_path: str, modules: list[str]) -> str:
    """The error text for an adapter whose tower/connector ``modules`` this vLLM cannot apply to ``model``."""
    member = model_of(model) or type(model).__name__
    shown = ", ".join(modules[:SHOWN]) + (", ..." if len(modules) > SHOWN else "")
    return (f"LoRA adapter {lora_name!r} ({lora_path}) has weights for {len(modules)} module(s) of the {member} vision "
            f"tower / connector ({shown}); this vLLM's LoRA applies to the language model of {member} only (its LoRA "
            f"manager wraps no vision tower or connector layer of {type(model).__name__}), so they would not be "
            f"applied. Drop those target modules (train the adapter on language_model layers only).")


def load_adapter(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``WorkerLoRAManager._load_adapter(self, lora_request) -> LoRAModel``: vLLM's own load, then
    :class:`TowerLoRAError` for an adapter with modules under a tower/connector prefix the manager does not wrap."""
    lora = wrapped(*call.args, **call.kwargs)
    manager = instance._adapter_manager
    bad = unapplied_modules(manager, sorted(getattr(lora, "loras", {}) or {}))
    if bad:
        request = call.get("lora_request")
        raise TowerLoRAError(refusal(manager.model, getattr(request, "lora_name", "?"),
                                     getattr(request, "lora_path", "?"), bad))
    return lora


def adapter_model(instance: Any, args: tuple, kwargs: dict) -> Any:
    """The model a ``WorkerLoRAManager`` loads adapters for (the class policy's subject), or None."""
    return getattr(getattr(instance, "_adapter_manager", None), "model", None)


def budget(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``get_num_mm_encoder_tokens`` / ``get_mm_lora_token_counts``: vLLM's answer where it is a count, else
    (None, or the ``NotImplementedError`` of the stub on vLLM 0.32+) :class:`TowerLoRAError`."""
    try:
        out = wrapped(*args, **kwargs)
    except NotImplementedError as exc:
        out = exc
    tokens = out[0] if isinstance(out, tuple) and out else out
    if _positive(tokens):
        return out
    member = model_of(instance)
    raise TowerLoRAError(
        f"--enable-tower-connector-lora: {member} ({type(instance).__name__}) gives vLLM's LoRA manager no "
        f"vision-encoder token count ({wrapped.__name__} answers {out!r}), so this vLLM cannot run LoRA on its "
        f"vision tower or connector. Start without --enable-tower-connector-lora: LoRA then applies to the "
        f"language model of {member}, and an adapter with tower / connector modules is refused when it is "
        f"loaded.")


def tower_lora_possible(cls: type) -> bool:
    """Whether vLLM's LoRA manager can wrap the vision tower of ``cls``: its budget method gives a positive count for
    a stand-in instance and it does not declare ``supports_tower_connector_lora`` false (as :func:`probe` judges)."""
    verdict = probe_class(cls)
    return verdict.state is State.CORRECT and not verdict.reason.startswith(REFUSED)


def served_class(serving: Any, *_: Any) -> type | None:
    """The family model class an ``OpenAIServingModels`` serves (the class policy's subject: its config's
    architectures in the family's model modules vLLM imported), or None."""
    config = getattr(getattr(serving, "engine_client", None), "model_config", None) or getattr(
        getattr(serving, "registry", None), "model_config", None)
    archs = list(getattr(getattr(config, "hf_config", None), "architectures", None) or [])
    return next((getattr(sys.modules[m], a) for m in FAMILY for a in archs
                 if m in sys.modules and isinstance(getattr(sys.modules[m], a, None), type)), None)


def api_refusal(serving: Any, request: Any) -> str | None:
    """In the API server, before vLLM sends an adapter to the engine: the refusal text if the served model is a
    covered MiniCPM-V class that cannot take tower LoRA and the adapter folder's safetensors names modules under its
    tower / connector prefixes (vLLM's own ``parse_fine_tuned_lora_name`` with the class's ``hf_to_vllm_mapper``);
    None (vLLM's own code) otherwise, or when anything cannot be read. Never raises."""
    try:
        import os

        cls = served_class(serving)
        path = str(getattr(request, "lora_path", "") or "")
        if cls is None or not os.path.isfile(os.path.join(path, ADAPTER_FILE)) or tower_lora_possible(cls):
            return None
        from safetensors import safe_open
        from vllm.lora.utils import parse_fine_tuned_lora_name

        mapper = getattr(cls, "hf_to_vllm_mapper", None)
        if mapper is not None and hasattr(mapper, "get_unstacked_mapper"):  # as the worker maps (0.26+)
            mapper = mapper.get_unstacked_mapper()
        if getattr(mapper, "orig_to_new_stacked", None):  # 0.30+: q/k/v stay separate, as the worker counts them
            import dataclasses

            mapper = dataclasses.replace(mapper, orig_to_new_stacked={})
        with safe_open(os.path.join(path, ADAPTER_FILE), framework="pt") as f:
            keys = list(f.keys())
        stand_in = object.__new__(cls)
        prefixes = _prefixes(stand_in)
        modules = sorted({parse_fine_tuned_lora_name(k, mapper)[0] for k in keys})
        bad = [n for n in modules if any(n == p or n.startswith(p + ".") for p in prefixes)]
        return refusal(stand_in, getattr(request, "lora_name", "?"), path, bad) if bad else None
    except Exception as exc:  # noqa: BLE001 - vLLM's own load then (the worker's guard still refuses)
        log.info("vllm-minicpm-hotfix: %s: adapter not checked in the API server (%s)", NAME, exc)
        return None


async def load_lora_adapter(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around the coroutine ``OpenAIServingModels.load_lora_adapter(self, request, base_model_name=None)``: vLLM's
    own load, or vLLM's 400 ``ErrorResponse`` with :func:`api_refusal`'s text."""
    text = api_refusal(instance, call.get("request"))
    if text is None:
        return await wrapped(*call.args, **call.kwargs)
    log.warning("vllm-minicpm-hotfix: %s", text)
    # vLLM's own 400 BadRequestError, returned as vLLM's method returns its errors (the framework counts the refusal).
    raise TowerLoRAError(text, response=sys.modules[type(instance).__module__].create_error_response(text))


def _counts(old: Any, cls: Any) -> Any:
    """:data:`PATCHES`' ``get_mm_lora_token_counts``: wrapped where the class has it; ``RuntimeError`` if the class
    has neither it nor ``get_num_mm_encoder_tokens`` (nothing is set then)."""
    if not callable(old) and not (isinstance(cls, type) and callable(getattr(cls, BUDGET, None))):
        raise RuntimeError(f"{getattr(cls, '__module__', '?')}.{MODEL_CLASS} has neither {BUDGET} nor {COUNTS}")
    return wrap(budget) if callable(old) else None


#: The model's budget methods (each wrapped where the class has it; one of them at least), the worker's adapter load
#: and the API server's (set when vLLM imports their modules).
PATCHES = {
    f"{MODEL_CLASS}.{BUDGET}": lambda old, _: wrap(budget) if callable(old) else None,
    f"{MODEL_CLASS}.{COUNTS}": _counts,
    f"{WORKER_MODULE}:{LOAD}": on_import(wrap(load_adapter, bind=True, model=adapter_model)),
    f"{SERVING_MODULE}:{API_LOAD}": on_import(wrap(load_lora_adapter, bind=True, model=served_class)),
}


def _positive(tokens: Any) -> bool:
    return isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0


def probe(module: ModuleType) -> Verdict:
    """Can this vLLM's LoRA manager wrap the vision tower of the model class, or is it refused clearly? Never
    raises; changes nothing."""
    cls = getattr(module, MODEL_CLASS, None)
    if not isinstance(cls, type) or not callable(getattr(cls, "get_mm_mapping", None)):
        return Verdict(State.UNRECOGNISED, f"{module.__name__} has no {MODEL_CLASS}.get_mm_mapping", applicable=False)
    return probe_class(cls)


def probe_class(cls: type) -> Verdict:
    """:func:`probe` on the model class ``cls``."""
    counts = getattr(cls, COUNTS, None)
    if not callable(counts) and not callable(getattr(cls, BUDGET, None)):
        return Verdict(State.UNRECOGNISED, f"{MODEL_CLASS} has neither get_mm_lora_token_counts nor {BUDGET}",
                       applicable=False)
    stand_in = object.__new__(cls)
    tokens: Any = None
    asked = BUDGET
    try:
        if callable(counts):  # what vLLM 0.28+'s manager asks; the stub of 0.32+ raises NotImplementedError
            asked = COUNTS
            try:
                answer = stand_in.get_mm_lora_token_counts(modality="image", mm_kwargs=None,
                                                           num_mm_embeds=PROBE_TOKENS)
                tokens = answer[0] if isinstance(answer, tuple) else answer
            except NotImplementedError:
                tokens = None
        if not _positive(tokens) and callable(getattr(cls, BUDGET, None)):  # what 0.22-0.26's manager asks
            asked = BUDGET
            try:
                tokens = getattr(stand_in, BUDGET)(PROBE_TOKENS)
            except NotImplementedError:
                tokens = None
    except ValueError as exc:
        return Verdict(State.CORRECT, f"{REFUSED} with a clear error ({exc})")
    except Exception as exc:  # noqa: BLE001
        return Verdict(State.UNDETERMINED, f"{MODEL_CLASS}.{asked} failed: {type(exc).__name__}: {exc}")
    if not _positive(tokens):
        return Verdict(State.BROKEN, f"{MODEL_CLASS}.{asked} answers {tokens!r} for {PROBE_TOKENS} image tokens: "
                                     "vLLM's LoRA manager wraps no vision tower / connector layer (an adapter of "
                                     "them loads and is silently ignored; --enable-tower-connector-lora fails or is "
                                     "ignored)")
    if getattr(cls, "supports_tower_connector_lora", True) is False:
        return Verdict(State.BROKEN, f"{MODEL_CLASS}.supports_tower_connector_lora is False: vLLM's LoRA manager "
                                     "wraps no vision tower / connector layer")
    return Verdict(State.CORRECT, f"{MODEL_CLASS}.{asked} answers {tokens} encoder tokens: vLLM's LoRA manager can "
                                  "wrap the vision tower with --enable-tower-connector-lora")
