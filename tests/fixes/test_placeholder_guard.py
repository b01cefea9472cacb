"""``placeholder_guard`` against the real vLLM of this environment, without an engine: requests whose placeholder count
disagrees with their tensors (per release, from the notes and measured: ``{"max_slice_nums": 1}`` on 0.22-0.31,
``{"slice_mode": false}`` everywhere) -- the real merge (``_merge_multimodal_embeddings``) raises the error that
kills EngineCore; with the guard vLLM's processor raises one ``ValueError`` naming the item and both counts, on the
uncached and the cached path (where a refused item must not be recorded as sent to the engine); requests whose counts
agree come out bit-identical. The references: the pads counted in the prompt vLLM built and the rows vLLM's real
vision tower returns for each item (:mod:`support.engine`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm_minicpm_hotfix.fixes import placeholder_guard
from support.hotfix import hotfix
from support.engine import (
    KILL_REQUESTS, image, video, fixes, process, pads_in_prompt, embed, items_of, merge, sender_cache, mconfig, vproc,
    vmodel, fam, stock_verdict,
)


#: Seeded sizes (not hand-picked) for the count formula.
FORMULA_SIZES = [tuple(int(v) for v in row) for row in np.random.default_rng(2026).integers(1, 700, (8, 2))]


@pytest.mark.parametrize("mm_kwargs", [{}, {"downsample_mode": "4x"}], ids=["16x", "4x"])
def test_guard_count_is_the_vision_towers(m46, vproc, vmodel, mm_kwargs):
    """The guard's count from ``tgt_sizes`` equals the rows vLLM's real vision tower returns, per item."""
    rows = []
    with fixes(m46):
        for w, h in FORMULA_SIZES:
            out = process(vproc, {"image": [image(w, h)]}, mm_kwargs)
            ((_, item),) = items_of(out)
            want = int(embed(vmodel, [("image", item)])[0].shape[0])
            got, what = placeholder_guard.expected_embeddings("image", item, vproc.info.get_hf_config())
            rows.append(((w, h), got, want, what))
    print("\n" + "\n".join(map(str, rows)))
    assert all(got == want for _, got, want, _ in rows), rows


def test_stock_request_reaches_the_engine_and_kills_it(m46, vproc, vmodel, fam):
    """Without the guard, each engine-killing request of this family passes vLLM's processor; the real merge then
    raises what kills EngineCore (``Attempted to assign ... multimodal tokens to ... placeholders``)."""
    with fixes(m46):
        for mm_kwargs, pads, rows in KILL_REQUESTS[fam]:
            out = process(vproc, {"image": [image(224, 224)]}, mm_kwargs)
            emb = embed(vmodel, items_of(out))
            print(f"\n{mm_kwargs}: {pads_in_prompt(vproc, out)} pads, {emb[0].shape[0]} embeddings")
            assert (pads_in_prompt(vproc, out), int(emb[0].shape[0])) == (pads, rows), mm_kwargs
            with pytest.raises(ValueError, match=rf"Attempted to assign .*{rows}.* to {pads} placeholders"):
                merge(m46, vmodel, out, emb)


def test_guard_refuses_naming_item_and_counts(m46, vproc, fam):
    with fixes(m46, "placeholder_guard") as st:
        assert st["placeholder_guard"].applied
        for mm_kwargs, pads, rows in KILL_REQUESTS[fam]:
            # the bad image second: the message names its index in the request
            with pytest.raises(ValueError) as err:
                process(vproc, {"image": [image(100, 100), image(224, 224)]}, mm_kwargs)
            msg = str(err.value)
            print(f"\n{mm_kwargs}: {msg}")
            assert isinstance(err.value, placeholder_guard.PlaceholderMismatchError)
            assert f"image item 1 of this request has {pads} <|image_pad|> placeholder tokens" in msg
            assert f"give {rows} vision embeddings" in msg


def test_guard_cached_path_refuses_before_the_cache_records(m46, vproc, mconfig, fam):
    """Through vLLM's sender cache: the refused item is not recorded as sent (a second identical request is refused
    again, with its data, instead of reaching the engine as a cache reference); a good request is cached as usual."""
    cache = sender_cache(mconfig)
    mm_kwargs, pads, rows = KILL_REQUESTS[fam][0]
    with fixes(m46, "placeholder_guard"):
        for _ in range(2):
            with pytest.raises(ValueError, match=f"image item 0 of this request has {pads} .* give {rows} vision"):
                process(vproc, {"image": [image(224, 224)]}, mm_kwargs, cache=cache)
        first = process(vproc, {"image": [image(224, 224)]}, {}, cache=cache)
        again = process(vproc, {"image": [image(224, 224)]}, {}, cache=cache)
    assert first["mm_kwargs"]["image"][0] is not None
    assert again["mm_kwargs"]["image"][0] is None  # sent once, then a cache reference
    assert first["prompt_token_ids"] == again["prompt_token_ids"]


@pytest.mark.parametrize("mm_kwargs", [{}, {"downsample_mode": "4x"}, {"use_image_id": False}], ids=str)
def test_guard_leaves_agreeing_requests_bit_identical(m46, vproc, vmodel, mm_kwargs):
    items = {"image": [image(300, 60), image(224, 224)]}
    with fixes(m46):
        want = process(vproc, items, mm_kwargs)
    with fixes(m46, "placeholder_guard"):
        got = process(vproc, items, mm_kwargs)
    assert got["prompt_token_ids"] == want["prompt_token_ids"]
    for a, b in zip(got["mm_kwargs"]["image"], want["mm_kwargs"]["image"]):
        da, db = placeholder_guard.item_data(a), placeholder_guard.item_data(b)
        assert da.keys() == db.keys() and all(torch.equal(da[k], db[k]) for k in da)
    # and the counts really agree: the merge accepts vLLM's own embeddings
    merge(m46, vmodel, got, embed(vmodel, items_of(got)))


def test_guard_catches_a_4x_video_without_a_video_flag(m46, vproc, environment):
    """Without ``encoder_modes`` a 0.22-0.31 video carries no mode: the guard counts it in the config's mode and
    refuses the 4x video (whose placeholder is sized for 4x); on 0.32+ vLLM's own flag makes the counts agree."""
    vid = video(1, 112, 112)
    with fixes(m46, "placeholder_guard"):
        if stock_verdict("encoder_modes", environment) == "broken":
            with pytest.raises(ValueError, match=r"video item 0 of this request has \d+ <\|video_pad\|>") as err:
                process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})
            print("\n" + str(err.value))
        else:
            process(vproc, {"video": [vid]}, {"downsample_mode": "4x"})


