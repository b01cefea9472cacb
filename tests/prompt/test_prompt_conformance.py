"""The prompt side: the token ids vLLM's own multimodal processor builds for MiniCPM-V 4.6 images and videos
equal, token for token, those transformers' ``MiniCPMV4_6Processor`` builds for the same items and kwargs.

Everything runs the real code of the installed release: vLLM's ``MiniCPMV4_6MultiModalProcessor`` from
``MULTIMODAL_REGISTRY.create_processor(ModelConfig(..., mm_processor_kwargs=MODEL_KWARGS))`` (its ``apply``: pixel
values, prompt updates, processor cache; model-level kwargs as ``--mm-processor-kwargs`` sets them, per-request
ones as a request's ``mm_processor_kwargs``) on a tokenizer-equipped checkpoint written by transformers. The
reference is ``AutoProcessor.from_pretrained`` of the same folder called with the same prompt, items and the
*effective* kwargs (model-level overridden by the request's). (transformers 5.24 built with a model-level
``use_image_id=False`` ignores a call's ``use_image_id=True``; 5.19 honours it, as the effective kwargs do.)
Two processor geometries: the bundled tiny checkpoint (patch 14, ``scale_resolution`` 112) and a copy with the real
checkpoint's (patch 14, ``scale_resolution`` 448, ``max_slice_nums`` 9) written by this module. MiniCPM-V 4.7 joins
the same tests (parameter ``real47``) where vLLM and transformers have it (0.32.0, 0.33.0): a tiny 4.7 checkpoint
written by transformers' own 4.7 classes with the real geometry, vLLM's ``MiniCPMV4_7MultiModalProcessor`` against
transformers' ``MiniCPMV4_7Processor`` (stock: :data:`STOCK_V47`).

* With the hotfix (every fix, ``auto``): equal for >= 40 seeded image sizes x both geometries, every per-request kwarg
  (``max_slice_nums``, ``slice_mode``, ``scale_resolution``, ``downsample_mode``, ``use_image_id``), model-level
  kwargs, videos of 1 and 3 frames and two items per prompt (items served from vLLM's processor cache:
  tests/fixes/test_video_image_id_cache.py).
* Stock (the placeholder fixes off; only what a request needs to get that far -- ``processor_downsample_mode`` and
  ``hf_processor_version`` where their probes ask for them): :data:`STOCK` pins, per release, how each case of
  :data:`STOCK_CASES` differs (``pads``: another number of ``<|image_pad|>``/``<|video_pad|>`` -- the engine crashes
  on such a prompt; ``layout``: same pads, rows of slices differ; ``text``: same pads and rows, other text differs
  (``<image_id>``); ``equal``; or the exception raised). A release that changes behaviour fails here.
* The probes' verdicts per release (tests/support/expected.py) and the sub-defects the mm_placeholders probe names
  (:data:`PROBE_BROKEN`), and ``status()``/``is_patched`` agreeing with them under auto, force and off.

Placement: every environment (cheap: no engine; ~9 s of CPU after ``import vllm``, one vLLM processor per checkpoint
x model-level kwargs, shared by the module, and one of its own for each stock run's cached-video case).

Sizes avoid 1 and 3 pixel sides (transformers then guesses the channel axis of the array it makes from the image).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import vllm_minicpm_hotfix
from support import expected as table
from support.hotfix import hotfix
from support.placement import vllm_release
from vllm_minicpm_hotfix.fixes import _base, by_name
from support.prompt import (  # noqa: F401 - fixtures
    Pair, vllm_ids, hf_ids, checkpoints, family_of, MINE, PROBE_BROKEN, PROBE_BROKEN_EXTRA, STOCK_CASES, STOCK, STOCK_V47, STOCK_EXTRA,
    REAL47, REQUEST_KWARGS, MODEL_KWARGS, seeded_sizes, image, video, sizes_for, classify, summary, compare,
    assert_all_equal, family, pairs, _one_torch_thread, _report_times, timed, with_hotfix, stock, cached_prompts,
    make_pair,
)


# --------------------------------------------------------------------------------------------------------------------
# With the hotfix: equal everywhere
# --------------------------------------------------------------------------------------------------------------------


def test_seeded_sizes():
    sizes = seeded_sizes()
    assert len(sizes) >= 40
    assert {k for k, _, _ in sizes} == {"square", "wide", "tall", "tiny", "large", "ordinary"}
    assert any(w * h > 448 * 448 for _, w, h in sizes) and any(max(w, h) < 41 for _, w, h in sizes)
    assert all(w > h for k, w, h in sizes if k == "wide") and all(h > w for k, w, h in sizes if k == "tall")
    assert seeded_sizes() == sizes  # the same on every run and release


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_images_default_kwargs(m46, pairs, ckpt):
    """>= 40 seeded sizes, the checkpoint's own processor config."""
    pair = pairs(ckpt)
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes_for(ckpt)]
    with timed(f"images-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_images_request_kwargs(m46, pairs, ckpt):
    """Every per-request kwarg, on every fifth seeded size."""
    pair = pairs(ckpt)
    sizes = sizes_for(ckpt, seeded_sizes()[::5])
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], kw) for kw in REQUEST_KWARGS for k, w, h in sizes]
    with timed(f"request-kwargs-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=lambda kw: json.dumps(kw, sort_keys=True))
def test_images_model_kwargs(m46, pairs, model_kwargs, ckpt):
    """Model-level kwargs (``--mm-processor-kwargs``), alone and under a per-request override."""
    pair = pairs(ckpt, model_kwargs)
    sizes = seeded_sizes()[1::5]
    override = {"slice_mode": True, "max_slice_nums": 9, "scale_resolution": 448, "use_image_id": True,
                "downsample_mode": "16x"}
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes]
    cases += [(f"{k} {w}x{h}", "image", [image(w, h)], {key: override[key]})
              for key in model_kwargs for k, w, h in sizes[:3]]
    with timed("model-kwargs"), with_hotfix(m46):
        assert_all_equal(pair, cases)


