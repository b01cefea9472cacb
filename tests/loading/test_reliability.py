"""Every failure mode gets one clear outcome, nothing silent. docs/what-can-go-wrong.md is the table.

Three parts, all on the real vLLM of this environment (CPU):

1. **Bad checkpoints**, each a small copy of the bundled tiny checkpoint with one thing wrong, loaded the way vLLM's
   start-up loads them: ``get_model_loader(load_config).load_model(...)`` -- vLLM's ``DefaultModelLoader``: its own
   safetensors iterator (``model.safetensors.index.json`` handling included), the model's ``load_weights``, its
   "weights not initialized" check. With the hotfix's loader active (``force`` on every release, ``auto`` where the
   release is broken) each one raises one ``ValueError`` (``QKVLoadError``) naming the tensor / shard (and both shapes
   where relevant). ``load_model`` then returns nothing: the worker's model runner never gets a model, so the engine
   start-up aborts with that exception -- a half-loaded model cannot reach a caller. Every fix of the registry is
   applied as the hook applies it. Under ``auto`` on a release whose own q/k/v loading is correct the loader stays out
   of the way and vLLM's own loading runs, watched by the completeness guard (fixes/qkv_completeness_guard.py): a missing shard
   raises the same ``QKVLoadError``; the other cases are what stock vLLM does (docs/what-can-go-wrong.md says which
   stay silent). tests/fixes/test_qkv_completeness_guard.py runs a light subset of these on every release.
2. **Hostile environments** in fresh interpreters (real start-up, real import of vLLM's model module): the hook's own
   code raising, the module imported before ``install()``, ``importlib.reload``, two threads importing at once, an
   unknown ``VLLM_MINICPM_HOTFIX``, a vLLM layout the code does not recognise.
3. **Activation paths** (plugin / ``.pth`` / sitecustomize bundle; helpers reused from tests/e2e and
   tests/activation/test_activation.py): wrapt missing, vLLM missing, ``python -I/-E/-S``, ``VLLM_PLUGINS`` without ours.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.hotfix import hotfix
from support.placement import FULL_ENVS
from support.venvs import clean_env, overlay_env, pip_install, site_packages
from support.hotfix_log import patched_pids, summaries
from support.programs import PROGRAMS, run_reporting
from support.vllm_build import build_vllm_model, checkpoint_tensors, iter_checkpoint, make_vllm_config

from vllm_minicpm_hotfix.fixes.qkv_loader import QKVLoadError
from support.bad_checkpoints import (
    P, QKV, base, CHECKPOINTS, bad, start_up_fails, load_like_vllm, reference, assert_model_equals, hotfix_active,
)

pytestmark = pytest.mark.placed(*FULL_ENVS)
#: The fresh interpreters of parts 2 and 3 that exercise the hook's own machinery (its code raising, reload, threads,
#: an unknown mode, wrapt missing, ``VLLM_PLUGINS``): what they check does not depend on the release's verdicts, only
#: on a real vLLM importing the module, so each runs on one release (one whose q/k/v loading is broken, so the hook has
#: something to patch), not on both of FULL_ENVS: one vLLM import costs ~15-20 s of a CI run.
ONE_RELEASE = pytest.mark.placed("0.26.0")

ATTN = "MiniCPMV4_6ViTWindowAttentionSelfAttn"
MODEL = "MiniCPMV4_6ForConditionalGeneration"


# ====================================================================================================================
# 1. Bad checkpoints
# ====================================================================================================================


MODES = ["force", "auto"]


# --- missing shards ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_missing_k_proj_weight(m46, expected, bad, mode):
    ckpt = bad("missing_k_weight")
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            # vLLM >= 0.30 renames q/k/v to qkv_proj.* (+ tensor.shard_id) before the module sees them.
            assert re.fullmatch(
                r"vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                r"vit_merger\.self_attn\.qkv_proj\.weight: shard\(s\) 'k' missing \(received 'q' from "
                r"'q_proj\.weight( \(renamed by vLLM to qkv_proj\.weight\))?', 'v' from 'v_proj\.weight( \(renamed by vLLM to qkv_proj\.weight\))?'\)",
                str(exc),
            ), str(exc)
        else:
            # auto on a release whose own loading is correct: vLLM loads it, and the completeness guard refuses it
            # (stock vLLM alone is silent: the k rows keep uninitialised memory; tests/fixes/test_qkv_completeness_guard.py shows it).
            exc = start_up_fails(ckpt, QKVLoadError)
            assert str(exc) == (
                "vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                "vit_merger.self_attn.qkv_proj.weight: shard(s) 'k' missing (received 'q', 'v')"
            ), str(exc)


@pytest.mark.parametrize("mode", MODES)
def test_missing_v_proj_bias(m46, expected, bad, mode):
    ckpt = bad("missing_v_bias")
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            assert re.fullmatch(
                r"vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                r"vit_merger\.self_attn\.qkv_proj\.bias: shard\(s\) 'v' missing \(received 'k' from "
                r"'k_proj\.bias( \(renamed by vLLM to qkv_proj\.bias\))?', 'q' from 'q_proj\.bias( \(renamed by vLLM to qkv_proj\.bias\))?'\)",
                str(exc),
            ), str(exc)
        else:  # the completeness guard (auto on a correct release)
            exc = start_up_fails(ckpt, QKVLoadError)
            assert str(exc) == (
                "vit_merger q/k/v incomplete, the fused qkv_proj would be left partly uninitialised: "
                "vit_merger.self_attn.qkv_proj.bias: shard(s) 'v' missing (received 'k', 'q')"
            ), str(exc)


# --- a shard twice: two files of one set --------------------------------------------------------------------------


def test_vllm_iterator_yields_a_tensor_listed_in_two_files_twice(bad):
    """The index maps each name to one file, but vLLM only uses it to pick files; it then yields every tensor of
    every picked file -- so a tensor present in two files arrives twice."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    ckpt = bad("duplicate_across_files")
    vc = make_vllm_config(ckpt)
    with set_current_vllm_config(vc):
        names = [n for n, _ in get_model_loader(vc.load_config).get_all_weights(vc.model_config, None)]
    for p in QKV:
        assert names.count(f"{P}{p}_proj.weight") == 2
    assert names.count(f"{P}q_proj.bias") == 1


