"""A guard: a request whose placeholder count disagrees with its processed tensors is refused, not sent to the engine.

What breaks
-----------
vLLM builds two things for every MiniCPM-V 4.6 image or video in a request, in its multimodal processor (the API
server process under ``vllm serve``): the prompt's placeholder -- ``<|image_pad|>`` / ``<|video_pad|>`` tokens, laid
out by ``MiniCPMV4_6ProcessingInfo.get_slice_image_placeholder`` / ``MiniCPMV4_6MultiModalProcessor.
get_video_prompt_texts`` -- and the processed tensors (``pixel_values`` + ``tgt_sizes`` per slice, from transformers'
image processor). The two are computed by separate arithmetic. Where they disagree (a per-request
``mm_processor_kwargs`` such as ``{"slice_mode": false}`` or ``{"max_slice_nums": 1}`` that one side ignores, the
W/H swap of 0.22-0.23, the HWC video frame size of 0.22.x, ...), nothing in vLLM notices until EngineCore merges the
vision embeddings into the prompt: ``_merge_multimodal_embeddings`` raises ``ValueError: Attempted to assign N
multimodal tokens to M placeholders`` *inside the engine*, the engine dies, and every request in flight fails with it
(or, where the tensors give more embeddings than the prompt has pads, the surplus is silently dropped).

What the fix does
-----------------
After vLLM has resolved the prompt updates of a request -- and before its multimodal processor cache records the
items as sent to the engine -- it compares, for each item, the number of embedding positions of its placeholder (the
positions vLLM's own ``PromptUpdateDetails.is_embed`` selects) with the number of vision embeddings its processed
tensors make the model produce. The latter mirrors ``MiniCPMV4_6ForConditionalGeneration.get_vision_hidden_states``
(vLLM 0.22-0.33): per slice of ``tgt_sizes`` = ``(h, w)`` patches, the vit_merger (2x2 windows, run when the item's
``use_vit_merger`` flag is true: ``"16x"``) halves each side, then ``MiniCPMV4_6Merger`` (2x2) halves it again::

    16x: (h // 2 // 2) * (w // 2 // 2)        4x: (h // 2) * (w // 2)

summed over the item's slices (``tgt_sizes`` for images, ``video_tgt_sizes`` for videos, all frames). The flag is
the item's ``use_vit_merger`` / ``video_use_vit_merger`` field; a video item without one (vLLM <= 0.31 without the
``encoder_modes`` fix) is encoded in the model config's ``downsample_mode``, which is what the guard then assumes.
Items given as embeddings (``image_embeds``) and items the processor cache already holds are not judged (the latter
were judged when they were first processed: the cache key includes the request's processor kwargs).

On a mismatch it raises one ``ValueError`` naming the modality, the item's index in the request, both counts and the
slice sizes, e.g.::

    MiniCPM-V 4.7: image item 0 of this request has 20 <|image_pad|> placeholder tokens in the prompt, but its
    processed pixel values give 4 vision embeddings (1 slice, tgt_sizes [[8, 8]] patches, 16x) ...

``vllm serve`` answers such a request ``400 Bad Request`` with that message; the engine never sees it. Where the
counts agree the guard does nothing else (it returns vLLM's own result object). It does not diagnose or repair the
cause -- the other fixes do that where they can -- so it protects every release and every kwarg combination no fix
covers, e.g. ``{"slice_mode": false}`` on 0.32/0.33.

It hooks two methods of vLLM's ``BaseMultiModalProcessor`` (``vllm/multimodal/processing/processor.py``), set on
``MiniCPMV4_6MultiModalProcessor`` only (other models are untouched):

* ``_apply_hf_processor(inputs, timing_ctx)`` -- the path without a processor cache: its result (a tuple
  ``(prompt_ids, MultiModalProcessingInfo, is_update_applied)`` in 0.22-0.28, a ``MultiModalProcessingInfo`` in 0.30,
  a ``MultiModalProcessingResult`` in 0.32-0.33) carries ``kwargs`` and ``prompt_updates`` for every item;
* ``_merge_mm_kwargs(cache, mm_hashes, mm_is_cached, mm_missing_kwargs, mm_missing_prompt_updates)`` -- the cached
  path: the items not yet cached, checked *before* vLLM's sender cache marks them as held by the engine (raising later
  would leave the front end believing the engine has an item it never received: on 0.22-0.26 the next identical
  request then fails an ``assert`` in the engine).

The decision
------------
:func:`probe` runs the 4.6 processor's own ``_merge_mm_kwargs`` (the guard's hook on the cached path) and then
``_maybe_apply_prompt_updates`` (where vLLM checks that items, prompt updates and placeholders agree) -- as the
classes now stand -- on a stand-in processor (created without ``__init__``) for a one-item request whose placeholder
has 2 pads while its tensors (one 4x4-patch slice, 16x) give 1 embedding. The cache it passes is vLLM's own: the
installed release's ``MultiModalProcessorOnlyCache``, empty, built by its own ``__init__``
(:func:`._stand_ins.processor_cache`), so whatever cache method ``_merge_mm_kwargs`` calls is vLLM's code (0.34.0
added ``get_cached_item``, which a hand-made stand-in lacked). ``broken`` if both let the request through (stock vLLM
0.22-0.34: it checks item counts, never embedding counts), ``correct`` if either raises a ``ValueError`` (a vLLM that
validates this itself, or the guard applied: 2 against 1 is a mismatch of one, so the guard's probe on the patched
class also shows it compares for equality), ``unrecognised`` if the classes or methods are not there.

``undetermined`` if vLLM's path cannot be run on the stand-in (a later release calling something the probe cannot
give). The guard is then still applied under ``auto`` -- the verdict carries ``guard=True`` -- where the probe shows
the guard's own check works on this vLLM's objects: it refuses the 2-pads / 1-embedding item built by vLLM's
``MultiModalKwargsItems`` and resolved prompt updates, and passes a 2 / 2 one. Applying it is then harmless: it only
compares counts and refuses a request the engine would die on anyway, and where vLLM did validate itself the two
checks refuse the same requests. Where the guard's check does not work either, it is left off and the reason says
so (``doctor`` FAILs on it, the summary line lists it under "could not tell"). ``force`` applies it wherever the
hooks exist.

Upstream
--------
none known.

Remove when
-----------
its probe sees stock vLLM itself refuse (a ``ValueError``) the request whose placeholder pads differ from the
embeddings its tensors give, before the engine, on every release the hotfix supports; no release measured so far
compares embedding counts.

"""

