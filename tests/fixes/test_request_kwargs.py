"""fixes/request_kwargs: a request's MiniCPM-V ``mm_processor_kwargs`` are checked, and its items budgeted, before any
pixel work -- on vLLM's real multimodal processor for the bundled tiny checkpoint (``MULTIMODAL_REGISTRY.
create_processor``, its ``apply`` as vLLM's renderer calls it), no engine.

References, none of them the fix's own output:

* **refused kwargs**: each is one transformers' own processor (``AutoProcessor`` of the checkpoint) fails on here, or
  whose value is not of the type transformers' ``MiniCPMV4_6ImageProcessorKwargs`` declares, or that makes it
  reduce the source image and every slice to one vision token each (a 56x56-pixel thumbnail), or (geometry keys) different pixel values than the model was
  built with, or beyond vLLM's own numbers (``get_image_max_slice_num()``, ``max_model_len``);
* **stock** vLLM takes each of them on to the pixel work (``_call_hf_processor`` is called), the hotfix never does;
* **accepted** kwargs give the ``<|image_pad|>`` count transformers' processor gives for them;
* **the budget arithmetic** (tokens, pixels of an item, nothing resized) equals the pads and the pixel values
  transformers' processor really produces.
"""

from __future__ import annotations

import contextlib
import typing

import numpy as np
import pytest
from support.hotfix import hotfix
from support.paths import TINY
from support.processor import vllm_process

from vllm_minicpm_hotfix.fixes import _mm_prompt as mp
from vllm_minicpm_hotfix.fixes import request_kwargs as fix

SIZE = (640, 480)  # (w, h)
#: The fixes a request needs before stock vLLM reaches its processor at all (transformers 5.24's required
#: downsample_mode; 0.23.0's processor build).
PREREQUISITES = ("processor_downsample_mode", "hf_processor_version")

#: (request kwargs, kind): what the hotfix refuses, and why (see the module docstring).
REFUSED = [
    ({"slice_mode": "false"}, "type"),
    ({"slice_mode": 0}, "type"),
    ({"slice_mode": None}, "type"),
    ({"max_slice_nums": None}, "type"),
    ({"max_slice_nums": "9"}, "type"),
    ({"max_slice_nums": 9.5}, "type"),
    ({"max_slice_nums": True}, "type"),
    ({"max_slice_nums": {"n": 1}}, "type"),
    ({"use_image_id": "no"}, "type"),
    ({"downsample_mode": 4}, "type"),
    ({"scale_resolution": 0}, "small"),
    ({"scale_resolution": -448}, "small"),
    ({"scale_resolution": 1}, "small"),
    ({"scale_resolution": 13}, "small"),
    ({"scale_resolution": 55}, "small"),
    ({"max_slice_nums": 0}, "small"),
    ({"max_slice_nums": -1}, "small"),
    ({"downsample_mode": "2x"}, "value"),
    ({"max_slice_nums": 1000}, "large"),
    ({"scale_resolution": 100000}, "large"),
    ({"patch_size": 0}, "fixed"),
    ({"patch_size": 1}, "fixed"),
    ({"patch_size": 7}, "fixed"),
    ({"do_resize": False}, "fixed"),
    ({"image_mean": []}, "fixed"),
    ({"image_std": [1.0, 1.0, 1.0]}, "fixed"),
    ({"do_normalize": False}, "fixed"),
    ({"return_tensors": "np"}, "fixed"),
    ({"images_kwargs": 3}, "type"),
]
ACCEPTED = [
    {},
    {"slice_mode": False},
    {"scale_resolution": 56},
    {"scale_resolution": 224, "slice_mode": False},
    {"max_slice_nums": 1},
    {"max_slice_nums": 9},
    {"downsample_mode": "4x"},
    {"use_image_id": False},
    {"max_slice_nums": 2, "scale_resolution": 336, "downsample_mode": "4x", "use_image_id": False},
]


def _id(kw: dict) -> str:
    return ",".join(f"{k}={v!r}" for k, v in kw.items()) or "none"


def image(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed * 7919 + width * 31 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def hf_proc():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(TINY))


def make_processor(**model_kwargs):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    mc = ModelConfig(model=str(TINY), dtype="float32", enforce_eager=True, **model_kwargs)
    return MULTIMODAL_REGISTRY.create_processor(mc)


@pytest.fixture(scope="module")
def vproc():
    return make_processor()


#: Where vLLM hands a request's items to transformers: ``_call_hf_processor`` (transformers' processor on prompt and
#: items, where the release has it) and MiniCPM-V's ``process_mm_inputs`` (every release; 0.30+ calls the image
#: processor from there directly).
PIXEL_WORK = ("_call_hf_processor", "process_mm_inputs")