def test_guard_counts_a_content_changed_in_place_again(vproc):
    """The guard keeps a count per content object (vLLM hands it the same cached list on every request); a list
    changed in place after it was counted, or ``is_embed``'s own token ids changed, is counted again. The reference:
    vLLM's own ``is_embed`` mask as things are at each call."""
    from types import SimpleNamespace

    from vllm.multimodal.processing import PromptUpdateDetails

    pad, text = 7, 1
    full, embed_ids = [text, *[pad] * 6, text], [pad]
    details = PromptUpdateDetails.select_token_ids(full, embed_ids)
    updates = [SimpleNamespace(content=details)]

    def vllms_own() -> int:
        mask = details.is_embed(vproc.info.get_tokenizer(), full) if details.is_embed.__code__.co_argcount == 2 \
            else details.is_embed(full)
        return int(mask.sum())

    first = placeholder_guard.placeholder_embeds(updates, vproc.info)
    again = placeholder_guard.placeholder_embeds(updates, vproc.info)  # kept
    assert first == again == vllms_own() == 6
    full[1:3] = [text, text]  # the same object, two pads fewer
    assert placeholder_guard.placeholder_embeds(updates, vproc.info) == vllms_own() == 4
    full.append(pad)  # and one longer
    assert placeholder_guard.placeholder_embeds(updates, vproc.info) == vllms_own() == 5
    embed_ids[0] = text  # the closure's own ids: the text tokens are the embeddings now
    assert placeholder_guard.placeholder_embeds(updates, vproc.info) == vllms_own() == 4


