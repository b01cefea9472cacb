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