@contextlib.contextmanager
def pixel_work_counter(proc):
    """Counts calls of the processor's :data:`PIXEL_WORK` methods."""
    calls = []

    def counted(original):
        def call(*args, **kwargs):
            calls.append(original.__name__)
            return original(*args, **kwargs)

        return call

    present = [name for name in PIXEL_WORK if callable(getattr(proc, name, None))]
    assert present, f"vLLM's processor has none of {PIXEL_WORK}"
    for name in present:
        setattr(proc, name, counted(getattr(proc, name)))
    try:
        yield calls
    finally:
        for name in present:
            delattr(proc, name)


#: vLLM's own multimodal processing of one image prompt (``processor.apply``, as its renderer calls it).
vllm_apply = vllm_process


def pads(proc, out) -> int:
    tok = proc.info.get_tokenizer()
    pad = tok.convert_tokens_to_ids(tok.image_token)
    return sum(1 for t in out["prompt_token_ids"] if t == pad)


def hf_run(hf_proc, img, kwargs: dict):
    """transformers' processor on one image: ``(pads, pixel_values)`` or the exception it raises."""
    try:
        out = hf_proc(text=[hf_proc.image_token], images=[img], **kwargs)
    except Exception as exc:  # noqa: BLE001 - the reference outcome
        return exc
    return int((out["input_ids"] == hf_proc.image_token_id).sum()), out["pixel_values"]


def _flat(x):
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, np.ndarray):
        return [x]
    return [t for y in x for t in _flat(y)]


def declared_type_ok(key: str, value) -> bool:
    """Whether ``value`` is of the type transformers' installed ``MiniCPMV4_6ImageProcessorKwargs`` declares for
    ``key`` (``bool`` is not an ``int``, as transformers' own validator says)."""
    from transformers.models.minicpmv4_6 import image_processing_minicpmv4_6 as ipm

    want = typing.get_type_hints(ipm.MiniCPMV4_6ImageProcessorKwargs)[key]
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)


# --------------------------------------------------------------------------------------------------------------------
# Refused: the reference says the value is bad; stock reaches the pixel work; the hotfix refuses first
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "kind"), REFUSED, ids=[_id(k) for k, _ in REFUSED])
def test_refused_values_are_bad(vproc, hf_proc, kwargs, kind):
    """The independent reason each refused value is bad, on this environment's transformers and vLLM."""
    ((key, value),) = kwargs.items()
    img = image(*SIZE)
    got = hf_run(hf_proc, img, kwargs)
    own = hf_run(hf_proc, img, {})
    print(f"\ntransformers on {kwargs}: {got if isinstance(got, Exception) else f'{got[0]} pads'}")
    if isinstance(got, Exception):
        return  # transformers' own processor fails on it
    if kind == "type":
        if key in fix.SCOPES:
            assert not isinstance(value, dict)
        else:
            assert not declared_type_ok(key, value), f"{kwargs}: transformers declares and accepts it"
    elif kind == "small":
        parts = 1 + int(hf_proc.image_processor.max_slice_nums)  # the source and at most that many slices
        assert got[0] <= parts or value < 1, f"{kwargs}: {got[0]} vision tokens is not one per part"
    elif kind == "value":
        assert got[0] == own[0], "an unknown downsample_mode is silently taken as 16x"
    elif kind == "large":
        limit = vproc.info.get_image_max_slice_num() if key == "max_slice_nums" else None
        if limit is not None:
            assert value > limit
        else:  # one unsliced slice of that side alone: (side / 56)**2 tokens, far beyond max_model_len
            assert (value // 56) ** 2 > vproc.info.ctx.model_config.max_model_len
    elif key == "return_tensors":  # vLLM's processor moves torch tensors (``.to``): other arrays fail there
        assert {type(t) for t in _flat(got[1])} != {type(t) for t in _flat(own[1])}
    else:  # fixed: the model was built with other pixel values
        new = np.concatenate([np.asarray(t, dtype=np.float32).ravel() for t in _flat(got[1])])
        ref = np.concatenate([np.asarray(t, dtype=np.float32).ravel() for t in _flat(own[1])])
        assert new.shape != ref.shape or not np.array_equal(new, ref), f"{kwargs}: same pixels as the model's"


@pytest.mark.parametrize(("kwargs", "kind"), REFUSED, ids=[_id(k) for k, _ in REFUSED])
def test_stock_reaches_the_pixel_work(m46, vproc, kwargs, kind):
    with hotfix(m46, "auto", fixes=PREREQUISITES), pixel_work_counter(vproc) as calls:
        try:
            vllm_apply(vproc, image(*SIZE), kwargs)
            outcome = "accepted"
        except Exception as exc:  # noqa: BLE001 - what stock does with it
            assert not isinstance(exc, fix.RequestKwargsError)
            outcome = f"{type(exc).__name__}: {str(exc)[:120]}"
    print(f"\nstock vLLM on {kwargs}: {outcome}")
    assert calls, "stock vLLM refused it before the pixel work"


@pytest.mark.parametrize(("kwargs", "kind"), REFUSED, ids=[_id(k) for k, _ in REFUSED])
def test_hotfix_refuses_before_the_pixel_work(m46, vproc, kwargs, kind):
    ((key, value),) = kwargs.items()
    with hotfix(m46, "auto", fixes=None) as st, pixel_work_counter(vproc) as calls:
        assert st[fix.NAME].applied
        with pytest.raises(fix.RequestKwargsError) as info:
            vllm_apply(vproc, image(*SIZE), kwargs)
    msg = str(info.value)
    print(f"\n{msg}")
    assert not calls
    assert isinstance(info.value, ValueError)  # vllm serve: HTTP 400 on every release
    assert f"mm_processor_kwargs.{key} = {value!r}" in msg
    assert msg.startswith("MiniCPM-V 4.6: ")
    assert "must be" in msg or "fixed by the model" in msg


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=[_id(k) for k in ACCEPTED])
def test_accepted_values_match_transformers(m46, vproc, hf_proc, kwargs):
    img = image(*SIZE)
    want = hf_run(hf_proc, img, kwargs)
    assert not isinstance(want, Exception), want
    with hotfix(m46, "auto", fixes=None):
        got = pads(vproc, vllm_apply(vproc, img, kwargs))
    assert got == want[0], (kwargs, got, want[0])
    if kwargs.get("scale_resolution") == 56:
        assert got >= 1


