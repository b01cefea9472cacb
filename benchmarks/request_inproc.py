"""Per request, in one process: CPU time of vLLM's multimodal processor with every fix applied (B) and reverted (A).

    python request_inproc.py REPO ROUNDS REPS

Runs in a vLLM 0.32+ environment (``ProcessorInputs`` / ``TimingContext``, as vLLM's renderer calls the processor)
with the package imported from ``REPO``. The checkpoint is the bundled tiny one with MiniCPM-V 4.6's real processor
geometry (patch 14, ``scale_resolution`` 448, ``max_slice_nums`` 9; a copy in a temporary folder), so the slicing,
resizing and normalising work is the real model's. The processor is vLLM's own, made by
``MULTIMODAL_REGISTRY.create_processor(ModelConfig(...))`` once per round (in state B on even rounds, A on odd ones);
``apply`` is timed with ``time.process_time()`` (CPU of this process) and ``perf_counter`` (wall), torch on one
thread, no processor cache (every call does the full work), the garbage collector off while a call is timed and run
before it (as ``timeit`` does: a collection lands in whichever call triggers it, and is not that call's work), the
objects of the imported libraries frozen first (``gc.freeze``: the millions of them are not scanned per collection).

B is what a vLLM process has after the post-import hook (``auto``): the hook is run on the model module once, at the
start, and the first processor is built after it, so the fixes probed at vLLM's first processor (the processor
path's group: every fix on the request path) are probed and applied as in vLLM. The values the fixes then set
(:data:`fixes._base.patching._ORIGINALS`: each attribute's value before the first fix set it, and the value in place
now) are kept, and a switch of state sets one or the other on vLLM's classes: the same few ``setattr`` both ways,
no probe, no hook, so that neither state pays a switch the other does not. (Until 2026-12-06 a switch to B ran the
hook again; after the processor-path group was deferred to vLLM's first processor (2026-12-05) its fixes then waited
for a processor that was never built, and B ran without them: see docs/benchmarks.md.) The run stops with an error
if B lacks a fix of the request path that the hook applied, or A has one. The switch happens between calls, outside
the timed region (an A/A run, both states vLLM's values, gave 1.003 [0.992, 1.011] on 448x448 over 120 rounds: the
switch charges neither state). ``ROUNDS`` rounds; in each, per case, ``REPS`` calls in each
state, alternating call by call (A B, B A, A B ...), so that A and B share the processor, the allocator's state and
the machine's moment; each state's measurement of the case in the round is the minimum of its ``REPS`` calls (the
least disturbed by other load). Prints one JSON object (last line): per case the per-round minima of A and B, and
the prompt length each state built; the fixes applied in B.
"""

import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = ((448, 448), (1024, 768), (1920, 1080), (4032, 3024))
VIDEO = (4, 640, 480)  # frames, width, height
KWARG_SIZE = (1024, 768)
#: One request per per-request kwarg the model's processor takes (values as tests/prompt/test_prompt_conformance.py uses).
REQUEST_KWARGS = (
    ("max_slice_nums", 4),
    ("slice_mode", False),
    ("scale_resolution", 224),
    ("downsample_mode", "4x"),
    ("use_image_id", False),
)
PROMPT = "<|im_start|>user\n{mm}Describe it.<|im_end|>\n<|im_start|>assistant\n"


def real_geometry(repo: Path, dest: Path) -> Path:
    src = repo / "vllm_minicpm_hotfix" / "data" / "tiny-minicpm-v46"
    shutil.copytree(src, dest)
    cfg_path = dest / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("image_processor", "video_processor"):
        cfg[key].update(patch_size=14, scale_resolution=448, max_slice_nums=9)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return dest


def cases():
    import numpy as np
    from PIL import Image

    def image(w, h):
        rng = np.random.default_rng(w * 10007 + h)
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    out = [(f"image {w}x{h}", "image", [image(w, h)], {}) for w, h in SIZES]
    f, w, h = VIDEO
    rng = np.random.default_rng(7)
    out.append((f"video {f} frames {w}x{h}", "video", [rng.integers(0, 256, (f, h, w, 3), dtype=np.uint8)], {}))
    kw_img = image(*KWARG_SIZE)
    for k, v in REQUEST_KWARGS:
        out.append((f"image {KWARG_SIZE[0]}x{KWARG_SIZE[1]}, {k}={v}", "image", [kw_img], {k: v}))
    return out


def make_processor(ckpt: Path):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    return MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=str(ckpt), dtype="float32", enforce_eager=True))


def call(proc, modality: str, items: list, kwargs: dict) -> int:
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tok = proc.info.get_tokenizer()
    pad = tok.image_token if modality == "image" else tok.video_token
    prompt = tok.encode(PROMPT.format(mm=pad * len(items)), add_special_tokens=False)
    fields = {f.name for f in dataclasses.fields(ProcessorInputs)}
    inputs = dict(prompt=prompt, mm_data_items=proc.info.parse_mm_data({modality: items}),
                  hf_processor_mm_kwargs=dict(kwargs))
    if "tokenization_kwargs" in fields:
        inputs["tokenization_kwargs"] = {}
    return len(proc.apply(ProcessorInputs(**inputs), TimingContext(enabled=False))["prompt_token_ids"])


