"""The tiny checkpoint served by ``vllm serve``: the shared arguments and the request that kills stock vLLM's engine
here."""

from __future__ import annotations

import json
import re

import pytest
from support.hotfix import hotfix
from support.hotfix_log import patched_pids




#: The CPU flags of tests/e2e/test_serve.py (see there why each is needed on CPU).
CPU_ARGS = [
    "--dtype", "bfloat16",
    "--max-model-len", "1024",
    "--enforce-eager",
    "--gpu-memory-utilization", "0.1",
    "--limit-mm-per-prompt", '{"image": 1, "video": 0}',
    "--max-num-seqs", "2",
    "--mamba-ssm-cache-dtype", "float32",
]


SERVE_ARGS = [
    "--dtype", "bfloat16",  # the CPU GDN attention kernels require BF16
    "--max-model-len", "1024",
    "--enforce-eager",
    "--gpu-memory-utilization", "0.1",  # CPU: the KV cache size comes from VLLM_CPU_KVCACHE_SPACE
    "--limit-mm-per-prompt", '{"image": 2, "video": 0}',
    "--max-num-seqs", "2",
    "--mamba-ssm-cache-dtype", "float32",  # the tiny config names none; 0.28's CPU GDN kernel needs float32
    "--no-enable-prefix-caching",  # every answer computed, none served from an earlier prompt's KV
]


def has_serve_flag(field: str) -> bool:
    """Whether the installed vLLM's front-end arguments declare ``field`` (read from its ``cli_args.py`` sources,
    whose module moved between releases; no import)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    root = Path(next(iter(spec.submodule_search_locations))) / "entrypoints"
    return any(f"{field}: bool" in f.read_text(errors="replace") for f in root.rglob("cli_args.py"))


def with_limits(args: list[str], **limits: int) -> list[str]:
    """A copy of the serve arguments ``args`` whose ``--limit-mm-per-prompt`` is ``limits`` (items per modality)."""
    out = list(args)
    out[out.index("--limit-mm-per-prompt") + 1] = json.dumps(limits)
    return out


# 0.32+ refuse per-request mm_processor_kwargs unless the operator trusts the clients; the requests here need them.
if has_serve_flag("trust_request_mm_kwargs"):
    SERVE_ARGS.append("--trust-request-mm-kwargs")
#: /pause and /resume are development endpoints.
SERVER_EXTRA_ENV = {"VLLM_SERVER_DEV_MODE": "1"}

WEIGHTS_LOADED = re.compile(r"\((\w+) pid=(\d+)\)[^\n]*Loading weights took")
API_SERVER = re.compile(r"\(APIServer pid=(\d+)\)")

#: Fixes the guard server leaves out (see the module docstring): without them a stock-killing request is left for
#: the guard to refuse.
LEAVE_OUT = ("mm_placeholders",)


def guard_server_fixes() -> tuple[str, ...]:
    """The fixes applied when looking for the request the guard refuses on a server that leaves :data:`LEAVE_OUT`
    out: every fix but those and the guard itself."""
    from vllm_minicpm_hotfix.fixes import names

    return tuple(n for n in names() if n != "placeholder_guard" and n not in LEAVE_OUT)

KILL_SIZE = (224, 224)  # 1 source + 4 slices of 8x8 patches on the tiny checkpoint: 20 pads (16x), 80 (4x)
#: Candidate engine-killing requests, tried in order (the notes' inputs, on the tiny checkpoint's geometry).
KILL_CANDIDATES = ({"max_slice_nums": 1}, {"slice_mode": False}, {"scale_resolution": 56})


def image(width: int, height: int):
    from support.engine import image as make

    return make(width, height)


def find_kill_request(m46, others: tuple[str, ...]) -> tuple[dict, int, int]:
    """``(mm_processor_kwargs, pads, embeddings)`` of the first candidate whose placeholder disagrees with its tensors
    here with the fixes ``others`` applied, measured with vLLM's real processor (pads counted in the prompt it builds)
    and vLLM's real model (rows of the item's vision embeddings). Fails the test if none does."""
    from support.engine import build_model, embed, items_of, model_config, pads_in_prompt, process

    from vllm.multimodal import MULTIMODAL_REGISTRY

    proc = MULTIMODAL_REGISTRY.create_processor(model_config(max_model_len=1024))
    model = build_model(m46)
    seen = []
    with hotfix(m46, "auto", fixes=others):
        for mm_kwargs in KILL_CANDIDATES:
            out = process(proc, {"image": [image(*KILL_SIZE)]}, mm_kwargs)
            pads = pads_in_prompt(proc, out)
            rows = int(embed(model, items_of(out))[0].shape[0])
            seen.append((mm_kwargs, pads, rows))
            if pads != rows:
                return mm_kwargs, pads, rows
    pytest.fail(f"no candidate request disagrees here with the fixes {others} applied ({seen}): the guard has "
                "nothing left to refuse on this release; add a candidate that still does")


def chat_with_image(server):
    """An OpenAI chat completion (the ``openai`` client) with a 64x64 PNG as a base64 data URL (greedy, 8 tokens);
    returns the 200 ``ChatCompletion``."""
    import openai
    from PIL import Image
    from support.server import chat, chat_kwargs

    img = Image.new("RGB", (64, 64))
    img.putdata([(4 * (i % 64), 4 * (i // 64), 128) for i in range(64 * 64)])
    try:
        return chat(server, **chat_kwargs(server, img))
    except openai.APIError as exc:
        raise AssertionError(f"{exc!r}: {getattr(exc, 'body', None)}; log tail:\n{server.log()[-6000:]}") from exc


def assert_patched_where_weights_loaded(server) -> dict:
    """The process that loaded the weights logged the q/k/v patch with its own pid, and it is not the API server."""
    log = server.log()
    api = {int(p) for p in API_SERVER.findall(log)}
    assert api == {server.proc.pid}, f"API server pid(s) in the log {api}, started {server.proc.pid}"
    loaders = {(name, int(pid)) for name, pid in WEIGHTS_LOADED.findall(log)}
    assert len(loaders) == 1, f"expected one 'Loading weights took' line, got {loaders}"
    ((loader_name, loader_pid),) = loaders
    qkv = [int(p) for p in patched_pids(log, "qkv_loader")]
    processor = [int(p) for p in patched_pids(log, "processor_downsample_mode")]
    assert loader_pid != server.proc.pid
    assert loader_pid in qkv, f"no summary line of pid {loader_pid} ({loader_name}) naming qkv_loader; q/k/v patched in {qkv}"
    assert len(qkv) == len(set(qkv)), f"patched twice in one process: {qkv}"
    evidence = {
        "api_server_pid": server.proc.pid,
        "weights_loaded_by": f"{loader_name} pid={loader_pid}",
        "qkv_patched_in": qkv,
        "processor_patched_in": processor,
        "lines": [ln[:220] for ln in log.splitlines() if "vllm-minicpm-hotfix:" in ln or "Loading weights took" in ln],
    }
    print(json.dumps(evidence, indent=1))
    return evidence