VIDEO_SIZES = [(56, 56), (700, 400), (300, 900), (20, 36)]


@pytest.mark.parametrize("ckpt", ["tiny", "real", REAL47])
def test_videos(m46, pairs, ckpt):
    """Videos of 1 and 3 frames, default and per-request kwargs."""
    pair = pairs(ckpt)
    cases = [(f"{w}x{h}x{n}", "video", [video(w, h, n)], {}) for w, h in VIDEO_SIZES for n in (1, 3)]
    cases += [(f"{w}x{h}x2", "video", [video(w, h, 2)], kw) for kw in REQUEST_KWARGS for w, h in VIDEO_SIZES[1:3]]
    with timed(f"videos-{ckpt}"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=lambda kw: json.dumps(kw, sort_keys=True))
def test_videos_model_kwargs(m46, pairs, model_kwargs, ckpt):
    pair = pairs(ckpt, model_kwargs)
    cases = [(f"{w}x{h}x2", "video", [video(w, h, 2)], {}) for w, h in VIDEO_SIZES[:2]]
    with timed("model-kwargs"), with_hotfix(m46):
        assert_all_equal(pair, cases)


@pytest.mark.parametrize("ckpt", ["real", REAL47])
def test_several_items_and_numpy(m46, pairs, ckpt):
    """Two images (``<image_id>`` 0 and 1), two videos, and images handed over as HWC arrays."""
    pair = pairs(ckpt)
    sizes = seeded_sizes()
    cases = [
        ("two images", "image", [image(*sizes[0][1:]), image(*sizes[9][1:])], {}),
        ("three images", "image", [image(*s[1:]) for s in sizes[17:20]], {"max_slice_nums": 2}),
        ("two videos", "video", [video(700, 400, 2), video(700, 400, 2, seed=1)], {}),
        ("arrays", "image", [np.asarray(image(365, 211)), np.asarray(image(300, 900))], {}),
    ]
    with timed("several-items"), with_hotfix(m46):
        assert_all_equal(pair, cases)


# --------------------------------------------------------------------------------------------------------------------
# Stock: the defects, as pinned per release
# --------------------------------------------------------------------------------------------------------------------


def _warmed_cache(m46, checkpoints, ckpt: str) -> Pair:
    """The "cached video" case's processor (and processor cache) of its own, filled as the case's stock outcome was
    measured: the two prompts of :func:`cached_prompts` run once with the hotfix (as
    tests/fixes/test_video_image_id_cache.py runs them), so the stock run then finds both videos in the cache,
    each as the hotfix processed it. Its own, so the outcome does not depend on which tests ran before."""
    pair = make_pair(checkpoints[ckpt], {}, cache=True)
    with with_hotfix(m46):
        cached_prompts(pair)
    return pair


