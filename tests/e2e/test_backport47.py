"""MiniCPM-V 4.7 on a vLLM release without it (the backport, ``vllm_minicpm_hotfix/backports/``), through real
engines: ``LLM(...)`` and ``vllm serve``, the dense and the MoE (35B-A3B layout) tiny checkpoints transformers writes
(``scripts/make_tiny_checkpoint.py --member 4.7 [--moe]``, the real processor geometry).

* **Stock** (no hotfix): ``LLM(model=...)`` of either checkpoint stops at start-up with ``Model architectures
  ['MiniCPMV4_7ForConditionalGeneration'] are not supported for now``.
* **LLM(...), the plugin route**: the wheel installed with ``pip install --target`` and that folder on
  ``PYTHONPATH``, so no ``.pth`` runs and only vLLM's ``vllm.general_plugins`` entry point activates the hotfix, in
  the driver and in EngineCore (a process of its own); a cold ``VLLM_CACHE_ROOT``, so the driver's architecture
  inspection runs vLLM's registry subprocess, which must import the backport's class (it writes its model info
  cache file only when it did). Both engines serve **videos only** (``limit_mm_per_prompt {"image": 0, "video":
  1}``: stock vLLM's vision tower then stays on the meta device; the hotfix's ``video_tower`` fix builds it): each
  answers a text prompt and videos of 3 and 2 frames (a sliced one), with transformers' prompt ids (no local
  ``<image_id>`` before a 4.7 video). Every EngineCore logs the summary line with "MiniCPM-V 4.7: registered by
  the hotfix".
* **vllm serve, the pip route** (``.pth``), one server per checkpoint for every serving assertion: each process
  (API server, EngineCore, worker) logs "MiniCPM-V 4.7: registered by the hotfix"; the weights are loaded outside
  the API server; the first step's top-5 log-probabilities (``return_tokens_as_token_ids``) of a text prompt and
  five image requests (per-request kwargs too) agree with transformers' float32 ``MiniCPMV4_7ForConditionalGeneration``
  within :data:`support.backport47.LOGPROB_TOLERANCE`, which is below each image request's sensitivity (how far
  another noise image of the same size moves transformers' log-probabilities), on prompts equal to transformers'
  ``MiniCPMV4_7Processor``'s; the greedy token equals transformers' where its top-2 margin is clear; the requests
  that kill stock vLLM's 4.7 engine on 0.32 (``slice_mode: false`` on 449x448, ``scale_resolution: 224`` on 448x448,
  ``use_image_id: false``) are answered 200 with transformers' prompt, bad kwargs get a 400 naming the kwarg, and
  the server stays healthy.

The tolerance, measured 2026-12-02 on these checkpoints and requests through these servers (bf16 engine against
float32 transformers 5.24; 5.19's model gives the same reference): the backport differs by at most 0.023 (dense)
and 0.021 (MoE) on 0.28.0, 0.023 (dense) on 0.24.0; vLLM 0.32.0's own 4.7 classes (with the hotfix, the same test
run there with ``VLLM_MINICPM_HOTFIX_EVERYWHERE=1``) by 0.050-0.067 (dense) and 0.028-0.109 (MoE) on the image
requests, 0.022 / 0.012 on text. 0.32.0 serves a checkpoint transformers writes with sequential positions (its
canvas M-RoPE is off unless the config names it): the backport made to give sequential positions reproduces 0.32.0's
numbers exactly and fails here. Another noise image moves transformers by 0.037-0.154 (dense) and 0.036-0.120 (MoE).

On 0.24.0 on a CPU without AVX-512 (this project's machines) no MoE model runs a forward pass: vLLM's CPU fused MoE
falls back to a torch path that builds a CustomOp outside vLLM's config (``AssertionError: Current vLLM config is not
set``; :func:`support.backport47.cpu_moe_unusable` shows it on vLLM's own function). There the MoE engine and server
are asserted to get exactly that far -- the backport registered in every process, the model built and its weights
loaded, then that error -- and the MoE answers are compared on 0.28.0 only.

Placed on 0.24.0 and 0.28.0 (the two families of 4.6 classes with engines on CPU where the backport applies: 0.24's
hand-written q/k/v loader, 0.28's broken one the hotfix replaces). Engines: one ``LLM(...)`` program (two engines,
one after the other), two ``vllm serve``.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from support.backport47 import (
    CPU_MOE_ERROR, LOGPROB_REQUESTS, LOGPROB_TOLERANCE, PROMPT, Reference, cpu_moe_unusable, judge_first_step,
    noise_image, write_checkpoint,
)
from support.hotfix_log import summaries
from support.programs import run_program
from support.prompt import video
from support.server import HEALTHY_WITHIN_S, chat_body, healthy, post, serving
from support.serving import API_SERVER, SERVE_ARGS, WEIGHTS_LOADED
from support.venvs import clean_env, run_uv

RELEASES = ("0.24.0", "0.28.0")
pytestmark = pytest.mark.placed(*RELEASES)

NOT_SUPPORTED = "Model architectures ['MiniCPMV4_7ForConditionalGeneration'] are not supported for now"
REGISTERED = {"MiniCPM-V 4.7": "registered by the hotfix"}
KINDS = ("dense", "moe")

#: seconds per phase, printed at the end of the module (what each engine / server costs).
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def moe_dead() -> str | None:
    """Why no MoE engine can run a forward pass on this machine with this vLLM (vLLM 0.24's CPU fused MoE without
    its AVX-512 kernel: :func:`support.backport47.cpu_moe_unusable`), or None. Where it says so, the MoE engine and
    server are asserted to show exactly that -- the backport's model built and its weights loaded in the engine's
    worker, then vLLM's own CPU MoE error at the first forward pass -- instead of answering (the precedent of the
    AWQ engine test on a CPU without AVX-512)."""
    import vllm.model_executor.models  # noqa: F401 - vLLM's ops loaded as in an engine

    return cpu_moe_unusable()


def assert_cpu_moe_death(log: str) -> None:
    """The MoE engine got as far as this machine lets it: weights loaded, then vLLM's CPU MoE error."""
    assert CPU_MOE_ERROR in log and "cpu_fused_moe" in log, log[-6000:]
    loaded = [m.start() for m in WEIGHTS_LOADED.finditer(log)]
    assert loaded and loaded[-1] < log.rindex(CPU_MOE_ERROR), log[-6000:]


