"""``mm_placeholders`` on the installed vLLM's own multimodal processor (no engine): requests processed at once in
several threads each get their own request's prompt, and a subclass of vLLM's classes that no family member owns
keeps vLLM's own placeholder. The prompt equal to transformers' for every size, kwarg and item (with every fix) is
tests/prompt/test_prompt_conformance.py."""

from __future__ import annotations

from support.hotfix import hotfix
from support.prompt import (  # noqa: F401 - fixtures
    checkpoints, image, video, vllm_ids, hf_ids, pairs, _one_torch_thread, _report_times, timed, with_hotfix,
)


def test_concurrent_requests(m46, pairs):
    """Threads processing requests with different kwargs at once on one vLLM processor (as a shared server does)
    each get their own request's prompt: the request reaches the text producers through a ContextVar.

    Deterministically concurrent: the first time each thread's placeholder producer asks vLLM's
    ``InputProcessingContext.get_hf_processor`` for transformers' processor -- after the fix has set that thread's
    request, before the producer reads it -- it waits at a barrier until all four threads are there. So every request
    is set before any is read; a request held in a process-wide variable would give three threads another request's
    prompt (checked: such a variant of ``_mm_prompt.REQUEST`` fails here, this one passes)."""
    import threading

    from vllm_minicpm_hotfix.fixes import _mm_prompt as mp

    pair = pairs("real")
    jobs = [
        ("image", [image(449, 448)], {"slice_mode": False}),
        ("image", [image(449, 448)], {"max_slice_nums": 1, "use_image_id": False}),
        ("image", [image(900, 300)], {"scale_resolution": 224}),
        ("video", [video(700, 400, 2)], {"max_slice_nums": 2}),
    ]
    ctx = pair.vllm.info.ctx
    own = ctx.get_hf_processor
    barrier = threading.Barrier(len(jobs), timeout=60)
    met: set[int] = set()

    def get_hf_processor(*args, **kwargs):
        me = threading.get_ident()
        if mp.current() is not None and me not in met:  # inside a replacement: this thread's request is set
            met.add(me)
            barrier.wait()
        return own(*args, **kwargs)

    with timed("concurrent"), with_hotfix(m46):
        want = [hf_ids(pair, m, items, kw) for m, items, kw in jobs]
        errors: list = []

        def worker(i: int) -> None:
            try:
                for _ in range(2):
                    m, items, kw = jobs[i]
                    assert vllm_ids(pair, m, items, kw) == want[i], (i, kw)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
        object.__setattr__(ctx, "get_hf_processor", get_hf_processor)  # vLLM's context is a frozen dataclass
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
        finally:
            object.__delattr__(ctx, "get_hf_processor")
    assert not any(t.is_alive() for t in threads), "a request thread did not finish in 300 s"
    assert not errors, errors
    assert len(met) == len(jobs) and not barrier.broken, "the four requests were not in their producers together"


def test_subclasses_keep_vllm_behaviour(m46):
    """A subclass of vLLM's 4.6 classes that no family member owns (defined here, not in vLLM's 4.6 / 4.7 modules)
    gets vLLM's own placeholder, fix applied or not (tests/registry/test_family.py covers every fix)."""
    from vllm.multimodal.parse import ImageSize

    from vllm_minicpm_hotfix.fixes import _stand_ins
    from vllm_minicpm_hotfix.fixes._proxies import ModeDefaultingImageProcessor

    info_cls = getattr(m46, "MiniCPMV4_6ProcessingInfo")
    sub = type("SubInfo", (info_cls,), {})
    native = _stand_ins.hf_processor()
    stand_in = _stand_ins.info(sub, native, image_processor=ModeDefaultingImageProcessor(native.image_processor))
    own = info_cls.get_slice_image_placeholder(stand_in, ImageSize(130, 82))
    with hotfix(m46, "force", fixes=("mm_placeholders",)):
        assert sub.get_slice_image_placeholder(stand_in, ImageSize(130, 82)) == own
        fixed = info_cls.get_slice_image_placeholder(_stand_ins.info(info_cls, native), ImageSize(130, 82))
    assert fixed.count("<|image_pad|>") == 4  # transformers' count for 130x82 at scale 112 (vLLM 0.22-0.23: 6)