from __future__ import annotations

import functools
import inspect
import operator
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any

from ..decision import State, Verdict
from ._base import PROCESSOR_CLASS, PROCESSOR_PATH, V46, V47, VOCR, Call, Refusal, WeakMemo, model_of, wrap

NAME = "placeholder_guard"
#: MiniCPM-OCR's processors (the backport's, vLLM 0.33's) inherit both hooked methods and its model 4.6's
#: get_vision_hidden_states: the same per-slice count, its "4x" default read from the item's flag or the config.
MODELS = (V46, V47, VOCR)
DEFER_AT = PROCESSOR_PATH  # probed with vLLM's processor, at its first use
LABEL = "placeholder/embedding count guard (HTTP 400 instead of a dead engine)"

#: modality -> (field with the per-slice (h, w) patch grid, field with the item's vit_merger flag, pad token attr,
#: default pad text).
FIELDS: dict[str, tuple[str, str, str, str]] = {
    "image": ("tgt_sizes", "use_vit_merger", "image_token", "<|image_pad|>"),
    "video": ("video_tgt_sizes", "video_use_vit_merger", "video_token", "<|video_pad|>"),
}


class PlaceholderMismatchError(Refusal):
    """A request's placeholder count disagrees with its processed tensors (a ``ValueError``: HTTP 400)."""

    cause = "placeholder_mismatch"


# --------------------------------------------------------------------------------------------------------------------
# The counts
# --------------------------------------------------------------------------------------------------------------------


