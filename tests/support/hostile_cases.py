"""The cases of the hostile-request run (tests/e2e/test_hostile.py): what a new user, a buggy client or a hostile one
sends a MiniCPM-V ``vllm serve``, each with what a robust server must answer.

Every case is a :class:`Case`: the images (built by :func:`make_image`, sent as PNG data URLs), the request's
``mm_processor_kwargs`` and sampling fields, and the expectation:

* ``"400"``: the client's mistake; the answer must be a 4xx whose message names ``cause`` (the kwarg, or the reason);
* ``"200"``: a valid request, answered;
* ``"no-5xx"``: valid or not depending on the value (the seeded generator's cases): 2xx or 4xx, never a 5xx.

:func:`cases` returns the fixed list plus :func:`generated` (a seeded generator of kwarg values: same seed, same
cases). Bounded: about 70 cases. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

SEED = 20261201


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  #: the class of the issue: "type", "degenerate", "geometry", "oversized", "image", "batch", ...
    expect: str  #: "400", "200" or "no-5xx"
    kwargs: dict | None = None  #: mm_processor_kwargs (None: none sent)
    images: tuple[tuple[Any, ...], ...] = ((224, 224, "RGB"),)  #: (width, height, mode) per image
    cause: str = ""  #: what a 400's message must contain
    extra: dict = dataclasses.field(default_factory=dict)  #: more request fields (max_tokens, n, ...)
    concurrent: int = 1  #: sent this many times at once
    media: str = ""  #: instead of ``images``: one broken image payload of :func:`broken_media` by this name


def make_image(width: int, height: int, mode: str = "RGB", seed: int = 0):
    """A deterministic noise image of ``width x height`` in PIL ``mode``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed * 7919 + width * 31 + height)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return rgb if mode == "RGB" else rgb.convert(mode)