# --------------------------------------------------------------------------------------------------------------------
# A mismatch of exactly one, the probe on the patched class, and a probe that cannot tell
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def pads_off_by(vproc, monkeypatch):
    """``pads_off_by(delta)``: from now on (until the test ends) vLLM's real processor lays out each image's
    placeholder with ``delta`` (+1 / -1) ``<|image_pad|>`` more than its own text -- the one fault injected, in
    ``get_image_prompt_texts`` (the method every release's ``_get_prompt_updates`` asks for an image's placeholder
    text); the tensors stay vLLM's."""
    def off_by(delta: int) -> None:
        pad = vproc.info.get_tokenizer().image_token
        own = type(vproc).get_image_prompt_texts.__get__(vproc)

        def texts(*args, **kwargs):
            text = own(*args, **kwargs)
            return text.replace(pad, pad * 2, 1) if delta > 0 else text.replace(pad, "", 1)

        monkeypatch.setattr(vproc, "get_image_prompt_texts", texts, raising=False)

    return off_by


def test_stock_passes_a_mismatch_of_one_to_the_engine(m46, vproc, vmodel, pads_off_by):
    """The reference for the tests below: with one pad more than the item's embeddings, stock vLLM's processor lets
    the request through and the real merge (EngineCore's) raises on it."""
    with fixes(m46):
        rows = int(embed(vmodel, items_of(process(vproc, {"image": [image(224, 224)]}, {})))[0].shape[0])
        pads_off_by(+1)
        out = process(vproc, {"image": [image(224, 224)]}, {})
        emb = embed(vmodel, items_of(out))
        assert (pads_in_prompt(vproc, out), int(emb[0].shape[0])) == (rows + 1, rows)
        with pytest.raises(ValueError, match=rf"Attempted to assign .*{rows}.* to {rows + 1} placeholders"):
            merge(m46, vmodel, out, emb)


@pytest.mark.parametrize("delta", [+1, -1], ids=["one-pad-more", "one-pad-fewer"])
def test_guard_refuses_a_mismatch_of_one(m46, vproc, vmodel, pads_off_by, delta):
    """Pads and embeddings that differ by exactly one are refused like any other mismatch (the guard compares for
    equality, not within a tolerance), naming both counts; the counts are vLLM's (its prompt, its vision tower)."""
    with fixes(m46, "placeholder_guard") as st:
        assert st["placeholder_guard"].applied
        rows = int(embed(vmodel, items_of(process(vproc, {"image": [image(224, 224)]}, {})))[0].shape[0])
        pads_off_by(delta)
        with pytest.raises(placeholder_guard.PlaceholderMismatchError) as err:
            process(vproc, {"image": [image(224, 224)]}, {})
    print(f"\n{err.value}")
    assert f"image item 0 of this request has {rows + delta} <|image_pad|> placeholder tokens" in str(err.value)
    assert f"give {rows} vision embeddings" in str(err.value)


def test_hotfix_active_refuses_a_mismatch_at_the_processor(m46, vproc, pads_off_by):
    """The whole hotfix as the post-import hook applies it under ``auto`` (so the guard is on where its probe says
    so: everywhere, 0.34.0 included): a request whose pads differ from its embeddings gets the guard's error from
    vLLM's processor, before anything reaches an engine."""
    with hotfix(m46, "auto", fixes=None) as st:
        guard = st["placeholder_guard"]
        assert guard.applied, (guard.verdict, guard.why)
        process(vproc, {"image": [image(224, 224)]}, {})  # agreeing counts pass
        pads_off_by(+1)
        with pytest.raises(placeholder_guard.PlaceholderMismatchError, match="image item 0 of this request has"):
            process(vproc, {"image": [image(224, 224)]}, {})