@pytest.mark.parametrize("mode", MODES)
def test_qkv_twice_across_two_files(m46, expected, bad, mode):
    """The two copies reach the self-attention in two separate ``load_weights`` calls (vLLM groups consecutive names
    only); the model-level load session sees both."""
    ckpt = bad("duplicate_across_files")
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            assert re.fullmatch(
                r"vit_merger q/k/v: shard 'k' of vit_merger\.self_attn\.qkv_proj\.weight arrived twice in one load "
                r"\(from checkpoint tensors 'k_proj\.weight( \(renamed by vLLM to qkv_proj\.weight\))?' and 'k_proj\.weight( \(renamed by vLLM to qkv_proj\.weight\))?'\); a checkpoint must "
                r"hold each of q_proj, k_proj, v_proj once",
                str(exc),
            ), str(exc)
        else:
            # vLLM's own loading: the second copy overwrites the first (identical here, so the result is exact).
            model = load_like_vllm(ckpt)
            assert_vit_merger_exact(model, checkpoint_tensors_multi(ckpt))


def checkpoint_tensors_multi(ckpt: Path) -> dict[str, torch.Tensor]:
    """Name -> tensor over all files, the last copy winning (what vLLM's own loading keeps)."""
    return dict(iter_checkpoint(ckpt))