def broken_media(name: str) -> str:
    """The ``image_url`` of a broken upload (what a buggy client or a cut-off transfer sends): a data URL whose bytes
    are half a PNG (``"truncated"``), the first 40 bytes of one (``"header only"``), text (``"not an image"``), or not
    base64 at all (``"not base64"``). vLLM's media loading refuses each with a 400 before any MiniCPM-V code runs."""
    import base64
    import io

    buf = io.BytesIO()
    make_image(300, 200).save(buf, "PNG")
    png = buf.getvalue()
    payload = {"truncated": png[: len(png) // 2], "header only": png[:40], "not an image": b"hello, not an image"}
    if name == "not base64":
        return "data:image/png;base64,@@@###"
    return "data:image/png;base64," + base64.b64encode(payload[name]).decode()


def _bad(kwargs: dict, kind: str, cause: str | None = None) -> Case:
    ((key, value),) = kwargs.items()
    return Case(f"{key}={value!r}", kind, "400", kwargs, cause=cause or key)


#: The issue's classes, and the values of the hostile run's notes.
FIXED_CASES: list[Case] = [
    # wrong types (transformers' own type check: HTTP 500 before)
    _bad({"slice_mode": "false"}, "type"),
    _bad({"slice_mode": 0}, "type"),
    _bad({"slice_mode": None}, "type"),
    _bad({"max_slice_nums": None}, "type"),
    _bad({"max_slice_nums": "9"}, "type"),
    _bad({"max_slice_nums": 9.5}, "type"),
    _bad({"max_slice_nums": True}, "type"),
    _bad({"use_image_id": "no"}, "type"),
    _bad({"downsample_mode": 4}, "type"),
    _bad({"max_slice_nums": {"nested": 1}}, "type"),
    # degenerate and out of range
    _bad({"scale_resolution": 0}, "degenerate"),
    _bad({"scale_resolution": -448}, "degenerate"),
    _bad({"scale_resolution": 1}, "degenerate"),
    _bad({"scale_resolution": 13}, "degenerate"),
    _bad({"max_slice_nums": 0}, "degenerate"),
    _bad({"max_slice_nums": -1}, "degenerate"),
    _bad({"max_slice_nums": 1000}, "degenerate"),
    _bad({"downsample_mode": "2x"}, "degenerate"),
    # geometry the model was built with
    _bad({"patch_size": 0}, "geometry"),
    _bad({"patch_size": 1}, "geometry"),
    _bad({"patch_size": 7}, "geometry"),
    _bad({"do_resize": False}, "geometry"),
    _bad({"image_mean": []}, "geometry"),
    _bad({"return_tensors": "np"}, "geometry"),
    # oversized: refused from the item's size and kwargs, before any resizing
    Case("scale_resolution=12000", "oversized", "400", {"scale_resolution": 12000}, cause="scale_resolution"),
    Case("scale_resolution=100000", "oversized", "400", {"scale_resolution": 100000}, cause="scale_resolution"),
    Case("2000x1500 sliced at scale 1500", "oversized", "400", {"scale_resolution": 1500},
         images=((2000, 1500, "RGB"),), cause="vision tokens"),
    Case("3000x2000 at scale 1792, 4 slices", "oversized", "400", {"scale_resolution": 1792, "max_slice_nums": 4},
         images=((3000, 2000, "RGB"),), cause="vision tokens"),
    # valid kwargs and odd but valid images: answered
    Case("no kwargs", "valid", "200"),
    Case("slice_mode false", "valid", "200", {"slice_mode": False}),
    Case("max_slice_nums 1", "valid", "200", {"max_slice_nums": 1}),
    Case("scale_resolution 56", "valid", "200", {"scale_resolution": 56}),
    Case("downsample_mode 4x", "valid", "200", {"downsample_mode": "4x"}),
    Case("use_image_id false", "valid", "200", {"use_image_id": False}),
    # tiny and extreme-aspect images: vllm-project/vllm#17769 (a small picture, 500) and #13655 (a 500x19 PNG,
    # Internal Server Error on a VL model)
    Case("1x1 image", "image", "200", images=((1, 1, "RGB"),)),
    # strips: as many vision tokens as stock vLLM makes of them (no kwargs: vLLM's own limits judge them)
    Case("1x3000 strip", "image", "no-5xx", images=((1, 3000, "RGB"),)),
    Case("3000x1 strip", "image", "no-5xx", images=((3000, 1, "RGB"),)),
    Case("grey L", "image", "200", images=((300, 200, "L"),)),
    Case("RGBA", "image", "200", images=((300, 200, "RGBA"),)),
    Case("palette P", "image", "200", images=((300, 200, "P"),)),
    Case("grey with alpha LA", "image", "200", images=((300, 200, "LA"),)),
    Case("16-bit grey I;16", "image", "no-5xx", images=((300, 200, "I;16"),)),
    Case("2000x2000 image", "image", "200", images=((2000, 2000, "RGB"),)),
    # broken uploads (a cut-off transfer, a client sending the wrong bytes): vLLM's own 400, the engine untouched.
    # Public report: vllm-project/vllm#38253 (a truncated base64 JPEG answered 500 before that change)
    Case("truncated PNG", "media", "400", media="truncated", cause="image file is truncated"),
    Case("PNG header only", "media", "400", media="header only", cause="cannot identify image file"),
    Case("text sent as a PNG", "media", "400", media="not an image", cause="cannot identify image file"),
    Case("image data not base64", "media", "400", media="not base64", cause="base64"),
    # batches: two images, one request's kwargs for both; concurrent mixed requests. Public reports:
    # vllm-project/vllm#8369 (crash after a few multi-image calls), #43473 (EngineDeadError under 2-way concurrent
    # image requests), HabanaAI/vllm-fork#841 (`Attempted to assign ... multimodal tokens to 0 placeholders`, the
    # engine death the notes show for MiniCPM-V kwargs)
    Case("two images, bad kwarg", "batch", "400", {"slice_mode": "no"}, images=((224, 224, "RGB"), (300, 200, "RGB")),
         cause="slice_mode"),
    Case("two images, valid kwargs", "batch", "200", {"max_slice_nums": 2},
         images=((224, 224, "RGB"), (300, 200, "RGB"))),
    Case("4 concurrent bad", "concurrent", "400", {"patch_size": 7}, cause="patch_size", concurrent=4),
    Case("4 concurrent valid", "concurrent", "200", {"slice_mode": False}, concurrent=4),
    # the processor cache: a request refused after its image was processed, then the same image, valid
    Case("max_tokens 0", "cache", "no-5xx", None, images=((230, 170, "RGB"),), extra={"max_tokens": 0}),
    Case("same image after max_tokens 0", "cache", "200", None, images=((230, 170, "RGB"),)),
    # n > 1 with greedy sampling (the other trigger the notes name for the drift): vLLM's own 400, after the image was
    # processed on 0.32.0 (the same image next: 500, P0/P1 cache drift), so the pair has an image of its own
    Case("n 4 with greedy sampling", "cache", "400", None, images=((250, 190, "RGB"),), extra={"n": 4},
         cause="n must be 1"),
    Case("same image after n 4", "cache", "200", None, images=((250, 190, "RGB"),)),
    # ... and a refusal of the hotfix's own on a cached image, with an image of its own: on 0.22-0.24 vLLM's drift
    # above does not heal (every later request with that image fails), which would hide what this pair shows
    Case("an image to cache", "cache", "200", None, images=((240, 180, "RGB"),)),
    Case("bad kwarg on a cached image", "cache", "400", {"scale_resolution": 13}, images=((240, 180, "RGB"),),
         cause="scale_resolution"),
    Case("same image after the bad kwarg", "cache", "200", None, images=((240, 180, "RGB"),)),
]

#: Model-level ``--mm-processor-kwargs`` a server must refuse at start-up, all three in one error (tests/e2e/
#: test_model_kwargs_serve.py, tests/fixes/test_request_kwargs.py): key -> (value, what the error must say is allowed).
#: Without the check vLLM fails on them only inside its token counting, naming none of them.
MODEL_LEVEL_BAD: dict[str, tuple[Any, str]] = {
    "max_slice_nums": (-1, "an integer of at least 1"),  # degenerate (transformers: math domain error)
    "patch_size": (7, "fixed by the model"),  # geometry the checkpoint was built with
    "slice_mode": ("false", "a boolean (true or false)"),  # wrong type
}


def model_level_bad() -> dict[str, Any]:
    """:data:`MODEL_LEVEL_BAD` as the ``--mm-processor-kwargs`` object."""
    return {k: v for k, (v, _) in MODEL_LEVEL_BAD.items()}


#: The seeded generator's values per key: types and ranges a fuzzing client tries.
POOL: dict[str, list[Any]] = {
    "max_slice_nums": [-5, 0, 1, 3, 9, 10, 64, 10**9, 2.0, "3", None, True, [], {}],
    "scale_resolution": [-1, 0, 28, 55, 56, 57, 112, 448, 3000, 10**7, 448.0, "448", None, False, [448]],
    "slice_mode": [True, False, 1, 0, "true", None, [], "False"],
    "use_image_id": [True, False, 1, "yes", None],
    "downsample_mode": ["16x", "4x", "8x", "", 16, None, "4X"],
    "patch_size": [14, 0, 28, "14"],
}


def generated(n: int = 14, seed: int = SEED) -> list[Case]:
    """``n`` requests each setting two or three keys of :data:`POOL` to a seeded choice: never a 5xx."""
    rng = random.Random(seed)
    out = []
    keys = sorted(POOL)
    for i in range(n):
        chosen = rng.sample(keys, rng.choice((2, 3)))
        kwargs = {k: rng.choice(POOL[k]) for k in chosen}
        out.append(Case(f"seeded {i}: {kwargs}", "seeded", "no-5xx", kwargs))
    return out


def cases() -> list[Case]:
    return FIXED_CASES + generated()
