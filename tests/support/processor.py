"""vLLM's own multimodal processing of one image prompt, as its renderer does it."""

from __future__ import annotations

import dataclasses


def vllm_process(proc, img, mm_kwargs: dict):
    """vLLM's own multimodal processing of one image prompt, as its renderer does it (``processor.apply``).

    Returns the ``MultiModalInput`` (``prompt_token_ids``, ``mm_kwargs``, ``mm_placeholders``, ...)."""
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    tok = proc.info.get_tokenizer()
    prompt = tok.encode(f"<|im_start|>user\n{tok.image_token}What is this?<|im_end|>\n", add_special_tokens=False)
    fields = {f.name for f in dataclasses.fields(ProcessorInputs)}
    kwargs = dict(prompt=prompt, mm_data_items=proc.info.parse_mm_data({"image": [img]}),
                  hf_processor_mm_kwargs=dict(mm_kwargs))
    if "tokenization_kwargs" in fields:
        kwargs["tokenization_kwargs"] = {}
    return proc.apply(ProcessorInputs(**kwargs), TimingContext(enabled=False))