def assert_vit_merger_exact(model, tensors: dict[str, torch.Tensor], prefix: str = P) -> None:
    attn = model.vit_merger.self_attn
    for s in ("weight", "bias"):
        if f"{prefix}q_proj.{s}" in tensors:
            want = torch.cat([tensors[f"{prefix}{p}_proj.{s}"] for p in QKV])
        else:
            want = tensors[f"{prefix}qkv_proj.{s}"]
        assert torch.equal(getattr(attn.qkv_proj, s).detach(), want.to(torch.float32)), f"qkv_proj.{s}"
        assert torch.equal(getattr(attn.out_proj, s).detach(), tensors[f"{prefix}out_proj.{s}"].float())


# --- wrong shape ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_q_proj_wrong_shape(m46, expected, bad, base, mode):
    ckpt = bad("wrong_q_shape")
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            assert re.fullmatch(  # vLLM >= 0.30 hands it over already renamed to qkv_proj.weight (shard_id 'q')
                r"checkpoint tensor vit_merger\.self_attn\.q_proj\.weight( \(renamed by vLLM to qkv_proj\.weight\))? "
                r"-> vit_merger\.self_attn\.qkv_proj\.weight \(shard 'q'\): checkpoint shape \[65, 64\] but "
                r"vit_merger\.self_attn\.qkv_proj\.weight needs \[64, 64\] for this shard \(parameter shape on this "
                r"rank \[192, 64\]\)",
                str(exc),
            ), str(exc)
        else:
            # vLLM's own QKVParallelLinear loader narrows the oversized shard to its first 64 rows: silently wrong.
            model = load_like_vllm(ckpt)
            w = model.vit_merger.self_attn.qkv_proj.weight.detach()
            bad_q = CHECKPOINTS["wrong_q_shape"](base)[P + "q_proj.weight"]
            assert torch.equal(w[:64], bad_q[:64])


# --- another dtype ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_bf16_checkpoint_into_float32_model_is_cast_like_vllm(m46, bad, reference, mode):
    """A bf16 checkpoint into a float32 model (``dtype="float32"``): vLLM casts on copy; every parameter equals the
    float32 reference rounded through bf16, bit for bit -- the hotfix's loader included."""
    ckpt = bad("bf16")
    with hotfix(m46, mode, fixes=None):
        model = load_like_vllm(ckpt)
    assert model.vit_merger.self_attn.qkv_proj.weight.dtype == torch.float32
    assert_model_equals(model, reference, cast=torch.bfloat16)
    assert_vit_merger_exact(model, checkpoint_tensors(ckpt))


# --- unknown tensor ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["weight", "bias"])
@pytest.mark.parametrize("mode", MODES)
def test_unknown_tensor_under_vit_merger_self_attn(m46, expected, release, bad, mode, suffix):
    ckpt = bad(f"unknown_{suffix}")
    shape = "[64, 64]" if suffix == "weight" else "[64]"
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            assert str(exc) == (
                f"vit_merger: checkpoint tensor 'vit_merger.self_attn.z_proj.{suffix}' (shape {shape}) matches no "
                f"parameter of {ATTN}; its parameters are ['out_proj.bias', 'out_proj.weight', 'qkv_proj.bias', "
                f"'qkv_proj.weight']"
            ), str(exc)
        elif release == "0.24.0":
            # 0.22-0.24's hand-written loop skips names it does not know: ignored, the rest loads exactly.
            model = load_like_vllm(ckpt)
            assert_vit_merger_exact(model, checkpoint_tensors(ckpt))
        else:
            # 0.30+: vLLM's AutoWeightsLoader raises its own ValueError.
            exc = start_up_fails(ckpt, ValueError)
            assert str(exc).startswith(
                f"There is no module or parameter named 'vit_merger.self_attn.z_proj' in {MODEL}"
            ), str(exc)


