"""Where a chat answer stops: the stop token ids vLLM derives from a checkpoint's own files, against the token the
checkpoint's chat template closes an assistant turn with. ``verify --model`` prints it as one line, ``doctor --model``
as one row.

What vLLM does per request (the same in 0.22.1, 0.28.0, 0.32.0 and 0.33.0): the engine's ``InputProcessor`` calls
``SamplingParams.update_from_generation_config(model_config.try_get_generation_config(),
renderer.get_eos_token_id())``. The first argument is the non-default fields of the checkpoint's
``generation_config.json`` (``transformers.GenerationConfig.from_pretrained``; without that file,
``GenerationConfig.from_model_config`` of ``config.json``); it is read under ``--generation-config auto`` and ``vllm``
alike, and from the folder given under ``--generation-config DIR``. The second is the tokenizer's ``eos_token_id``.
The request then stops (``vllm.v1.core.sched.utils.check_stop``) on its ``eos_token_id`` or on any of its
``stop_token_ids``, which ``update_from_generation_config`` extends with the generation config's ``eos_token_id``
(an int or a list). ``--override-generation-config`` does not reach it (``get_diff_sampling_param`` applies the
override to sampling defaults only).

* :func:`vllm_stops` -- that set, computed by calling those vLLM functions on the checkpoint (needs vLLM; no engine).
* :func:`turn_end` -- the end-of-turn token: the chat template vLLM's chat endpoint uses without ``--chat-template``
  and without tools (``vllm.renderers.hf.resolve_chat_template``: the processor's, else the tokenizer's, else vLLM's
  own fallback for the model type -- ChatML for ``minicpmv4_6``), rendered with transformers' own tokenizer
  (``apply_chat_template``) for a one-turn chat followed by the user's next message (so that every template closes
  the assistant's turn: vLLM's ChatML fallback leaves the last message open); the first token after the assistant's
  answer, which must be an added (special) token of the tokenizer (``<|im_end|>`` for ChatML).
* :func:`judge` -- ``(status, detail, stop_token_ids)``: ``OK``, ``WARN`` (the end-of-turn id is not a stop id:
  an answer runs past its turn; ``stop_token_ids`` is the full list to pass) or ``-`` (cannot tell).
* :func:`report` -- all of it as one JSON-able dict (``doctor --model`` runs it in a fresh vLLM process through
  :mod:`vllm_minicpm_hotfix.cli.model_report`).

Importing this module imports neither vLLM nor transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ._util import exc_line

#: The chat rendered to find where the assistant's turn ends: one turn, then the user's next message.
QUESTION, ANSWER, NEXT = "Hi", "Hello", "Thanks"


def _token(tokenizer: Any, token_id: int) -> str | None:
    try:
        text = tokenizer.convert_ids_to_tokens(int(token_id))
    except Exception:  # noqa: BLE001 - an id outside the vocabulary: no text
        return None
    return text if isinstance(text, str) else None


def vllm_stops(folder: str | os.PathLike, model_config: Any | None = None) -> dict[str, Any]:
    """The token ids on which vLLM stops a request for the checkpoint in ``folder``, as vLLM computes them: vLLM's
    ``ModelConfig(model=folder)`` (or ``model_config``), its ``try_get_generation_config()``, the tokenizer vLLM's
    renderer loads (``vllm.tokenizers.cached_tokenizer_from_config``) and its ``eos_token_id``, then
    ``SamplingParams().update_from_generation_config(...)`` as vLLM's ``InputProcessor`` calls it.

    Returns ``{"stop_ids": sorted ids (the request's eos_token_id and stop_token_ids), "tokenizer_eos": {"id",
    "token"} or None, "generation_config": {"file": "generation_config.json" | "config.json", "eos_token_id": list
    or None}, "tokens": {id: token text}, "tokenizer_error": str or None}``, or ``{"error": str}`` when vLLM
    cannot make a model config for the folder. Needs vLLM (imported here); loads no model."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.sampling_params import SamplingParams

        if model_config is None:
            from vllm.config import ModelConfig

            model_config = ModelConfig(model=str(folder))
        generation = model_config.try_get_generation_config()
    except Exception as exc:  # noqa: BLE001 - reported, never raised: verify/doctor go on
        return {"error": f"vLLM could not read the checkpoint's configuration: {exc_line(exc, 300)}"}
    tokenizer, tokenizer_error = None, None
    try:
        from vllm.tokenizers import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(model_config)
    except Exception as exc:  # noqa: BLE001 - no (loadable) tokenizer in the folder
        tokenizer_error = exc_line(exc, 300)
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    params = SamplingParams()
    params.update_from_generation_config(generation, eos)
    stop_ids = sorted({i for i in [params.eos_token_id, *(params.stop_token_ids or [])] if i is not None})
    gen_eos = generation.get("eos_token_id")
    if gen_eos is not None and not isinstance(gen_eos, list):
        gen_eos = [gen_eos]
    path = Path(folder)
    gen_file = "generation_config.json" if (path / "generation_config.json").is_file() else "config.json"
    tokens = {i: _token(tokenizer, i) for i in stop_ids} if tokenizer is not None else {}
    return {
        "stop_ids": stop_ids,
        "tokenizer_eos": None if eos is None else {"id": eos, "token": _token(tokenizer, eos)},
        "generation_config": {"file": gen_file, "eos_token_id": gen_eos},
        "tokens": tokens,
        "tokenizer_error": tokenizer_error,
        "chat_template": _vllm_chat_template(tokenizer, model_config),
    }