def states_of(applied: list[str]) -> dict[str, list[tuple[Any, str, Any]]]:
    """``{"A": [(owner, attribute, vLLM's value)], "B": [(owner, attribute, the value in place now)]}`` for every
    attribute a fix has set (``patching._MISSING``: the owner did not define it), each list set in place by the
    framework's own ``patching._undo`` (a value, or the owner's own attribute deleted for ``_MISSING``). Raises
    ``RuntimeError`` if the hook applied no fix of the request path (``fixes.REQUEST_PATH``), or if a switch does not
    leave each state as it should be."""
    from vllm_minicpm_hotfix import fixes
    from vllm_minicpm_hotfix.fixes._base import patching

    first: dict[tuple[Any, str], Any] = {}
    for saved in patching._ORIGINALS.values():  # in the order applied: the first fix's is vLLM's own value
        for key, value in saved.items():
            first.setdefault(key, value)
    states = {"A": [], "B": []}
    for (owner, attr), value in first.items():
        states["A"].append((owner, attr, value))
        states["B"].append((owner, attr, vars(owner).get(attr, patching._MISSING)))
    on_path = sorted({name for _, name, _ in fixes.REQUEST_PATH} & set(applied))
    if not on_path:
        raise RuntimeError(f"B applies no fix of the request path (applied: {applied}): nothing to measure")
    for state in "AB":
        patching._undo(states[state])
        marked = {getattr(vars(owner).get(attr), patching.MARKER_ATTR, None) for owner, attr, _ in states["B"]}
        if (state == "A" and marked - {None}) or (state == "B" and not set(on_path) <= marked):
            raise RuntimeError(f"state {state}: the fixes in place are {sorted(marked - {None})}")
    return states


def main(repo: str, rounds: int, reps: int) -> dict:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sys.path.insert(0, repo)
    import torch

    torch.set_num_threads(1)
    import vllm.model_executor.models.minicpmv4_6 as m46

    from vllm_minicpm_hotfix import hook, record
    from vllm_minicpm_hotfix.fixes import _base
    from vllm_minicpm_hotfix.fixes._base import patching

    work = Path(tempfile.mkdtemp(prefix="vmh-request-bench."))
    try:
        ckpt = real_geometry(Path(repo), work / "ckpt")
        todo = cases()
        res = {name: {"A": [], "B": [], "A_wall": [], "B_wall": [], "tokens": {}, "error": {}} for name, *_ in todo}
        hook.on_import(m46)  # as in every vLLM process: the hook at the model module's import ...
        make_processor(ckpt)  # ... and the processor-path group probed and applied at vLLM's first processor
        applied = [n for n, e in record.current().fixes.items() if e.applied]
        states = states_of(applied)
        gc.collect()
        gc.freeze()  # vLLM's, torch's and transformers' objects: never scanned again, so a collection is cheap

        def set_state(state: str) -> None:
            patching._undo(states[state])

        def timed(proc, modality, items, kwargs) -> tuple[float, float, int]:
            gc.collect()
            gc.disable()  # as timeit does: a collection is not the call's work
            try:
                c, w = time.process_time(), time.perf_counter()
                n = call(proc, modality, items, kwargs)
                return time.process_time() - c, time.perf_counter() - w, n
            finally:
                gc.enable()

        for i in range(rounds):
            # One processor per round, made in state B on even rounds and A on odd ones (what its construction
            # leaves behind is then on both sides alike); per case the calls alternate A, B, A, B ... (B first on
            # odd calls), switching the fixes between calls, outside the timed region.
            set_state("B" if i % 2 == 0 else "A")
            proc = make_processor(ckpt)
            for name, modality, items, kwargs in todo:
                r = res[name]
                best = {s: [float("inf"), float("inf")] for s in "AB"}
                try:
                    for state in "AB":
                        set_state(state)
                        try:
                            call(proc, modality, items, kwargs)  # warm: first-call costs not charged to either
                        except Exception as exc:  # noqa: BLE001 - e.g. stock refusing a kwarg: reported, not timed
                            r["error"][state] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    if r["error"]:
                        continue
                    for k in range(reps):
                        for state in (("A", "B") if k % 2 == 0 else ("B", "A")):
                            set_state(state)
                            cpu, wall, n = timed(proc, modality, items, kwargs)
                            best[state] = [min(best[state][0], cpu), min(best[state][1], wall)]
                            r["tokens"][state] = n
                    for state in "AB":
                        r[state].append(best[state][0] * 1e3)
                        r[f"{state}_wall"].append(best[state][1] * 1e3)
                except Exception as exc:  # noqa: BLE001
                    r["error"]["A/B"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"[request bench] round {i + 1}/{rounds}", file=sys.stderr, flush=True)
        set_state("A")
        _base.revert(m46)
        import vllm

        return {"vllm": getattr(vllm, "__version__", "?"), "rounds": rounds, "reps": reps, "applied": applied,
                "cases": res}
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))), flush=True)