def test_unknown_tensor_message_quotes_the_whole_name(m46, tiny):
    from vllm_minicpm_hotfix.fixes.qkv_loader import load_weights

    attn = build_vllm_model(tiny, load=False).vit_merger.self_attn
    with pytest.raises(QKVLoadError) as info:
        load_weights(attn, iter([("z_proj.weight", torch.ones(64, 64))]))
    assert "checkpoint tensor 'vit_merger.self_attn.z_proj.weight' (shape [64, 64])" in str(info.value)


# --- truncated file ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["truncated", "truncated_second_shard"])
@pytest.mark.parametrize("mode", MODES)
def test_truncated_safetensors_file(m46, bad, mode, name):
    """safetensors validates a file's header against its size when vLLM opens it: ``SafetensorError`` (not a
    ``ValueError``, and without the file's name), raised by vLLM's iterator before any tensor of that file is
    yielded. For the second file of a set the first file's tensors are already in the model -- but ``load_model``
    raises, so nobody gets that model."""
    from safetensors import SafetensorError

    ckpt = bad(name)
    with hotfix(m46, mode, fixes=None):
        exc = start_up_fails(ckpt, SafetensorError)
    assert str(exc) == "Error while deserializing header: incomplete metadata, file not fully covered"


# --- fused checkpoints ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_case04_fused_only_checkpoint_loads_exact(m46, bad, reference, mode):
    """case-04: the vit_merger holds only a fused ``qkv_proj.{weight,bias}``: bit-exact under auto and force."""
    ckpt = bad("fused_only")
    with hotfix(m46, mode, fixes=None):
        model = load_like_vllm(ckpt)
    assert_model_equals(model, reference)
    assert_vit_merger_exact(model, checkpoint_tensors(ckpt))


@pytest.mark.parametrize("mode", MODES)
def test_fused_and_split_both_present(m46, expected, bad, reference, mode):
    """Decision: a file set with the fused tensor AND the split ones is refused -- every shard would arrive twice,
    and the loader cannot know which copy is meant."""
    ckpt = bad("fused_and_split")
    with hotfix(m46, mode, fixes=None):
        if hotfix_active(mode, expected):
            exc = start_up_fails(ckpt, QKVLoadError)
            assert re.fullmatch(
                r"vit_merger q/k/v: shard 'k' of vit_merger\.self_attn\.qkv_proj\.bias arrived twice in one load "
                r"\(from checkpoint tensors 'k_proj\.bias( \(renamed by vLLM to qkv_proj\.bias\))?' and 'qkv_proj\.bias'\); a checkpoint must hold each "
                r"of q_proj, k_proj, v_proj once",
                str(exc),
            ), str(exc)
        else:
            # vLLM's own loading writes both, the later one wins (identical here, so exact).
            model = load_like_vllm(ckpt)
            assert_model_equals(model, reference)


# --- older prefixes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_old_prefixes_load_exact(m46, bad, reference, mode):
    """``model.vpm.`` / ``model.vit_merger.`` instead of ``model.vision_tower.`` / ``model.vision_tower.vit_merger.``
    (both in vLLM's own mapper): bit-exact, every parameter."""
    ckpt = bad("old_prefixes")
    with hotfix(m46, mode, fixes=None):
        model = load_like_vllm(ckpt)
    assert_model_equals(model, reference)
    assert_vit_merger_exact(model, checkpoint_tensors(ckpt), prefix="model.vit_merger.self_attn.")


# --- no q/k/v at all --------------------------------------------------------------------------------------------------


def test_no_qkv_at_all_stock_vllm_leaves_it_unloaded(m46, bad):
    """Stock vLLM, every release: a checkpoint without the vit_merger q/k/v loads "successfully" -- vLLM's strict
    check exempts linear layers -- and ``qkv_proj`` keeps whatever it held (random memory in a real start-up)."""
    ckpt = bad("no_qkv")
    model = load_like_vllm(ckpt)
    qkv = model.vit_merger.self_attn.qkv_proj
    assert torch.equal(qkv.weight.detach(), torch.full_like(qkv.weight, -7.0))
    assert torch.equal(qkv.bias.detach(), torch.full_like(qkv.bias, -7.0))