# --------------------------------------------------------------------------------------------------------------------
# The budget
# --------------------------------------------------------------------------------------------------------------------

BUDGET_SIZES = [(640, 480), (1, 1), (448, 448), (449, 448), (300, 900), (2000, 120), (1500, 1500)]
BUDGET_KWARGS = [{}, {"slice_mode": False}, {"downsample_mode": "4x"}, {"max_slice_nums": 2},
                 {"scale_resolution": 224}, {"scale_resolution": 56, "max_slice_nums": 4}]


@pytest.mark.parametrize("kwargs", BUDGET_KWARGS, ids=[_id(k) for k in BUDGET_KWARGS])
def test_budget_arithmetic_matches_transformers(hf_proc, kwargs):
    """Tokens and pixels of an item computed from its size alone equal the pads and the pixel values transformers'
    processor produces for it."""
    ip = hf_proc.image_processor
    eff = mp.effective_kwargs(ip, kwargs, {})
    for w, h in BUDGET_SIZES:
        img = image(w, h)
        want_pads, pixel_values = hf_run(hf_proc, img, kwargs)
        want_pixels = sum(int(t.numel()) for t in _flat(pixel_values)) // 3
        assert fix.tokens_and_pixels(ip, h, w, eff) == (want_pads, want_pixels), (w, h, kwargs)


def test_item_over_max_model_len_is_refused(m46, hf_proc):
    """An item whose kwargs make it more vision tokens than max_model_len: stock vLLM resizes it (and refuses the
    prompt only afterwards); the hotfix refuses it first, naming the tokens, the limit and what fits."""
    proc = make_processor(max_model_len=512)
    kwargs = {"scale_resolution": 1000, "max_slice_nums": 9}
    img = image(2000, 2000)
    want = hf_run(hf_proc, img, kwargs)
    assert want[0] > 512, want[0]  # transformers' own count: more than the prompt may hold
    with hotfix(m46, "auto", fixes=PREREQUISITES), pixel_work_counter(proc) as calls:
        vllm_apply(proc, img, kwargs)
    assert calls
    with hotfix(m46, "auto", fixes=None), pixel_work_counter(proc) as calls:
        with pytest.raises(fix.RequestKwargsError) as info:
            vllm_apply(proc, img, kwargs)
    msg = str(info.value)
    print(f"\n{msg}")
    assert not calls
    assert f"would produce {want[0]} vision tokens" in msg
    assert "at most 512 tokens (max_model_len 512)" in msg
    assert "max_slice_nums" in msg


def test_encoder_cache_size_is_the_limit(m46):
    """vLLM's own compute_mm_encoder_budget, wrapped, records the encoder cache size; the item limit follows it."""
    from vllm.multimodal import encoder_budget

    proc = make_processor(max_model_len=4096)
    with hotfix(m46, "auto", fixes=None):
        saved = list(fix.ENCODER_CACHE_SIZE)
        try:
            sched = type("Sched", (), {"disable_chunked_mm_input": False, "max_num_batched_tokens": 1000,
                                       "encoder_cache_size": 1000, "max_num_encoder_input_tokens": 1000})()
            result = encoder_budget.compute_mm_encoder_budget(sched, {"image": 300})
            assert fix.ENCODER_CACHE_SIZE == [result[1]]
            assert fix.item_limit(proc)["tokens"] == min(result[1], 4096)
        finally:
            fix.ENCODER_CACHE_SIZE[:] = saved