def test_probe_on_the_patched_class_says_the_defect_is_gone(m46, environment):
    """Stock: the pinned verdict. With the guard applied, its own probe (2 pads, 1 embedding: a mismatch of one) on
    the patched classes answers ``correct`` -- the guard refuses it -- which is what doctor checks after the hook."""
    assert placeholder_guard.probe(m46).state.value == stock_verdict("placeholder_guard", environment)
    with fixes(m46, "placeholder_guard") as st:
        assert st["placeholder_guard"].applied
        after = placeholder_guard.probe(m46)
    print(f"\n{after.state.value}: {after.reason}")
    assert after.state.value == "correct", after
    assert "has 2 <|image_pad|> placeholder tokens in the prompt, but its processed pixel values give 1 vision" \
        in after.reason, after


def _stand_in_release(m46, new_cache_call: bool = True):
    """A module like ``m46`` whose 4.6 processor's ``_merge_mm_kwargs`` first calls a cache method no vLLM release
    has (a later release adding a call, as 0.34.0 added ``get_cached_item``), then vLLM's own."""
    from types import SimpleNamespace

    base = m46.MiniCPMV4_6MultiModalProcessor

    class LaterProcessor(base):
        def _merge_mm_kwargs(self, cache, *args, **kwargs):
            cache.get_cached_items_of_a_later_release(kwargs.get("mm_hashes"))
            return base._merge_mm_kwargs(self, cache, *args, **kwargs)

    return SimpleNamespace(__name__="stand_in_release", MiniCPMV4_6MultiModalProcessor=LaterProcessor)


def test_a_probe_that_cannot_tell_keeps_the_guard_on(m46, monkeypatch):
    """Where vLLM's own path cannot be run (the stand-in release above), the verdict is ``undetermined`` -- reported
    as such -- but the guard's own check was shown to work on this vLLM's items, so ``auto`` applies it: the user
    keeps the protection. With the guard's wrapper in place the probe then reaches its refusal (``correct``). Where
    the guard's check does not work either, it stays off and the reason says why."""
    import functools

    from vllm_minicpm_hotfix import decision

    later = _stand_in_release(m46)
    got = placeholder_guard.probe(later)
    print(f"\n{got}")
    assert got.state is decision.State.UNDETERMINED and got.guard and got.applicable, got
    assert "get_cached_items_of_a_later_release" in got.reason and "so it is applied" in got.reason, got
    chosen = decision.decide(decision.Mode.AUTO, got)
    assert chosen.apply and "applied anyway" in chosen.why, chosen
    assert not decision.decide(decision.Mode.OFF, got).apply

    # the guard's behaviour around the stand-in release's method, as its PATCHES line sets it (called by keyword,
    # as the probe calls it)
    cls = later.MiniCPMV4_6MultiModalProcessor
    own = cls.__dict__["_merge_mm_kwargs"]

    class Call(dict):
        args = ()
        kwargs = property(dict)

    monkeypatch.setattr(cls, "_merge_mm_kwargs", lambda self, **kw: placeholder_guard.merge_mm_kwargs(
        functools.partial(own, self), self, Call(kw)))
    after = placeholder_guard.probe(later)
    assert after.state is decision.State.CORRECT, after

    monkeypatch.undo()
    monkeypatch.setattr(placeholder_guard, "check", lambda *a, **k: (_ for _ in ()).throw(AttributeError("later")))
    off = placeholder_guard.probe(_stand_in_release(m46))
    assert off.state is decision.State.UNDETERMINED and not off.guard, off
    assert "the guard is not applied (its check raised AttributeError: later)" in off.reason, off
    assert not decision.decide(decision.Mode.AUTO, off).apply