@pytest.fixture(scope="module", autouse=True)
def _report_times():
    yield
    print("\n\nbackport 4.7 e2e, seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in TIMES.items()))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backport47-e2e")
    return {"dense": write_checkpoint(root / "dense"), "moe": write_checkpoint(root / "moe", "--moe")}


@pytest.fixture(scope="module")
def references(ckpts) -> dict[str, Reference]:
    import torch

    torch.set_num_threads(1)
    return {kind: Reference(path) for kind, path in ckpts.items()}


def engine_spec(ckpts, path: Path, requests: list[dict], limits: dict) -> Path:
    path.write_text(json.dumps({"engines": [
        {"name": kind, "checkpoint": str(ckpts[kind]), "limits": limits, "requests": requests} for kind in KINDS]}))
    return path


def run_engines(python, spec: Path, env: dict, cwd: Path) -> tuple[dict, str]:
    proc = run_program("backport_engine", spec, python=python, env=env, cwd=cwd, timeout=1500, new_session=True,
                       check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"backport_engine exited {proc.returncode}:\n{log[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), log


# --------------------------------------------------------------------------------------------------------------------
# Stock: not supported
# --------------------------------------------------------------------------------------------------------------------


def test_stock_llm_does_not_start(ckpts, tmp_path):
    t0 = time.monotonic()
    spec = engine_spec(ckpts, tmp_path / "spec.json", [], {"image": 1, "video": 0})
    out, log = run_engines(sys.executable, spec, clean_env(PYTHONPATH=""), tmp_path)
    TIMES["stock LLM (no engine starts)"] = time.monotonic() - t0
    assert out["status"] is None and "vllm-minicpm-hotfix" not in log
    for kind in KINDS:
        assert NOT_SUPPORTED in (out["engines"][kind].get("startup_error") or ""), out["engines"][kind]


# --------------------------------------------------------------------------------------------------------------------
# LLM(...): the plugin route, video-only engines
# --------------------------------------------------------------------------------------------------------------------

VIDEO_REQUESTS = [
    {"name": "text", "modality": "text"},
    {"name": "video 120x90x3", "modality": "video", "size": [120, 90], "frames": 3, "seed": 0},
    {"name": "video 700x400x2 sliced", "modality": "video", "size": [700, 400], "frames": 2, "seed": 1},
]


@pytest.fixture(scope="module")
def plugin_target(wheel, tmp_path_factory) -> Path:
    """``pip install --target DIR`` of the wheel: on ``PYTHONPATH`` its ``.pth`` never runs (not a site directory),
    so vLLM's plugin loading (the entry point in its dist-info) is the only activation."""
    target = tmp_path_factory.mktemp("plugin-route") / "target"
    run_uv("pip", "install", "--no-deps", "--python", sys.executable, "--target", str(target), str(wheel))
    return target


@pytest.fixture(scope="module")
def engines(ckpts, plugin_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engines")
    cache = tmp / "vllm-cache"  # cold: the driver inspects the architecture in vLLM's registry subprocess
    spec = engine_spec(ckpts, tmp / "spec.json", VIDEO_REQUESTS, {"image": 0, "video": 1})
    t0 = time.monotonic()
    out, log = run_engines(sys.executable, spec, clean_env(PYTHONPATH=str(plugin_target),
                                                           VLLM_CACHE_ROOT=str(cache)), tmp)
    TIMES["LLM program (2 engines)"] = time.monotonic() - t0
    for kind in KINDS:
        TIMES[f"LLM {kind} engine start"] = out["engines"][kind].get("seconds") or 0
    return out, log, cache


def test_llm_engines_start_through_the_plugin_route(engines, moe_dead):
    out, log, cache = engines
    for kind in KINDS:
        row = out["engines"][kind]
        if kind == "moe" and moe_dead:
            assert "Engine core initialization failed" in row.get("startup_error", ""), row
            assert_cpu_moe_death(log)
            continue
        assert "startup_error" not in row, row
        assert not [r for r in row["results"].values() if "error" in r], row["results"]
    driver = out["status"]
    assert driver["backports"]["minicpmv4_7"]["registered"] is True, driver["backports"]
    lines = summaries(log)
    engine_core = [s for s in lines if s["pid"] != out["pid"]]
    assert len(engine_core) >= 2, [s["line"] for s in lines]  # each engine's EngineCore (and worker)
    assert all(s["backports"] == REGISTERED and s["models"] == ["MiniCPM-V 4.6", "MiniCPM-V 4.7"]
               for s in lines), [s["line"] for s in lines]
    assert ".pth" not in log and "(pth)" not in log
    # The registry subprocess imported the backport's class: vLLM caches the model info it returned.
    infos = list((cache / "modelinfos").glob("vllm_minicpm_hotfix-backports-models-minicpmv4_7-*.json"))
    assert len(infos) == 1, sorted(p.name for p in (cache / "modelinfos").glob("*"))
    assert json.loads(infos[0].read_text())["modelinfo"]["supports_multimodal"] is True


@pytest.mark.parametrize("kind", KINDS)
def test_video_only_engine_answers_videos_with_transformers_prompt(engines, references, kind, moe_dead):
    out, log, _ = engines
    if kind == "moe" and moe_dead:
        assert out["engines"][kind]["results"] == {}
        assert_cpu_moe_death(log)
        return
    results = out["engines"][kind]["results"]
    hf = references[kind].processor
    id_start = hf.tokenizer.convert_tokens_to_ids("<image_id>")
    for req in VIDEO_REQUESTS:
        got = results[req["name"]]
        assert got["token_ids"], got
        if req["modality"] != "video":
            continue
        frames = video(*req["size"], req["frames"], req["seed"])
        want = hf(text=[PROMPT.format(mm=hf.video_token)], videos=[frames], do_sample_frames=False)
        assert got["prompt_token_ids"] == want["input_ids"][0].tolist(), req["name"]
        assert id_start not in got["prompt_token_ids"]


# --------------------------------------------------------------------------------------------------------------------
# vllm serve: the pip route, one server per checkpoint
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=KINDS)
def server(request, pip_env, ckpts, tmp_path_factory, moe_dead):
    """One ``vllm serve`` per checkpoint; ``srv.dead`` is True where the MoE server cannot start on this machine
    (:func:`moe_dead`: it then has exited)."""
    kind = request.param
    tmp = tmp_path_factory.mktemp(f"serve-{kind}")
    t0 = time.monotonic()
    with serving(pip_env, clean_env(PYTHONPATH=""), tmp, f"backport47-{kind}", SERVE_ARGS, model=ckpts[kind]) as srv:
        srv.kind, srv.dead = kind, bool(kind == "moe" and moe_dead)
        assert srv.wait_healthy(HEALTHY_WITHIN_S) is not srv.dead, srv.log()[-6000:]
        TIMES[f"serve {kind} {'exited' if srv.dead else 'healthy'}"] = time.monotonic() - t0
        yield srv
    TIMES[f"serve {kind} in all"] = time.monotonic() - t0


def test_every_server_process_registers_4_7(server):
    log = server.log()
    lines = summaries(log)
    pids = {s["pid"] for s in lines}
    api = {int(p) for p in API_SERVER.findall(log)}
    loaders = {int(pid) for _, pid in WEIGHTS_LOADED.findall(log)}
    assert api == {server.proc.pid} and api <= pids, (api, pids)
    assert loaders and loaders <= pids - api, (loaders, pids)  # weights loaded outside the API server, hook there
    assert all(s["backports"] == REGISTERED for s in lines), [s["line"] for s in lines]


def chat_prompt(hf, img, text: str) -> str:
    content = ([{"type": "image"}] if img is not None else []) + [{"type": "text", "text": text}]
    return hf.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)


