"""The hotfix's loader under tensor parallelism: vLLM's real ``MiniCPMV4_6ViTWindowAttentionSelfAttn`` on two CPU
ranks (gloo), built and loaded by tests/support/tp_rank.py in two processes, against the same module at TP=1 in this one.

* ``--mm-encoder-tp-mode weights`` (the default): rank r's ``qkv_proj`` holds heads [r*h/2, (r+1)*h/2) of q, then of
  k, then of v (vLLM's head-sharded ``QKVParallelLinear`` layout); ``out_proj`` (``RowParallelLinear``) its slice of
  the input dimension and the full bias; the forward output, all-reduced by ``out_proj``, equals the TP=1 output.
* ``--mm-encoder-tp-mode data`` (``is_vit_use_data_parallel()``): full, unsharded tensors on every rank, and each
  rank's output equals the TP=1 output.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import pytest
import torch
from support.hotfix import hotfix
from support.paths import REPO
from support.placement import FULL_ENVS
from support.vllm_build import build_vllm_model, checkpoint_tensors, prepare_for_forward

pytestmark = pytest.mark.placed(*FULL_ENVS)

PREFIX = "model.vision_tower.vit_merger.self_attn."
WORLD = 2
RANK_SCRIPT = REPO / "tests" / "support" / "tp_rank.py"
TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tiny, tmp_path_factory) -> list[dict]:
    """Run both ranks (two processes, a free port, bounded by a timeout); their saved results, by rank."""
    work = tmp_path_factory.mktemp("tp")
    port = free_port()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "PYTHONPATH": "", "OMP_NUM_THREADS": "1"}
    env.pop("VLLM_MINICPM_HOTFIX", None)
    failed = []
    with contextlib.ExitStack() as stack:
        procs = []
        for rank in range(WORLD):
            log = stack.enter_context(open(work / f"rank{rank}.log", "w"))
            cmd = [sys.executable, str(RANK_SCRIPT), str(rank), str(WORLD), str(port), str(tiny),
                   str(work / f"rank{rank}.pt")]
            procs.append(subprocess.Popen(cmd, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT))
        for rank, proc in enumerate(procs):
            try:
                rc = proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                    p.wait()
                rc = "timeout"
            if rc != 0:
                failed.append(rank)
    failed = [f"rank {r} failed:\n{(work / f'rank{r}.log').read_text()[-4000:]}" for r in failed]
    assert not failed, "\n".join(failed)
    return [torch.load(work / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ckpt(tiny) -> dict[str, torch.Tensor]:
    return {k[len(PREFIX):]: v for k, v in checkpoint_tensors(tiny).items() if k.startswith(PREFIX)}


@pytest.fixture(scope="module")
def tp1_output(m46, tiny) -> torch.Tensor:
    """The same forward at TP=1: the whole model built in this process (hotfix forced), its vit_merger post-processed
    as vLLM's loader does, the self-attention run on the ranks' input."""
    from support.tp_rank import fixed_input
    from vllm.config import set_current_vllm_config

    with hotfix(m46, "force"):
        model = build_vllm_model(tiny)
    prepare_for_forward(model, "vit_merger")
    attn = model.vit_merger.self_attn
    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        return attn(fixed_input(attn.embed_dim)).detach().clone()


def head_slice(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of one of q/k/v (heads [r*h/2, (r+1)*h/2))."""
    rows = t.shape[0] // WORLD
    return t[rank * rows:(rank + 1) * rows]


def test_weights_mode_each_rank_holds_its_head_slices(ranks, ckpt):
    for rank, res in enumerate(ranks):
        r = res["weights"]
        assert (r["tp_rank"], r["tp_size"], r["data_parallel"]) == (rank, WORLD, False)
        assert r["loaded"] == ["out_proj.bias", "out_proj.weight", "qkv_proj.bias", "qkv_proj.weight"]
        p = r["params"]
        for s in ("weight", "bias"):
            want = torch.cat([head_slice(ckpt[f"{x}_proj.{s}"], rank) for x in "qkv"])
            assert torch.equal(p[f"qkv_proj.{s}"], want), (rank, s)
        cols = ckpt["out_proj.weight"].shape[1] // WORLD
        assert torch.equal(p["out_proj.weight"], ckpt["out_proj.weight"][:, rank * cols:(rank + 1) * cols])
        assert torch.equal(p["out_proj.bias"], ckpt["out_proj.bias"])  # RowParallelLinear: full bias, added once
    # the two ranks together hold every row exactly once
    w = torch.cat([torch.cat([ranks[r]["weights"]["params"]["qkv_proj.weight"].chunk(3)[i] for r in range(WORLD)])
                   for i in range(3)])
    assert torch.equal(w, torch.cat([ckpt[f"{x}_proj.weight"] for x in "qkv"]))


def test_weights_mode_merged_output_equals_tp1(ranks, tp1_output):
    for rank, res in enumerate(ranks):
        out = res["weights"]["output"]
        assert out.shape == tp1_output.shape
        torch.testing.assert_close(out, tp1_output, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")
    assert torch.equal(ranks[0]["weights"]["output"], ranks[1]["weights"]["output"])  # all-reduced: identical


def test_data_mode_full_tensors_on_every_rank(ranks, ckpt, tp1_output):
    for rank, res in enumerate(ranks):
        r = res["data"]
        assert r["data_parallel"] is True
        p = r["params"]
        for s in ("weight", "bias"):
            assert torch.equal(p[f"qkv_proj.{s}"], torch.cat([ckpt[f"{x}_proj.{s}"] for x in "qkv"])), (rank, s)
            assert torch.equal(p[f"out_proj.{s}"], ckpt[f"out_proj.{s}"]), (rank, s)
        torch.testing.assert_close(r["output"], tp1_output, rtol=1e-5, atol=1e-5, msg=f"rank {rank}")


def test_what_a_forward_without_post_processing_does(ranks):
    """Recorded for docs/what-can-go-wrong.md: vLLM's loader always runs ``process_weights_after_loading`` before a
    forward; on CPU it repacks the linear layers' weights for its kernels (``weight`` becomes empty afterwards)."""
    seen = {res[mode]["forward_without_processing"] for res in ranks for mode in ("weights", "data")}
    print(f"\nforward before process_weights_after_loading: {sorted(seen)}")
    assert seen == {"AttributeError: 'QKVParallelLinear' object has no attribute 'cpu_linear'"}