@pytest.mark.parametrize("mode", MODES)
def test_no_qkv_at_all_hotfix_says_never_loaded(m46, expected, bad, mode):
    """The q/k/v loader where it is active, the completeness guard under auto on a correct release: the same text."""
    ckpt = bad("no_qkv")
    with hotfix(m46, mode, fixes=None):
        exc = start_up_fails(ckpt, QKVLoadError)
    assert str(exc) == (
        "vit_merger q/k/v never loaded: ['vit_merger.self_attn.qkv_proj.weight', "
        "'vit_merger.self_attn.qkv_proj.bias'] received no q_proj/k_proj/v_proj (or qkv_proj) tensor from "
        "the checkpoint and would keep uninitialised values"
    ), str(exc)


def test_load_model_hands_out_nothing_on_failure(m46, bad, monkeypatch):
    """How "not half-loaded in a usable way" holds: the only thing that would hand the model on is the return of
    ``load_model``; with the error raised inside it, vLLM's worker (``model_runner.load_model``) propagates it and
    the engine start-up aborts. Here: post-processing, the step after loading, never runs."""
    from vllm.model_executor.model_loader import base_loader

    ran = []
    real = base_loader.process_weights_after_loading
    monkeypatch.setattr(base_loader, "process_weights_after_loading", lambda *a, **k: ran.append(1) or real(*a, **k))
    with hotfix(m46, "force"):
        start_up_fails(bad("missing_k_weight"), QKVLoadError)
    assert ran == []


# ====================================================================================================================
# 2. Hostile environments (fresh interpreters; each imports vLLM's model module: ~30 s)
# ====================================================================================================================


def fresh(program: str, tmp_path: Path, *, pythonpath: str = "", **env: str) -> tuple[dict, str]:
    """Run ``tests/programs/<program>.py`` in a new interpreter of this environment (the program puts this repository
    first on ``sys.path``; nothing activated, cwd a temp folder); returns the JSON object it prints last and
    everything it wrote."""
    return run_reporting(program, env=clean_env(PYTHONPATH=pythonpath, **env), cwd=tmp_path, timeout=300)


@ONE_RELEASE
def test_hook_raising_leaves_vllm_importable_and_unpatched(tmp_path):
    """The hotfix's own patching raises (force, so it runs on every release): vLLM's module still imports, nothing
    of the failed fix is patched, one warning names the failure, ``status()`` records it. The other fixes run on
    their own: where the completeness guard applies (vLLM's own q/k/v loading correct), the model's ``load_weights``
    is the guard's wrapper around vLLM's, not the loader's."""
    out, log = fresh("hook_raises", tmp_path, VLLM_MINICPM_HOTFIX="force")
    fix = out["status"]["fixes"]["qkv_loader"]
    assert fix["verdict"] == "error" and fix["applied"] is False
    assert fix["error"] == "RuntimeError: synthetic failure inside a fix"
    guarded = out["status"]["fixes"]["qkv_completeness_guard"]["applied"]
    assert not out["attn_patched"]
    assert out["model_patched_by"] == ("qkv_completeness_guard" if guarded else None), out
    assert out["wrapped"] is guarded
    if not guarded:
        assert out["model_load_weights"] == f"{MODEL}.load_weights"
    assert log.count("vllm-minicpm-hotfix: the post-import hook failed (qkv_loader), vLLM left unpatched: "
                     "synthetic failure inside a fix") == 1
    assert not patched_pids(log, "qkv_loader")