@pytest.mark.placed("0.23.0", "0.33.0")
def test_encoder_budget_recorder_is_set_when_vllm_imports_it():
    """In a fresh vLLM process the hook leaves ``vllm.multimodal.encoder_budget`` to vLLM (importing it pulls in the
    v1 request and structured-output stack, ~0.5 s of CPU), and the recorder is on its ``compute_mm_encoder_budget``
    once vLLM imports it: the budget is vLLM's own function's (``encoder_cache_manager``, untouched) and the recorded
    cache size is its second value."""
    import os

    from support.paths import REPO
    from support.programs import run_reporting

    env = {**os.environ, "PYTHONPATH": "", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_MINICPM_HOTFIX", None)
    out, _ = run_reporting("budget_child", REPO, env=env, timeout=600)
    print(f"\n{out}")
    assert out["applied"] is True
    assert out["imported_by_hook"] is False
    assert out["patched_by"] == fix.NAME
    assert out["result"] == out["reference"]
    assert out["recorded"] == [out["reference"][1]]


# --------------------------------------------------------------------------------------------------------------------
# Model-level kwargs, the processor cache
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_kwargs", [{"patch_size": 7}, {"scale_resolution": 13}, {"slice_mode": "false"}],
                         ids=_id)
def test_model_level_kwargs_refused(m46, model_kwargs):
    ((key, value),) = model_kwargs.items()
    proc = make_processor(mm_processor_kwargs=model_kwargs)
    with hotfix(m46, "auto", fixes=None), pixel_work_counter(proc) as calls:
        with pytest.raises(fix.RequestKwargsError) as info:
            vllm_apply(proc, image(*SIZE), {})
    print(f"\n{info.value}")
    assert not calls
    assert f"--mm-processor-kwargs.{key} = {value!r}" in str(info.value)


def test_model_level_kwargs_refused_when_the_processor_is_built(m46):
    """vLLM's start-up asks the processing info for its token counts (``MultiModalBudget``) before any ``apply``: the
    model-level kwargs are refused when vLLM builds the processor, every refused key in one error. Stock vLLM (with
    the prerequisites) builds it and refuses nothing: its token count fails or answers, naming none of the keys."""
    from support import hostile_cases

    bad = hostile_cases.model_level_bad()
    with hotfix(m46, "auto", fixes=PREREQUISITES):
        proc = make_processor(mm_processor_kwargs=bad)
        try:
            stock = proc.info.get_mm_max_tokens_per_item(seq_len=1024, mm_counts={"image": 1, "video": 0})
        except Exception as exc:  # noqa: BLE001 - what stock does with them, shown
            stock = exc
    print(f"\nstock: processor built; token count: {stock!r}")
    assert not any(f"{key}" in str(stock) for key in bad), stock
    with hotfix(m46, "auto", fixes=None):
        with pytest.raises(fix.RequestKwargsError) as info:
            make_processor(mm_processor_kwargs=bad)
    message = str(info.value)
    print(f"hotfix: {message}")
    assert message.startswith(f"MiniCPM-V 4.6: {len(bad)} of --mm-processor-kwargs are refused: ")
    for key, (value, allowed) in hostile_cases.MODEL_LEVEL_BAD.items():
        assert f"--mm-processor-kwargs.{key} = {value!r}" in message, key
        assert allowed in message, key
    assert "\n" not in message


def test_refusal_leaves_the_processor_cache(m46):
    """A refused request leaves vLLM's processor cache as it was: the same image, valid next, gives what a processor
    that never saw the refused request gives."""
    from support.prompt import make_pair, vllm_ids

    img = image(*SIZE, seed=3)
    with hotfix(m46, "auto", fixes=None):
        fresh = vllm_ids(make_pair(TINY, {}, cache=True), "image", [img], {"max_slice_nums": 2})
        pair = make_pair(TINY, {}, cache=True)
        for bad in ({"max_slice_nums": "2"}, {"scale_resolution": 13}, {"patch_size": 7}):
            with pytest.raises(fix.RequestKwargsError):
                vllm_ids(pair, "image", [img], bad)
        assert vllm_ids(pair, "image", [img], {"max_slice_nums": 2}) == fresh
        assert vllm_ids(pair, "image", [img], {"max_slice_nums": 2}) == fresh  # now from the cache