def embeddings_per_slice(h: int, w: int, use_vit_merger: bool) -> int:
    """Vision embeddings vLLM's 4.6 model produces for one slice of ``h x w`` patches (see the module docstring)."""
    if use_vit_merger:
        return (h // 2 // 2) * (w // 2 // 2)
    return (h // 2) * (w // 2)


def _flag(value: Any) -> bool | None:
    if value is None:
        return None
    tolist = getattr(value, "tolist", None)  # a tensor (or an array): one call into torch, then judged as a list
    if tolist is not None:
        value = tolist()
        if type(value) is list and (not value or type(value[0]) is not list):  # 1-D (the usual one-element flag)
            return any(value) if value else None
    if isinstance(value, (list, tuple)):
        flags = [_flag(v) for v in value]
        flags = [f for f in flags if f is not None]
        return any(flags) if flags else None
    return bool(value)


def default_use_vit_merger(hf_config: Any) -> bool:
    """What vLLM's model does for an item without a flag: ``get_vision_hidden_states(downsample_mode=None)`` uses
    ``config.downsample_mode`` (default ``"16x"``) and runs the vit_merger iff that is not ``"4x"`` and
    ``insert_layer_id >= 0``."""
    mode = getattr(hf_config, "downsample_mode", None) or "16x"
    return mode != "4x" and getattr(hf_config, "insert_layer_id", -1) >= 0


def item_data(item: Any) -> Mapping[str, Any]:
    """A ``MultiModalKwargsItem``'s tensors by field name (``{field: elem.data}``)."""
    if hasattr(item, "get_data"):
        return item.get_data()
    return {k: getattr(v, "data", v) for k, v in dict(item).items()}


def _grid_and_flag(modality: str, item: Any, hf_config: Any,
                   config_of: Callable[[], Any] | None = None) -> tuple[list[list[int]], bool, int] | None:
    """The item's per-slice ``[h, w]`` patch grid, whether the vit_merger runs for it, and the vision embeddings that
    makes (the sum of :func:`embeddings_per_slice`), or None if it is not judged (an unknown modality, embeddings given
    directly, no ``tgt_sizes``). With ``config_of``, the model config is ``config_of()``, asked only for an item
    without a flag. Runs once per item of every request, so it reads the two fields' tensors (``item.get(name).data``)
    without :func:`item_data`'s others, and sums in one loop."""
    fields = FIELDS.get(modality)
    data = getattr(item, "data", None)  # plain(item), inline: on the request path a call costs more than its line
    get = getattr(data if type(data) is dict else item, "get", None)
    if fields is None or get is None:
        return None
    sizes = get(fields[0])
    sizes = getattr(sizes, "data", sizes)
    if sizes is None:
        return None
    flag = get(fields[1])
    flag = _flag(getattr(flag, "data", flag))
    if flag is None:
        flag = default_use_vit_merger(hf_config if config_of is None else config_of())
    if getattr(sizes, "ndim", None) == 2 and sizes.shape[1] == 2:  # already (slices, 2): one call into torch
        grid = sizes.tolist()
    else:
        grid = sizes.reshape(-1, 2).tolist()
    total = 0
    for h, w in grid:
        h, w = int(h) // 2, int(w) // 2
        total += (h // 2) * (w // 2) if flag else h * w
    return grid, flag, total


def _describe(modality: str, grid: list[list[int]], flag: bool) -> str:
    grid = [[int(v) for v in row] for row in grid]
    shown = grid if len(grid) <= 6 else [*grid[:5], "..."]
    return (f"{len(grid)} slice{'s' if len(grid) != 1 else ''}, {FIELDS[modality][0]} {shown} patches, "
            f"{'16x' if flag else '4x'}")


def expected_embeddings(modality: str, item: Any, hf_config: Any) -> tuple[int, str] | None:
    """``(embeddings, description)`` the model will produce for one processed item, or None if it is not judged
    (an unknown modality, embeddings given directly, no ``tgt_sizes``)."""
    found = _grid_and_flag(modality, item, hf_config)
    if found is None:
        return None
    grid, flag, total = found
    return total, _describe(modality, grid, flag)


@functools.lru_cache(maxsize=64)
def _arity_of_code(code: types.CodeType) -> int:
    """Parameters of a plain function with this code object (what ``inspect.signature`` counts for it)."""
    n = code.co_argcount + code.co_kwonlyargcount
    return n + bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)


def _arity(fn: Any) -> int:
    """``len(inspect.signature(fn).parameters)``; for a plain function (vLLM's ``is_embed`` is a closure made per
    request) read from its code object, once per code object, instead of building a signature per item."""
    if type(fn) is types.FunctionType and not hasattr(fn, "__wrapped__"):
        return _arity_of_code(fn.__code__)
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 2


#: Embedding positions :func:`placeholder_embeds` counted, per (``is_embed``'s code, the content's identity, the
#: processing info), each kept with a copy of the content and of ``is_embed``'s closure values it was counted for.
#: ``is_embed`` is vLLM's ``PromptUpdateDetails.select_token_id`` / ``select_token_ids`` / ``select_text`` closure,
#: made anew per request and a pure function of its closure values and its arguments, and a server sees the same few
#: contents (one per image size and kwargs) over and over -- the very same objects, from vLLM's cache of encoded texts
#: (0.32-0.33: a list of token ids; before: a text). A hit is an entry whose copies equal the content and the closure
#: values: exact whatever happened to the object an id once named, and for the same list it compares pointers only
#: (hashing or copying its token ids would read every int of it). Only plain closure values are kept (token ids, a
#: text). The processing info (whose context holds the one tokenizer ``is_embed`` may take) is part of every key, so
#: that a hit needs neither the tokenizer nor a look at ``is_embed``'s parameters.
_EMBEDS = WeakMemo()


#: The types of a closure's values that are plain data as they are (else :func:`_plain` judges).
_PLAIN = frozenset({type(None), bool, int, str, bytes})
_INT = frozenset({int})
_CELL = operator.attrgetter("cell_contents")


def _plain(value: Any) -> Any:
    """A copy of ``value`` if it is plain data (token ids, a text), else ``TypeError``."""
    if type(value) in _PLAIN:
        return value
    if isinstance(value, (list, tuple)) and set(map(type, value)) <= _INT:
        return value[:]
    raise TypeError(type(value).__name__)


def placeholder_embeds(updates: Sequence[Any], info: Any) -> int | None:
    """Embedding positions of an item's placeholder: vLLM's own ``is_embed`` mask over the resolved content of the
    item's first prompt update (all of an item's updates carry the same content), ``int(is_embed(...).sum())`` with
    ``info.get_tokenizer()`` (vLLM's ``ProcessingInfo``) computed once per distinct content (:data:`_EMBEDS`), or the
    content's length if it has no mask."""
    for update in updates:
        content = getattr(update, "content", None)
        if content is None:
            continue
        full = getattr(content, "full", content)
        is_embed = getattr(content, "is_embed", None)
        if is_embed is None:
            return len(info.get_tokenizer().encode(full, add_special_tokens=False)) if isinstance(full, str) \
                else len(full)
        key = values = None
        if type(is_embed) is types.FunctionType:
            try:
                values = list(map(_CELL, is_embed.__closure__ or ()))  # ValueError for an empty cell
                key = (is_embed.__code__, id(full), id(info))
                kept = _EMBEDS.get(key, (info,))
            except ValueError:
                kept = None
            if kept is not None and kept[0] == full and kept[1] == values:
                return kept[2]
        tokenizer = info.get_tokenizer()
        count = int((is_embed(tokenizer, full) if _arity(is_embed) >= 2 else is_embed(full)).sum())
        if key is not None and isinstance(full, (str, list, tuple)):
            try:
                _EMBEDS.put(key, (info,), (full[:], list(map(_plain, values)), count))
            except TypeError:  # a closure value that is not plain data: not kept
                pass
        return count
    return None


def check(processor: Any, kwargs: Mapping[str, Sequence[Any]], updates: Mapping[str, Sequence[Any]],
          indices: Mapping[str, Sequence[int]] | None = None) -> None:
    """Raise :class:`PlaceholderMismatchError` for the first item whose placeholder and tensors disagree.

    Args:
        processor: the ``MiniCPMV4_6MultiModalProcessor`` (for its tokenizer and model config).
        kwargs: modality -> processed items (``MultiModalKwargsItem``; None for a cached item: skipped).
        updates: modality -> per item, its resolved prompt updates (same order as ``kwargs``).
        indices: modality -> the request-level index of each item (default: its position).
    """
    info = processor.info
    data = getattr(kwargs, "data", None)  # plain(kwargs), inline (as in _grid_and_flag)
    for modality, items in (data if type(data) is dict else kwargs).items():
        if modality not in FIELDS:
            continue
        item_updates = updates.get(modality, ())
        for pos, item in enumerate(items):
            if item is None or pos >= len(item_updates):
                continue
            found = _grid_and_flag(modality, item, None, info.get_hf_config)  # the config only without a flag
            if found is None:
                continue
            grid, flag, expected = found
            pads = placeholder_embeds(item_updates[pos], info)
            if pads is None or pads == expected:
                continue
            index = indices[modality][pos] if indices is not None else pos
            pad_text = getattr(info.get_tokenizer(), FIELDS[modality][2], None) or FIELDS[modality][3]
            raise PlaceholderMismatchError(
                f"{model_of(processor) or 'MiniCPM-V'}: {modality} item {index} of this request has {pads} "
                f"{pad_text} placeholder tokens in the prompt, but its processed pixel values give {expected} vision "
                f"embeddings ({_describe(modality, grid, flag)}). "
                "vLLM would fail inside the engine on this request (and take every request in flight with it), so "
                "it is refused; check its mm_processor_kwargs (slice_mode, max_slice_nums, scale_resolution, "
                "downsample_mode) -- vllm-minicpm-hotfix placeholder_guard"
            )


# --------------------------------------------------------------------------------------------------------------------
# The wrappers
# --------------------------------------------------------------------------------------------------------------------


def apply_hf_processor(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``BaseMultiModalProcessor._apply_hf_processor``: same result; raises :class:`PlaceholderMismatchError`
    (a ``ValueError``) where an item's counts disagree. The items and their prompt updates are read from the result
    in whichever shape this vLLM returns it (the module docstring)."""
    result = wrapped(*args, **kwargs)
    info = result
    if not hasattr(info, "prompt_updates") and isinstance(result, tuple) and len(result) >= 2:
        info = result[1]  # 0.22-0.28: (prompt_ids, MultiModalProcessingInfo, is_update_applied)
    items, updates = getattr(info, "kwargs", None), getattr(info, "prompt_updates", None)
    if items is not None and updates is not None:
        check(instance, items, updates)
    return result


def merge_mm_kwargs(wrapped: Any, instance: Any, call: Call) -> Any:
    """Around ``BaseMultiModalProcessor._merge_mm_kwargs``: checks the items the cache does not hold yet, with their
    indices in the request, *before* vLLM's cache records them; then runs vLLM's own method unchanged."""
    try:
        is_cached = call["mm_is_cached"]
        missing_kwargs = call["mm_missing_kwargs"]
        missing_updates = call["mm_missing_prompt_updates"]
    except KeyError:
        return wrapped(*call.args, **call.kwargs)
    indices = {m: [i for i, cached in enumerate(flags) if not cached] for m, flags in is_cached.items()}
    check(instance, missing_kwargs, missing_updates,
          indices={m: indices.get(m, range(len(v))) for m, v in missing_kwargs.items()})
    return wrapped(*call.args, **call.kwargs)


PATCHES = {
    f"{PROCESSOR_CLASS}._apply_hf_processor": wrap(apply_hf_processor),
    f"{PROCESSOR_CLASS}._merge_mm_kwargs": wrap(merge_mm_kwargs, bind=True),
}


# --------------------------------------------------------------------------------------------------------------------
# The probe
# --------------------------------------------------------------------------------------------------------------------

_PAD, _START, _END, _TEXT = 7, 5, 6, 1


class _StandInTokenizer:
    """Enough of a tokenizer for vLLM's token-id prompt-update path (never asked to encode text here)."""

    image_token = "<|image_pad|>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:  # pragma: no cover - not reached
        raise RuntimeError("the probe uses token ids only")

    def decode(self, ids: Iterable[int], **_: Any) -> str:  # pragma: no cover - not reached
        raise RuntimeError("the probe uses token ids only")


class _StandInInfo:
    def __init__(self, hf_config: Any) -> None:
        self._hf_config = hf_config
        self._tokenizer = _StandInTokenizer()

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def get_hf_config(self) -> Any:
        return self._hf_config


class _Counts:
    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts

    def get_all_counts(self) -> dict[str, int]:
        return dict(self._counts)


def _items(h: int, w: int) -> Any:
    """vLLM's ``MultiModalKwargsItems`` for one image of one ``h x w``-patch slice, 16x (``(h//4) * (w//4)``
    embeddings), built by vLLM's own ``from_hf_inputs``."""
    import torch
    from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems

    hf_inputs = {
        "pixel_values": [torch.zeros(1, 3, 14, 14 * h * w)],
        "tgt_sizes": [torch.tensor([[h, w]])],
        "use_vit_merger": [torch.tensor([True])],
    }
    fields = {k: MultiModalFieldConfig.batched("image") for k in hf_inputs}
    return MultiModalKwargsItems.from_hf_inputs(hf_inputs, fields)


def _probe_request(module: ModuleType) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """A stand-in 4.6 processor and the arguments of its ``_merge_mm_kwargs`` and ``_maybe_apply_prompt_updates``
    for a one-image request whose placeholder has 2 pads while its tensors (one 4x4-patch slice, 16x) give 1
    embedding. The cache is vLLM's own, empty (:func:`._stand_ins.processor_cache`). The second call's
    ``mm_kwargs`` / ``mm_prompt_updates`` are filled in from the first's result."""
    import types

    from vllm.multimodal.processing import processor as processing

    from . import _stand_ins

    cls = getattr(module, PROCESSOR_CLASS)
    proc = object.__new__(cls)
    proc.info = _StandInInfo(types.SimpleNamespace(downsample_mode="16x", insert_layer_id=0))
    # MiniCPM-V's override renumbers <image_id> by decoding text with the real tokenizer: not what is judged here.
    proc._recompute_cached_prompt_update = lambda update, item_idx: update
    content = processing.PromptUpdateDetails.select_token_id([_START, _PAD, _PAD, _END], _PAD)
    replacement = processing.PromptReplacement(modality="image", target=[_PAD], replacement=content)
    updates = cls._bind_and_group_updates(proc, [replacement], {"image": 1})
    merge_args = dict(cache=_stand_ins.processor_cache(), mm_hashes={"image": ["probe"]},
                      mm_is_cached={"image": [False]}, mm_missing_kwargs=_items(4, 4),
                      mm_missing_prompt_updates=updates)
    prompt = [_TEXT, _PAD, _TEXT]
    params = inspect.signature(cls._maybe_apply_prompt_updates).parameters
    args: dict[str, Any] = {"mm_items": _Counts({"image": 1})}
    if "mm_res" in params:  # 0.32+: one MultiModalProcessingResult
        result_cls = processing.MultiModalProcessingResult  # a NamedTuple in 0.32-0.34
        names = set(getattr(result_cls, "_fields", ())) or set(inspect.signature(result_cls).parameters)
        values = {"prompt_ids": prompt, "kwargs": None, "hashes": {"image": ["probe"]}, "prompt_updates": None}
        args["mm_res"] = (result_cls, {k: v for k, v in values.items() if k in names})
    else:
        args.update(prompt_ids=prompt, mm_kwargs=None, mm_prompt_updates=None)
        if "is_update_applied" in params:  # 0.22-0.28
            args["is_update_applied"] = False
    unknown = set(params) - {"self", *args}
    if unknown:
        raise TypeError(f"_maybe_apply_prompt_updates takes parameters the probe does not know: {sorted(unknown)}")
    return proc, merge_args, args


def _guard_works(proc: Any, merge_args: Mapping[str, Any]) -> str | None:
    """Where vLLM's own path could not be run: whether the guard's own :func:`check` works on this vLLM's items and
    resolved prompt updates -- it refuses the probe's 2-pads / 1-embedding item with its error and passes the same
    placeholder for an item whose tensors (one 8x4-patch slice) give 2. Returns None if it does, else what went
    wrong."""
    updates = merge_args["mm_missing_prompt_updates"]
    try:
        check(proc, merge_args["mm_missing_kwargs"], updates)
    except PlaceholderMismatchError:
        pass
    except Exception as exc:  # noqa: BLE001
        return f"its check raised {type(exc).__name__}: {exc}"
    else:
        return "its check let the 2-pads / 1-embedding item through"
    try:
        check(proc, _items(8, 4), updates)
    except Exception as exc:  # noqa: BLE001
        return f"its check refused an item whose counts agree ({type(exc).__name__}: {exc})"
    return None


def _undetermined(why: str, proc: Any = None, merge_args: Mapping[str, Any] | None = None) -> Verdict:
    """``UNDETERMINED``: vLLM's own path could not be judged. A guard only refuses a request the engine would die on,
    so where its own check is shown to work on this vLLM's objects (:func:`_guard_works`) it is applied anyway
    (``guard=True``: ``auto`` applies it) rather than leaving the user without the protection."""
    failed = "the probe's request could not be built" if proc is None else _guard_works(proc, merge_args or {})
    if failed is None:
        return Verdict(State.UNDETERMINED, f"{why}; the guard's own check works on this vLLM's items (it refuses a "
                                           "2-pads / 1-embedding image and passes a 2 / 2 one), so it is applied: it "
                                           "refuses only what the engine would die on", guard=True)
    return Verdict(State.UNDETERMINED, f"{why}; the guard is not applied ({failed}): a placeholder mismatch kills "
                                       f"the engine here")


def probe(module: ModuleType) -> Verdict:
    """Does the 4.6 processor, as its classes now stand, refuse a request whose placeholder count disagrees with its
    tensors?

    Runs ``_merge_mm_kwargs`` (where the processed items of a request meet its resolved prompt updates on their way
    to the cache; the guard's hook) and then ``_maybe_apply_prompt_updates`` (where vLLM validates items against
    placeholders) on a stand-in for the 2-pads / 1-embedding request. Returns ``BROKEN`` if both let it through (stock
    vLLM 0.22-0.33), ``CORRECT`` if either raises a ``ValueError`` (vLLM validating itself, or the guard applied),
    ``UNRECOGNISED`` if the 4.6 processor or the hooked methods are not there, ``UNDETERMINED`` if the stand-in
    request cannot be built or something else is raised. Never raises; leaves ``module`` unchanged.
    """
    cls = getattr(module, PROCESSOR_CLASS, None)
    missing = [a for a in ("_apply_hf_processor", "_merge_mm_kwargs", "_maybe_apply_prompt_updates",
                           "_bind_and_group_updates") if not callable(getattr(cls, a, None))]
    if not isinstance(cls, type) or missing:
        return Verdict(State.UNRECOGNISED, f"{module.__name__}.{PROCESSOR_CLASS} lacks {missing or 'itself'}",
                       applicable=False)
    try:
        proc, merge_args, args = _probe_request(module)
    except Exception as exc:  # noqa: BLE001 - an unknown layout of vLLM's processing classes
        return _undetermined(f"probe could not be set up: {type(exc).__name__}: {exc}")
    stage = "_merge_mm_kwargs"
    try:
        mm_kwargs, mm_updates = cls._merge_mm_kwargs(proc, **merge_args)
        stage = "_maybe_apply_prompt_updates"
        if "mm_res" in args:
            result_cls, values = args["mm_res"]
            args["mm_res"] = result_cls(**{**values, "kwargs": mm_kwargs, "prompt_updates": mm_updates})
        else:
            args.update(mm_kwargs=mm_kwargs, mm_prompt_updates=mm_updates)
        _, placeholders = cls._maybe_apply_prompt_updates(proc, **args)
    except ValueError as exc:  # refusing the request is what a correct processor does (HTTP 400)
        return Verdict(State.CORRECT, f"a placeholder whose count disagrees with its item's tensors is refused "
                                      f"before the engine ({stage}: {exc})")
    except Exception as exc:  # noqa: BLE001
        return _undetermined(f"probe failed in {stage}: {type(exc).__name__}: {exc}", proc, merge_args)
    try:
        (ph,) = placeholders["image"]
        n = int(ph.is_embed.sum()) if getattr(ph, "is_embed", None) is not None else int(ph.length)
    except Exception as exc:  # noqa: BLE001
        return _undetermined(f"vLLM's placeholders not readable: {type(exc).__name__}: {exc}", proc, merge_args)
    return Verdict(State.BROKEN, f"vLLM's processor lets an image placeholder of {n} pads through for an item whose "
                                 "tensors give 1 vision embedding (the engine would die on it)")