@ONE_RELEASE
def test_module_imported_before_install_then_reloaded(tmp_path):
    """``install()`` after vLLM imported the module patches at once. ``importlib.reload`` then re-executes the
    module: new, unpatched classes, and wrapt does not fire the hook again (it drops a hook once it has fired) --
    while ``status()`` still says applied. Reported as a gap in hook.py (see docs/what-can-go-wrong.md)."""
    out, log = fresh("import_then_reload", tmp_path, VLLM_MINICPM_HOTFIX="force")
    assert out["installed"] is True and out["at_once"] is True
    assert out["same_module"] and out["new_class"]
    assert out["old_still_patched"] is True
    # What actually happens after the reload (documented, not endorsed):
    assert out["new_patched"] is False and out["new_model_patched"] is False
    assert out["install_again"] is False  # install() is idempotent and does not re-apply
    assert out["registry_class_patched"] is False  # vLLM would now build the unpatched class
    assert out["status_applied"] is True  # stale: the record still says applied
    assert len(patched_pids(log, "qkv_loader")) == 1


@ONE_RELEASE
def test_two_threads_importing_the_module_patch_once(tmp_path):
    out, log = fresh("two_threads_import", tmp_path, VLLM_MINICPM_HOTFIX="force")
    assert out["errors"] == [] and out["alive"] == [] and out["modules"] == 2 and out["same"]
    assert len(out["calls"]) == 1, out  # the hook ran once
    assert len(out["applied"]) == 1, out  # the classes were patched once
    assert out["patched"]
    assert len(patched_pids(log, "qkv_loader")) == 1


@ONE_RELEASE
def test_unknown_mode_value_means_auto_with_one_warning(tmp_path, expected):
    out, log = fresh("install_and_import", tmp_path, VLLM_MINICPM_HOTFIX="sometimes")
    st = out["status"]
    assert st["mode"] == "auto"
    assert st["notes"] == ["VLLM_MINICPM_HOTFIX='sometimes' is not one of auto, force, off; using auto"]
    warning = "vllm-minicpm-hotfix: VLLM_MINICPM_HOTFIX='sometimes' is not one of auto, force, off; using auto"
    assert sum(warning in line for line in log.splitlines() if not line.startswith("{")) == 1, log[-3000:]
    assert st["fixes"]["qkv_loader"]["verdict"] == expected[0]
    assert out["patched"] is (expected[0] == "broken")


#: A stand-in ``vllm`` package whose model module has the model class and no window-attention class.
UNKNOWN_LAYOUT = PROGRAMS / "unknown_layout"


@pytest.mark.parametrize("mode", ["auto", "force"])
def test_unrecognised_vllm_layout_real_interpreter(tmp_path, mode):
    """A stand-in ``vllm`` package (first on PYTHONPATH) whose model module lacks the self-attention class: the
    hook runs, skips with one warning per fix, and leaves the module alone -- also under force."""
    out, log = fresh("install_and_import", tmp_path, pythonpath=str(UNKNOWN_LAYOUT), VLLM_MINICPM_HOTFIX=mode)
    fix = out["status"]["fixes"]["qkv_loader"]
    assert fix["verdict"] == "unrecognised" and fix["applied"] is False
    assert out["untouched"]
    lines = [line for line in log.splitlines() if line.startswith("vllm-minicpm-hotfix:")]
    # one warning line for the process (Python's last-resort handler prints WARNING and above: the reasons, at INFO,
    # are not shown), naming what the record says: nothing applied under auto (force applies the fixes whose probe
    # found their target), the others left alone as "could not tell"
    from vllm_minicpm_hotfix.fixes import names

    assert len(lines) == 1, log
    (summary,) = summaries(log)
    assert summary["line"] == lines[0] and summary["vllm"] == "9.9.9" and summary["mode"] == mode
    rec = out["status"]["fixes"]
    applied = [n for n in names() if rec[n]["applied"]]
    assert summary["applied"] == applied and (mode == "force" or applied == []), log
    # Not "could not tell": video_loader judges vLLM's serving code, which this stand-in has none of (correct, not
    # applicable), canvas_mrope finds no 4.7 class with a canvas M-RoPE (nothing to correct: correct, not
    # applicable), and quantized_vision waits for the first model built with a quant config (deferred).
    others = {n: rec[n]["verdict"] for n in names() if n not in applied and n not in summary["could_not_tell"]}
    assert others == {"video_loader": "correct", "canvas_mrope": "correct", "quantized_vision": "deferred"}, (
        others, log)
    assert not rec["video_loader"]["applied"] and not rec["canvas_mrope"]["applied"]
    assert rec["quantized_vision"]["first_use"]
    assert all(rec[n]["verdict"] in ("unrecognised", "undetermined") for n in summary["could_not_tell"])
    assert out["status"]["fixes"]["qkv_completeness_guard"]["why"].startswith("layout not recognised")
    assert "torch" not in out["names"] and "Traceback" not in log


