"""The path one request takes through the fixes, as ``vllm_minicpm_hotfix.fixes`` writes it down
(``REQUEST_PATH``, ``REQUEST_LOOKUPS``, the package docstring), and the order of two fixes on one attribute.

A real request: vLLM's own multimodal processor for the bundled tiny checkpoint
(``MULTIMODAL_REGISTRY.create_processor``), its ``apply`` as vLLM's renderer calls it, with every fix applied as under
``VLLM_MINICPM_HOTFIX=force``. ``sys.setprofile`` records which fix wrappers are entered and in what order (the
wrappers' code objects, found by walking each patched attribute's chain of values): nothing is wrapped or replaced
to observe them. The reference is the installed vLLM's own call order; the written path must match it, and a
wrapper entered during a request that the path does not name fails the test, so the path cannot fall behind the
code. A fix's wrapper is its behaviour (the function ``PATCHES`` names, which the framework's built function runs for
the instances the fix covers). Cheap (no engine): every environment.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
from support.hotfix import hotfix
from support.paths import TINY
from PIL import Image

from vllm_minicpm_hotfix import record
from vllm_minicpm_hotfix import fixes
from vllm_minicpm_hotfix.fixes import REGISTRY, REQUEST_LOOKUPS, REQUEST_PATH, _base

#: The attributes two fixes set, and the order they wrap in (registry order: the first wraps vLLM's own method).
CHAINS = {
    "MiniCPMV4_6ForConditionalGeneration.load_weights": ("qkv_loader", "qkv_completeness_guard"),
    "MiniCPMV4_6MultiModalProcessor.process_mm_inputs": ("mm_placeholders", "encoder_modes"),
}


def _fix_values(value):
    """``value`` and each value it wraps (``__wrapped__``, set by ``functools.wraps``) while a fix marked it,
    outermost first, as ``(fix NAME, value)``; then ``(None, the first unmarked value)`` (vLLM's own)."""
    while isinstance(getattr(value, _base.MARKER_ATTR, None), str):
        yield getattr(value, _base.MARKER_ATTR), value
        value = getattr(value, "__wrapped__", None)
    yield None, value


def _chain(value):
    """The fix NAMEs marked along ``value``'s chain, outermost first, and the first unmarked value (vLLM's own)."""
    *marked, (_, innermost) = _fix_values(value)
    return [name for name, _ in marked], innermost


def _wrapper_codes(m46) -> dict:
    """Code object -> (target, fix NAME) of every fix wrapper now set on the model module's classes."""
    codes = {}
    for fix in REGISTRY:
        for target in fix.SETS:
            found = _base.resolve(m46, target, imported_only=True)
            if found is None:
                continue
            value = vars(found[0]).get(found[1]) if isinstance(found[0], type) else getattr(*found, None)
            for name, wrapper in _fix_values(value):
                behaviour = getattr(wrapper, _base.BEHAVIOUR_ATTR, wrapper)
                behaviour = getattr(behaviour, "func", behaviour)  # a functools.partial's function
                code = getattr(getattr(behaviour, "__func__", behaviour), "__code__", None)
                if name is not None and code is not None:
                    codes.setdefault(code, (target, name))
    return codes


def _request(proc, modality: str):
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tok = proc.info.get_tokenizer()
    if modality == "image":
        items, pad = {"image": [Image.new("RGB", (300, 200), (120, 30, 200))]}, tok.image_token
    else:
        items, pad = {"video": [np.full((4, 200, 300, 3), 90, dtype=np.uint8)]}, tok.video_token
    prompt = tok.encode(f"<|im_start|>user\n{pad}Describe it.<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)
    fields = {f.name for f in dataclasses.fields(ProcessorInputs)}
    kwargs = dict(prompt=prompt, mm_data_items=proc.info.parse_mm_data(items), hf_processor_mm_kwargs={})
    if "tokenization_kwargs" in fields:
        kwargs["tokenization_kwargs"] = {}
    return ProcessorInputs(**kwargs), TimingContext(enabled=False)


@pytest.mark.parametrize("modality", ["image", "video"])
def test_a_request_enters_the_wrappers_in_the_written_order(m46, modality):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    with hotfix(m46, "force", None):
        applied = {n for n, e in record.current().fixes.items() if e.applied}
        proc = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(TINY), dtype="float32",
                                                                enforce_eager=True, max_model_len=4096))
        inputs, timing = _request(proc, modality)
        codes = _wrapper_codes(m46)
        entered: list[tuple[str, str]] = []

        def profile(frame, event, arg):
            if event == "call" and frame.f_code in codes and codes[frame.f_code] not in entered:
                entered.append(codes[frame.f_code])

        sys.setprofile(profile)
        try:
            proc.apply(inputs, timing)
        finally:
            sys.setprofile(None)
    path = [(t, f) for t, f, when in REQUEST_PATH if f in applied and when in ("always", modality)]
    lookups = {(t, f) for t, f in REQUEST_LOOKUPS if f in applied}
    assert len(path) >= 5, (applied, path)  # the path's main steps are applied everywhere under force
    assert [e for e in entered if e in set(path)] == path, entered
    assert not [e for e in entered if e not in set(path) | lookups], f"wrappers the written path does not name: {entered}"
    hf_lookup = ("MiniCPMV4_6ProcessingInfo.get_hf_processor", "hf_processor_version")
    assert hf_lookup not in lookups or hf_lookup in entered, entered


def test_two_fixes_on_one_attribute_wrap_in_registry_order(m46):
    """``fixes.shared_targets`` (from the fixes' SETS) names exactly the chains written down; with every fix applied,
    each chain of values is the registry order (later fix outside) ending in vLLM's own method, and ``status()`` says
    which fix wraps which."""
    assert fixes.shared_targets() == CHAINS
    stock = {t: getattr(*_base.resolve(m46, t)) for t in CHAINS}  # vLLM's own, inherited or not
    with hotfix(m46, "force", None):
        statuses = record.current().fixes
        formed = 0
        for target, names in CHAINS.items():
            owner, attr = _base.resolve(m46, target)
            marks, innermost = _chain(vars(owner)[attr])
            on = [n for n in names if statuses[n].applied]
            assert marks == on[::-1], (target, marks, on)
            assert innermost is stock[target], target
            for inner, outer in zip(on, on[1:]):
                assert statuses[outer].wraps == {target: inner}, (outer, statuses[outer].wraps)
                formed += 1
            if len(on) == 1:
                assert target not in statuses[on[0]].wraps
        assert formed >= 1, "no chain formed under force: the order is not shown here"