def ask(server, img, kwargs: dict | None, text: str = "What is in the image?") -> tuple[int, dict]:
    if img is None:
        body = {"model": server.model, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
                "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    else:
        body = chat_body(server, img, text=text, mm_processor_kwargs=kwargs or None, max_tokens=4)
    body.update(logprobs=True, top_logprobs=5, return_tokens_as_token_ids=True, return_token_ids=True)
    return post(server, "/v1/chat/completions", body)


def first_step(reply: dict) -> dict[int, float]:
    top = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    return {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in top}


def test_first_step_logprobs_agree_with_transformers(server, references):
    if server.dead:
        return assert_cpu_moe_death(server.log())
    ref = references[server.kind]
    text = "What is in the image?"
    rows, problems = [], []
    for name, (size, kwargs, seed) in LOGPROB_REQUESTS.items():
        img = noise_image(*size, seed) if size else None
        status, reply = ask(server, img, kwargs, text)
        assert status == 200, (name, status, json.dumps(reply)[:1500], server.log()[-4000:])
        prompt = chat_prompt(ref.processor, img, text)
        assert reply["prompt_token_ids"] == ref.ids(prompt, img, kwargs), name
        row, found = judge_first_step(ref, name, prompt, img, kwargs, first_step(reply),
                                      reply["choices"][0]["token_ids"][0], LOGPROB_TOLERANCE)
        rows.append(row)
        problems += found
    print(f"\n{server.kind}: " + "; ".join(rows))
    assert not problems, problems


#: name -> ((width, height), mm_processor_kwargs): what kills stock vLLM 0.32's 4.7 engine or is ignored by it.
STOCK_KILLERS = {
    "slice_mode false 449x448": ((449, 448), {"slice_mode": False}),
    "scale_resolution 224 448x448": ((448, 448), {"scale_resolution": 224}),
    "use_image_id false 300x200": ((300, 200), {"use_image_id": False}),
}
#: kwargs -> what the 400's message must name.
BAD = [({"slice_mode": "false"}, "slice_mode"), ({"scale_resolution": 13}, "scale_resolution"),
       ({"downsample_mode": "2x"}, "downsample_mode"), ({"patch_size": 7}, "patch_size")]


def test_no_request_kills_the_engine(server, references):
    if server.dead:
        return assert_cpu_moe_death(server.log())
    ref = references[server.kind]
    text = "What is in the image?"
    for name, ((w, h), kwargs) in STOCK_KILLERS.items():
        img = noise_image(w, h, 7)
        status, reply = ask(server, img, kwargs, text)
        assert status == 200, (name, status, json.dumps(reply)[:1500])
        assert reply["prompt_token_ids"] == ref.ids(chat_prompt(ref.processor, img, text), img, kwargs), name
    for kwargs, key in BAD:
        status, reply = ask(server, noise_image(224, 224, 8), kwargs, text)
        message = json.dumps(reply)
        assert status == 400 and re.search(rf"\b{key}\b", message), (kwargs, status, message[:1500])
    assert healthy(server)
    status, _ = ask(server, noise_image(640, 480, 9), {}, text)
    assert status == 200