# ====================================================================================================================
# 3. Activation paths (vllm_minicpm_hotfix/_bootstrap.py, plugin.py, cli/bundle.py, sitecustomize.py)
# ====================================================================================================================


@pytest.fixture(scope="module")
def pip_env_no_wrapt(work, wheel) -> Path:
    """The wheel installed with --no-deps into an environment without wrapt (a broken install)."""
    python = overlay_env(work / "pip-env-no-wrapt", wrapt=False)
    pip_install(python, str(wheel))
    return python


def armed(python, tmp_path, *args: str, pythonpath: str = "") -> dict:
    out, _ = run_reporting("armed", python=python, flags=args, env=clean_env(PYTHONPATH=pythonpath), cwd=tmp_path,
                           timeout=60)
    return out


@ONE_RELEASE
def test_pip_route_without_wrapt_says_so_and_vllm_still_imports(pip_env_no_wrapt, tmp_path):
    """pip route, wrapt missing (installed with --no-deps, or uninstalled later): ``import vllm`` works, the hook is
    not installed, and one warning says why."""
    out, log = run_reporting("import_vllm", python=pip_env_no_wrapt, env=clean_env(), cwd=tmp_path)
    assert out["status"]["hook_installed"] is False and out["activations"] == [] and out["wrapt"] is None
    lines = [line for line in log.splitlines() if "could not activate (pth)" in line]
    assert len(lines) == 1, log
    assert re.search(r"vllm-minicpm-hotfix: could not activate \(pth\) in pid \d+, vLLM left unpatched: "
                     r"ModuleNotFoundError: No module named 'wrapt'", lines[0]), lines[0]


@ONE_RELEASE
def test_bundle_route_without_wrapt_uses_its_copy(bundle_dir, bare_env, tmp_path):
    """bundle route, no wrapt in the image: the bundle's vendored copy is used (import vllm only, ~15 s; the full
    model-module variant is tests/activation/test_activation.py::test_bundle_without_wrapt_activates_with_its_own_wrapt)."""
    out, _ = run_reporting("import_vllm", python=bare_env, env=clean_env(PYTHONPATH=str(bundle_dir)), cwd=tmp_path)
    assert out["status"]["hook_installed"] is True and out["activations"] == ["sitecustomize"]
    assert Path(out["wrapt"]).resolve().is_relative_to((bundle_dir / "_vllm_minicpm_hotfix_vendor").resolve())


def uv_venv_without_vllm(dest: Path, wheel: Path, *, wrapt: bool) -> Path:
    """A plain ``uv venv`` (no vLLM, no torch) with the wheel installed; wrapt linked from this environment if
    asked (what ``pip install vllm-minicpm-hotfix`` would pull), else none."""
    from support.venvs import uv

    subprocess.run([uv(), "venv", "--quiet", "--python", sys.executable, str(dest)], check=True, timeout=120,
                   capture_output=True)
    python = dest / "bin" / "python"
    pip_install(python, str(wheel))
    if wrapt:
        site = site_packages(python)
        for entry in site_packages().iterdir():
            if entry.name == "wrapt" or entry.name.startswith("wrapt-"):
                (site / entry.name).symlink_to(entry)
    return python