def _stock_outcome(pairs, name: str, ckpt: str, cached: Pair) -> tuple[str, str]:
    """The outcome of case ``name``; "cached video" runs through ``cached`` (:func:`_warmed_cache`)."""
    modality, sizes, frames, model_kwargs, request_kwargs = STOCK_CASES[name]
    if modality == "video-cached":
        got, want = cached_prompts(cached)
        return classify(cached.tokenizer, got, want), f"\n    vLLM: {summary(cached.tokenizer, got)}"
    pair = pairs(ckpt, model_kwargs)
    if modality == "video":
        return compare(pair, "video", [video(w, h, frames) for w, h in sizes], request_kwargs)
    items = [image(w, h) for w, h in sizes]
    if modality == "image-array":
        items = [np.asarray(i) for i in items]
    return compare(pair, "image", items, request_kwargs)


@pytest.mark.stock_pin
@pytest.mark.parametrize("ckpt", ["real", REAL47])
def test_stock_defects(m46, pairs, checkpoints, environment, ckpt):
    """Stock vLLM (placeholder fixes off) differs from transformers exactly as :data:`STOCK` (4.6) /
    :data:`STOCK_V47` (4.7's classes against ``MiniCPMV4_7Processor``) says for this family; the same cases with the
    hotfix are equal. The cached-video case runs on a processor cache the hotfix filled first
    (:func:`_warmed_cache`)."""
    release = vllm_release()
    seen, details = {}, {}
    with timed("stock"):
        cached = _warmed_cache(m46, checkpoints, ckpt)
    with timed("stock"), stock(m46):
        for name in STOCK_CASES:
            seen[name], details[name] = _stock_outcome(pairs, name, ckpt, cached)
    print(f"\nstock vLLM {release}: " + json.dumps(seen, indent=1))
    if ckpt == "real47":
        expected = STOCK_V47
    else:  # the family tests/data/stock.json records here (recording: the one seen)
        expected = {**STOCK[table.pin(environment, ("prompt_family",), family_of(seen, release))],
                    **STOCK_EXTRA.get(release, {})}
    assert set(expected) == set(STOCK_CASES)
    wrong = {k: (seen[k], expected[k]) for k in STOCK_CASES if seen[k] != expected[k]}
    assert not wrong, "stock outcome (seen, pinned) differs: " + "; ".join(
        f"{k}: {v}{details[k]}" for k, v in wrong.items()
    )
    assert any(v != "equal" for v in seen.values())  # every release has stock defects this module shows
    with timed("stock"), with_hotfix(m46):
        fixed = {name: _stock_outcome(pairs, name, ckpt, cached) for name in STOCK_CASES}
    assert all(o == "equal" for o, _ in fixed.values()), {k: v for k, v in fixed.items() if v[0] != "equal"}


# --------------------------------------------------------------------------------------------------------------------
# The probes, the status record, the modes
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.stock_pin
def test_verdicts(m46, family, environment):
    """Each fix's probe on stock vLLM, as tests/support/expected.py pins it; the mm_placeholders cases find this family's
    sub-defects and the others equal, and its probe names the first of them it runs."""
    release = vllm_release()
    want = {name: table.verdict(name, environment) for name in MINE}
    got = {name: by_name(name).probe(m46) for name in MINE}
    assert {k: v.state.value for k, v in got.items()} == want, {k: v.reason for k, v in got.items()}
    broken = PROBE_BROKEN[family] | PROBE_BROKEN_EXTRA.get(release, set())
    named = {case[0] for case in by_name("mm_placeholders").CASES}
    found = by_name("mm_placeholders").check_cases(m46)  # every case (the probe stops at the first broken one)
    assert {n for n, state, _ in found if state.value == "broken"} == broken, found
    assert {n for n, state, _ in found if state.value == "correct"} == named - broken, found
    first = next(n for n in by_name("mm_placeholders").PROBE_ORDER if n in broken)
    assert f": {first} (" in got["mm_placeholders"].reason, got["mm_placeholders"].reason


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_status_and_modes(m46, family, mode):
    """auto applies exactly the broken ones (status() says so, nothing of a correct one is set), force all, off
    none; each fix's probe on the patched module answers correct."""
    with hotfix(m46, mode, fixes=MINE) as statuses:
        fixes = vllm_minicpm_hotfix.status()["fixes"]
        for name in MINE:
            fix = by_name(name)
            verdict = fix.probe(m46)  # re-probing the patched module
            entry = fixes[name]
            want = {"auto": statuses[name].verdict == "broken", "force": True, "off": False}[mode]
            assert entry["applied"] is want and _base.is_patched(fix, m46) is want, (name, entry)
            if mode == "auto" and not want:
                assert entry["verdict"] == "correct" and entry["why"].startswith("not needed"), entry
            if want:
                assert verdict.state.value == "correct", (name, verdict.reason)
    for name in MINE:
        assert not _base.is_patched(by_name(name), m46)