def _vllm_chat_template(tokenizer: Any, model_config: Any) -> str | None:
    """The chat template vLLM's chat endpoint renders with when neither ``--chat-template`` nor tools are given
    (``vllm.renderers.hf.resolve_chat_template``, 0.22-0.33), or None."""
    if tokenizer is None:
        return None
    try:
        from vllm.renderers.hf import resolve_chat_template

        return resolve_chat_template(tokenizer, None, None, model_config=model_config)
    except Exception:  # noqa: BLE001 - another vLLM layout, or no template: turn_end falls back to the tokenizer's
        return None


def turn_end(folder: str | os.PathLike, chat_template: str | None = None) -> dict[str, Any]:
    """The token that closes the assistant's turn in a one-turn chat (user ``Hi``, assistant ``Hello``, then the
    user's ``Thanks``), rendered with transformers' ``AutoTokenizer.from_pretrained(folder).apply_chat_template`` and
    ``chat_template`` (vLLM's choice; None: the tokenizer's own). Returns ``{"id", "token", "template"}``
    (``template``: ``"vLLM's"`` or ``"the tokenizer's"``), or ``{"error": why it cannot be told}``: no tokenizer, no
    template, a template that raises or does not show the answer, or one that closes the turn with plain text rather
    than an added token."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001
        return {"error": f"no tokenizer transformers can load ({exc_line(exc, 200)})"}
    template, whose = (chat_template, "vLLM's") if chat_template else (getattr(tok, "chat_template", None),
                                                                        "the tokenizer's")
    if not template:
        return {"error": "no chat template (neither the processor nor the tokenizer has one)"}
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": NEXT}]
    try:
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"the chat template raised for a one-turn chat: {exc_line(exc, 200)}"}
    at = text.find(ANSWER) if isinstance(text, str) else -1
    if at < 0:
        return {"error": "the chat template does not render the assistant's answer"}
    rest = text[at + len(ANSWER):]
    ids = tok(rest, add_special_tokens=False)["input_ids"] if rest else []
    if not ids:
        return {"error": "the chat template closes the assistant's turn with nothing"}
    first = int(ids[0])
    if first not in (getattr(tok, "added_tokens_decoder", None) or {}) and first not in tok.all_special_ids:
        return {"error": f"the chat template closes the assistant's turn with plain text ({rest[:24]!r}), no special "
                         "token"}
    return {"id": first, "token": tok.convert_ids_to_tokens(first), "template": whose}


def _named(ids: list[int], tokens: dict) -> str:
    return ", ".join(f"{i} {tokens[i]}" if tokens.get(i) else str(i) for i in ids)


def _sources(stops: dict[str, Any]) -> str:
    eos = stops.get("tokenizer_eos")
    gen = stops.get("generation_config") or {}
    parts = [f"tokenizer eos {eos['id']} {eos['token'] or ''}".rstrip() if eos else "no tokenizer eos"]
    ids = gen.get("eos_token_id")
    parts.append(f"{gen.get('file')} eos_token_id {ids if ids is not None else 'unset'}")
    return "; ".join(parts)


def judge(stops: dict[str, Any], end: dict[str, Any]) -> tuple[str, str, list[int] | None]:
    """``(status, detail, stop_token_ids)`` from :func:`vllm_stops` and :func:`turn_end`: ``OK`` when the end-of-turn
    id is among vLLM's stop ids; ``WARN`` when it is not (``stop_token_ids``: vLLM's ids plus it, the list to pass
    in each request); ``-`` when it cannot be told (no template, no tokenizer, vLLM cannot read the folder)."""
    if stops.get("error"):
        return "-", f"cannot tell: {stops['error']}", None
    ids = stops["stop_ids"]
    named = f"[{_named(ids, stops['tokens'])}] ({_sources(stops)})" if ids else f"no id ({_sources(stops)})"
    if stops.get("tokenizer_error") and stops.get("tokenizer_eos") is None:
        return ("-", f"cannot tell: vLLM cannot load the tokenizer ({stops['tokenizer_error']}); vLLM stops on {named}",
                None)
    if end.get("error"):
        return "-", f"cannot tell which token ends a chat answer: {end['error']}; vLLM stops on {named}", None
    eot, text = end["id"], end["token"]
    if eot in ids:
        return "OK", f"vLLM stops on {named}; the chat template ends the assistant's turn with {text} ({eot})", None
    fix = sorted({*ids, eot})
    return "WARN", (f"a chat answer can run past the end of its turn: the chat template ends it with {text} ({eot}), "
                    f"but vLLM stops only on {named}; pass \"stop_token_ids\": {fix} with each request, or list "
                    f"{eot} in the checkpoint's generation_config.json eos_token_id"), fix


def report(folder: str | os.PathLike, model_config: Any | None = None) -> dict[str, Any]:
    """:func:`vllm_stops` and :func:`turn_end` for ``folder`` and their :func:`judge`, as one JSON-able dict:
    ``vllm`` (the stop ids and where they come from), ``turn_end``, ``status``, ``detail``, ``stop_token_ids``.
    Never raises: whatever goes wrong is a ``-`` (cannot tell) naming the error."""
    try:
        return _report(folder, model_config)
    except Exception as exc:  # noqa: BLE001 - a check of the serving set-up must not stop verify or doctor
        return {"vllm": None, "turn_end": None, "status": "-", "detail": f"cannot tell: {exc_line(exc, 300)}",
                "stop_token_ids": None}


def _report(folder: str | os.PathLike, model_config: Any | None) -> dict[str, Any]:
    stops = vllm_stops(folder, model_config)
    end = turn_end(folder, stops.pop("chat_template", None)) if not stops.get("error") else {"error": "not looked at"}
    status, detail, fix = judge(stops, end)
    stops["tokens"] = {str(k): v for k, v in stops.get("tokens", {}).items()}  # JSON keys
    return {"vllm": stops, "turn_end": end, "status": status, "detail": detail, "stop_token_ids": fix}