@pytest.mark.parametrize("wrapt", [True, False], ids=["with-wrapt", "no-wrapt"])
def test_vllm_not_installed_is_a_no_op(wheel, tmp_path, wrapt):
    """No vLLM in the environment: start-up adds only the small start-up module; ``import vllm`` fails exactly as it
    would without the hotfix, and the finder, which looks vLLM up before it installs anything, imports nothing:
    no wrapt, no package, no warning (with or without wrapt)."""
    python = uv_venv_without_vllm(tmp_path / "venv", wheel, wrapt=wrapt)
    out, log = run_reporting("no_vllm", python=python, env=clean_env(), cwd=tmp_path)
    assert out["at_start"] == ["_vllm_minicpm_hotfix_arm"]
    assert out["waiting"] == ["pth"]
    assert out["error"] == "ModuleNotFoundError: No module named 'vllm'"
    assert out["after"] == []
    assert out["waiting_after"] == out["waiting"]  # still armed, should vLLM appear on sys.path later
    assert "could not activate" not in log and "Traceback" not in log


def test_interpreter_flags_which_routes_arm(pip_env, bundle_dir, tmp_path):
    """Which start-up route arms under ``-I`` / ``-E`` / ``-S`` (cheap: start-up only, vLLM not imported)."""
    pth = "pth"
    site_cust = "sitecustomize"
    result = {}
    for flags in ((), ("-I",), ("-E",), ("-S",)):
        key = " ".join(flags) or "none"
        result[("pip", key)] = armed(pip_env, tmp_path, *flags)["waiting"]
        result[("bundle", key)] = armed(sys.executable, tmp_path, *flags, pythonpath=str(bundle_dir))["waiting"]
    print("\n" + "\n".join(f"{route:6s} {flags:5s} {w}" for (route, flags), w in result.items()))
    # pip route (.pth in site-packages): site runs under -I and -E (a venv's site-packages is not the user site)
    assert result[("pip", "none")] == [pth]
    assert result[("pip", "-I")] == [pth]
    assert result[("pip", "-E")] == [pth]
    assert result[("pip", "-S")] == []  # no site module: no .pth (and site-packages is not on sys.path either)
    # bundle route (PYTHONPATH + sitecustomize): PYTHONPATH is ignored under -I and -E; -S skips sitecustomize
    assert result[("bundle", "none")] == [site_cust]
    assert result[("bundle", "-I")] == []
    assert result[("bundle", "-E")] == []
    assert result[("bundle", "-S")] == []


def test_under_S_only_the_plugin_entry_point_remains(pip_env, tmp_path):
    """``python -S`` with site-packages put on ``sys.path`` by hand: no start-up route arms, but vLLM's
    ``load_general_plugins()`` still finds our entry point through the package metadata there."""
    out, _ = run_reporting("plugin_entry_points", site_packages(pip_env), python=pip_env, flags=("-S",),
                           env=clean_env(), cwd=tmp_path, timeout=60)
    assert out["waiting"] == []
    assert ["minicpm_hotfix", "vllm_minicpm_hotfix.plugin:register"] in out["eps"]


@ONE_RELEASE
def test_vllm_plugins_allowlist_without_ours_still_patched_by_pth(pip_env, tmp_path):
    """``VLLM_PLUGINS`` names other plugins only: vLLM does not call our entry point, the ``.pth`` route still
    activates (force: patched on every release), once."""
    out, log = run_reporting("import_m46", python=pip_env,
                             env=clean_env(VLLM_PLUGINS="some_other_plugin", VLLM_MINICPM_HOTFIX="force"), cwd=tmp_path)
    assert out["activations"] == ["pth"]  # not "plugin": vLLM skipped our entry point
    assert out["attn_patched"] and out["status"]["fixes"]["qkv_loader"]["applied"]
    assert patched_pids(log, "qkv_loader") == [str(out["status"]["pid"])]
