"""MiniCPM-V 4.7's canvas M-RoPE positions for one prompt, as transformers lays them out.

The reference is transformers' ``MiniCPMV4_7Model.get_rope_index`` (``transformers/models/minicpmv4_7/
modeling_minicpmv4_7.py``, 5.19-5.24; with ``_group_visual_frames`` and ``get_vision_position_ids``): text tokens
count up on all three rows ``[T, H, W]``; every picture (one image, or one video frame) is laid on a canvas of LLM
tokens -- its thumbnail stretched over the whole canvas, each detail slice tiled row-major at its place -- whose
markers (``<image>`` ``</image>`` ``<slice>`` ``</slice>``, the ``\\n`` between slice rows) are pinned to the canvas'
halo, corners and right edge; the next token after a canvas starts ``max(height, width) + 1`` past its origin.
:func:`positions` computes the same ``(3, seq_len)`` table from what vLLM's engine has for a request: its prompt
token ids and, per multimodal item, the patch grid ``(height, width)`` of each crop (vLLM's ``tgt_sizes`` /
``video_tgt_sizes`` field of the item, the processor's ``target_sizes``). Written from that description, not from
vLLM 0.32's ``minicpmv4_7.py``.

Pure Python and torch (imported when called); no vLLM, no transformers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple


class Markers(NamedTuple):
    """The token ids canvas M-RoPE anchors on (``MiniCPMV4_7Config``'s ``image_start_id`` ... ``newline_id``) and the
    two visual pad ids (``image_token_id``, ``video_token_id``) that mark the crops."""

    image_start: int
    image_end: int
    slice_start: int
    slice_end: int
    newline: int
    image_pad: int
    video_pad: int

    @property
    def structural(self) -> frozenset[int]:
        """The tokens that may sit between two frames of one group, and that close a frame."""
        return frozenset((self.slice_start, self.slice_end, self.image_start, self.image_end, self.newline))


class Frame(NamedTuple):
    """One picture of the prompt: its thumbnail crop ``[start, end)``, its slice crops, and one past the markers that
    close it."""

    modality: int  #: 1 image, 2 video (transformers' ``mm_token_type_ids``)
    thumb: tuple[int, int]
    slices: list[tuple[int, int]]
    end: int


class Group(NamedTuple):
    """Frames only markers separate (a video's frames; a picture right against another): ``start`` is the ``<image>``
    opening the first, ``end`` one past the markers closing the last."""

    start: int
    end: int
    frames: list[Frame]


def crops(ids: Sequence[int], markers: Markers) -> list[tuple[int, int, int]]:
    """``(modality, start, end)`` of every maximal run of image pads (modality 1) or video pads (modality 2)."""
    kind = [1 if t == markers.image_pad else 2 if t == markers.video_pad else 0 for t in ids]
    out, i = [], 0
    for modality, run in itertools.groupby(kind):
        n = len(list(run))
        if modality:
            out.append((modality, i, i + n))
        i += n
    return out


def groups(ids: Sequence[int], markers: Markers) -> list[Group]:
    """The prompt's visual groups, in order. A crop right after ``<slice>`` is a slice of the picture being read;
    any other crop opens a picture (its ``<image>`` just before it), which joins the previous group when nothing but
    markers lies between the previous crop and it."""
    structural = markers.structural
    raw: list[tuple[int, list[list]]] = []  # (group start, [[modality, thumb, slices], ...])
    frame: list | None = None
    previous_end = 0
    for modality, start, end in crops(ids, markers):
        if frame is not None and ids[start - 1] == markers.slice_start:
            frame[2].append((start, end))
        else:
            frame = [modality, (start, end), []]
            if raw and all(t in structural for t in ids[previous_end:start - 1]):
                raw[-1][1].append(frame)
            else:
                raw.append((start - 1, [frame]))
        previous_end = end
    out = []
    for start, frames in raw:
        done = []
        for modality, thumb, slices in frames:
            end = slices[-1][1] if slices else thumb[1]
            while end < len(ids) and ids[end] in structural:
                end += 1
            done.append(Frame(modality, thumb, slices, end))
        out.append(Group(start, done[-1].end, done))
    return out


def _columns(slices: list[tuple[int, int]]) -> int:
    """Slices per canvas row: up to the first gap wider than ``</slice><slice>`` (the ``\\n`` ending a row)."""
    for k in range(len(slices) - 1):
        if slices[k + 1][0] - slices[k][1] > 2:
            return k + 1
    return len(slices)


def positions(ids: Sequence[int], markers: Markers, image_grids: Sequence[tuple[int, int]],
              video_grids: Sequence[tuple[int, int]], merge: Any = 4) -> tuple[Any, int]:
    """The canvas M-RoPE positions of one prompt: ``(torch.LongTensor of shape (3, len(ids)) holding [T, H, W], rope
    delta)``, the delta being what vLLM adds to a decoded token's index (``max position + 1 - len(ids)``, transformers'
    ``rope_deltas``).

    Args:
        ids: the prompt's token ids (vLLM's ``prompt_token_ids``; every image/video pad is one visual token).
        markers: the anchoring token ids (:class:`Markers`).
        image_grids: the patch grid ``(height, width)`` of every image crop, in the order the crops appear (per item:
            source, then its slices row by row -- the items' ``tgt_sizes`` concatenated in prompt order).
        video_grids: the same for video crops (``video_tgt_sizes``), every frame's source and slices.
        merge: patches per LLM token along each side, 4 (``"16x"``) or 2 (``"4x"``); or a function
            ``(modality, grid, tokens) -> int`` deciding it per crop.

    Raises:
        ValueError: the grids run out before the crops do, or a crop's token count is not its grid's
            ``(h // merge) * (w // merge)`` (the prompt and the items disagree).
    """
    import torch

    factor = merge if callable(merge) else (lambda modality, grid, n: merge)
    grids: dict[int, Iterator[tuple[int, int]]] = {1: iter(image_grids), 2: iter(video_grids)}

    def take(modality: int) -> tuple[int, int]:
        grid = next(grids[modality], None)
        if grid is None:
            raise ValueError(f"more {'image' if modality == 1 else 'video'} crops in the prompt than grids")
        return int(grid[0]), int(grid[1])

    def llm_grid(modality: int, grid: tuple[int, int], span: tuple[int, int]) -> tuple[int, int]:
        n = span[1] - span[0]
        f = factor(modality, grid, n)
        h, w = grid[0] // f, grid[1] // f
        if h * w != n:
            raise ValueError(f"a crop of {n} tokens at {span[0]} has the patch grid {grid}: {h} x {w} at merge {f}")
        return h, w

    def lattice(origin: int, h: int, w: int, height: int, width: int, dh: int = 0, dw: int = 0):
        """``(3, h*w)`` positions of an ``h x w`` crop spread over a ``height x width`` canvas, row-major."""
        rows = torch.linspace(0, height - 1, h).round().long() + dh
        cols = torch.linspace(0, width - 1, w).round().long() + dw
        hh, ww = torch.meshgrid(rows, cols, indexing="ij")
        return torch.stack([torch.zeros_like(hh), hh, ww]).reshape(3, -1) + origin

    n = len(ids)
    pos = torch.arange(n, dtype=torch.long).repeat(3, 1)
    nxt = 0  # the position the next text token gets
    cursor = 0  # the first token not placed yet

    def text(start: int, end: int) -> None:
        nonlocal nxt
        if end > start:
            pos[:, start:end] = torch.arange(end - start, dtype=torch.long) + nxt
            nxt += end - start

    for group in groups(ids, markers):
        text(cursor, group.start)
        cursor = group.start
        for frame in group.frames:
            modality, thumb, slices = frame.modality, frame.thumb, frame.slices
            opening = thumb[0] - 1  # its <image>
            if opening > cursor:  # text between two frames of a group, then one step so the halo misses it
                text(cursor, opening)
                nxt += 1
            end = min(frame.end, group.end)
            origin = nxt
            thumb_grid = take(modality)
            th, tw = llm_grid(modality, thumb_grid, thumb)
            height, width, sh, sw, cols = th, tw, 0, 0, 0
            slice_grids = []
            if slices:
                cols = _columns(slices)
                rows = len(slices) // cols
                if rows * cols != len(slices):
                    rows, cols = 1, len(slices)
                slice_grids = [llm_grid(modality, take(modality), span) for span in slices]
                sh, sw = slice_grids[0]
                height, width = rows * sh, cols * sw
            pos[:, opening:end] = origin
            pos[1:, opening] = max(origin - 1, 0)  # <image>: the halo above-left of the canvas
            if thumb[1] < end:  # </image>: the far corner
                pos[1, thumb[1]], pos[2, thumb[1]] = origin + height, origin + width
            pos[:, thumb[0]:thumb[1]] = lattice(origin, th, tw, height, width)
            for k, ((start, stop), (h, w)) in enumerate(zip(slices, slice_grids)):
                dh, dw = (k // cols) * sh, (k % cols) * sw
                if start - 1 >= opening:  # <slice>: its top-left corner
                    pos[1, start - 1], pos[2, start - 1] = origin + dh, origin + dw
                if stop < end:  # </slice>: its bottom-right corner
                    pos[1, stop], pos[2, stop] = origin + dh + h - 1, origin + dw + w - 1
                pos[:, start:stop] = lattice(origin, h, w, h, w, dh, dw)
            for k in range(len(slices) - 1):  # the "\n" ending a row: just past the row's right edge
                gap_start, gap_end = slices[k][1], slices[k + 1][0]
                if gap_end - gap_start > 2:
                    pos[1, gap_start + 1:gap_end - 1] = origin + (k // cols + 1) * sh - 1
                    pos[2, gap_start + 1:gap_end - 1] = origin + cols * sw
            nxt = origin + max(height, width) + 1
            cursor = end
        text(cursor, group.end)
        cursor = group.end
    text(cursor, n)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


def merge_from_tokens(modality: int, grid: tuple[int, int], tokens: int) -> int:
    """The merge factor a crop of ``tokens`` LLM tokens over the patch grid ``grid`` was encoded with: 4 (``"16x"``)
    where ``(h // 4) * (w // 4) == tokens``, else 2 (``"4x"``). vLLM may encode each item in its own mode (a
    request's ``downsample_mode``); its placeholder count says which."""
    h, w = grid
    return 4 if (h // 4) * (w // 4) == tokens else 2
