"""The ``downsample_mode`` fix, against the real vLLM and the real transformers of this environment.

transformers >= 5.23 made ``MiniCPMV4_6ImageProcessor.find_best_resize`` / ``get_refine_size`` take a required
``downsample_mode``; vLLM's ``MiniCPMV4_6ProcessingInfo._compute_visual_tokens`` calls them without it. What each test
expects is derived here, independently of the fix's own probe, from the installed combination:

* ``tf_takes_mode``: transformers' ``find_best_resize`` / ``get_refine_size`` signatures have ``downsample_mode``;
* ``stock_error``: what stock vLLM's real multimodal processor raises on a sliced image (None if it works);
* ``needed`` = both of the above, the error being the ``TypeError`` naming ``downsample_mode``.

:data:`KNOWN` pins the combinations measured so far, so the 0.28.0 + transformers 5.24.0 environment is guaranteed to
assert the stock ``TypeError`` (and an environment whose behaviour changes fails instead of silently asserting less).

Counts compared for every image size x mode: the ``<|image_pad|>`` tokens vLLM's processor puts in the prompt (and
its placeholder's embed mask), the ``<|image_pad|>`` tokens transformers' ``MiniCPMV4_6Processor`` inserts for the same
image and mode, and the rows of vLLM's model's vision embeddings for the pixel values vLLM's processor produced (the
model built on CPU from the bundled tiny checkpoint, :mod:`vllm_build`).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from support.environment import hotfix_mode_set

import vllm_minicpm_hotfix
from vllm_minicpm_hotfix import decision, hook, record
from vllm_minicpm_hotfix.fixes import _base, hf_processor_version, qkv_loader
from vllm_minicpm_hotfix.fixes import processor_downsample_mode as processor_fix
from vllm_minicpm_hotfix.record import FixStatus
from support.processor import vllm_process

TINY = Path(vllm_minicpm_hotfix.__file__).parent / "data" / "tiny-minicpm-v46"
INFO = "MiniCPMV4_6ProcessingInfo"
STOCK_ERROR = "find_best_resize() missing 1 required positional argument: 'downsample_mode'"

#: (vLLM release, transformers version) -> does stock vLLM fail with the TypeError (measured).
KNOWN: dict[tuple[str, str], bool] = {
    ("0.24.0", "5.24.0"): True,
    ("0.26.0", "5.24.0"): True,
    ("0.28.0", "5.24.0"): True,
    ("0.30.0", "5.24.0"): True,
    ("0.28.0", "5.20.0"): False,
    ("0.32.0", "5.19.0"): False,
    ("0.33.0", "5.20.2"): False,
}

#: name -> (width, height). The tiny checkpoint's processor has scale_resolution 112, patch 14, max_slice_nums 9:
#: up to 112x112 pixels an image is one (upscaled) source, above it the source plus a grid of slices.
SIZES: dict[str, tuple[int, int]] = {
    "square": (100, 100),
    "square-at-scale": (112, 112),
    "wide": (300, 60),
    "tall": (50, 260),
    "tiny": (8, 8),
    "tiny-odd": (13, 5),
    "large-square": (448, 448),
    "large-wide": (500, 230),
    "large-tall": (230, 610),
    "panorama": (1000, 150),
}
#: name -> the request's mm_processor_kwargs (``default``: none, the processor's own "16x").
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "16x": {"downsample_mode": "16x"},
    "4x": {"downsample_mode": "4x"},
}

#: Rows of the counts table, printed at the end of the module (``pytest -s``).
COUNTS: list[tuple] = []


# --------------------------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------------------------


def image(width: int, height: int):
    from PIL import Image

    rng = np.random.default_rng(width * 10007 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@contextlib.contextmanager
def processor_hotfix(m46, mode: str = "auto"):
    """Apply the processor fix as the post-import hook would under ``mode``; revert on exit."""
    with hotfix_mode_set(mode):
        try:
            yield _base.run(processor_fix, m46)
        finally:
            _base.revert_fix(processor_fix.NAME, m46)


def info_method(m46):
    return getattr(m46, INFO).__dict__[processor_fix.METHOD]



def vllm_counts(proc, out) -> tuple[int, int]:
    """(``<|image_pad|>`` tokens in vLLM's prompt, embeds its placeholder range marks)."""
    tok = proc.info.get_tokenizer()
    pad = tok.convert_tokens_to_ids(tok.image_token)
    in_prompt = sum(1 for t in out["prompt_token_ids"] if t == pad)
    (ph,) = out["mm_placeholders"]["image"]
    embeds = int(ph.is_embed.sum()) if ph.is_embed is not None else ph.length
    return in_prompt, embeds


def item_data(out) -> dict:
    (item,) = out["mm_kwargs"]["image"]
    return item.get_data() if hasattr(item, "get_data") else {k: v.data for k, v in item.items()}


def hf_process(hf_proc, img, mm_kwargs: dict):
    return hf_proc(text=[hf_proc.image_token], images=[img], **mm_kwargs)


def hf_count(hf_proc, out) -> int:
    return int((out["input_ids"] == hf_proc.image_token_id).sum())


def vision_embeddings(model, data: dict) -> int:
    """Rows of vLLM's model's multimodal embeddings for one processed image (its real image-embedding path)."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(model.vllm_config), torch.no_grad():
        (emb,) = model.embed_multimodal(**{k: [v] for k, v in data.items()})
    assert emb.ndim == 2 and emb.shape[1] == model.config.text_config.hidden_size
    assert torch.isfinite(emb).all()
    return int(emb.shape[0])


# --------------------------------------------------------------------------------------------------------------------
# Fixtures (module-scoped: vLLM's processor and model are built once)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def m46_mod():
    """The real model module, with vLLM's own ``_compute_visual_tokens`` (conftest's autouse fixture asserts that no
    test leaves either fix applied)."""
    import importlib

    return importlib.import_module("vllm.model_executor.models.minicpmv4_6")


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    assert (TINY / "model.safetensors").is_file(), f"bundled tiny checkpoint missing at {TINY}"
    assert (TINY / "processor_config.json").is_file(), f"no processor_config.json in {TINY}"
    return TINY


@pytest.fixture(autouse=True)
def _stock_processor_between_tests(m46_mod, monkeypatch):
    """Every test starts and ends with vLLM's ProcessingInfo exactly as vLLM defined it; the fix is probed where it
    is run (``_base.run``), not at vLLM's first processor (tests/registry/test_registry.py tests that)."""
    monkeypatch.setattr(_base.deferred, "EAGER", True)
    assert not _base.is_patched(processor_fix, m46_mod), "a previous test left the processor fix applied"
    yield
    assert not _base.is_patched(processor_fix, m46_mod), "this test left the processor fix applied"


def make_processor(checkpoint: Path, **model_kwargs):
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    model_config = ModelConfig(model=str(checkpoint), dtype="float32", enforce_eager=True, **model_kwargs)
    proc = MULTIMODAL_REGISTRY.create_processor(model_config)
    from vllm.model_executor.models import minicpmv4_6

    if hf_processor_version.probe(minicpmv4_6).broken:
        # vLLM 0.23.0 cannot build transformers' 4.6 processor at all (AttributeError 'version', the defect of
        # fixes/hf_processor_version, tested in tests/prompt/test_prompt_conformance.py); without it no request reaches the
        # downsample_mode code this module tests. Give this one processor *instance* that fix's method (the class
        # stays vLLM's, so the stock-between-tests check and every stock verdict here are unaffected).
        info = proc.info
        info.get_hf_processor = types.MethodType(hf_processor_version.get_hf_processor, info)
    return proc


@pytest.fixture(scope="module")
def vproc(m46_mod, tiny_dir):
    """vLLM's ``MiniCPMV4_6MultiModalProcessor`` for the tiny checkpoint (tokenizer and processor config included)."""
    proc = make_processor(tiny_dir)
    assert type(proc.info).__name__ == INFO
    return proc


@pytest.fixture(scope="module")
def hf_proc(tiny_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="module")
def installed(m46_mod, vproc) -> dict:
    """The installed combination and what stock vLLM does on it (see the module docstring)."""
    import transformers
    import vllm
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor

    params = {name: inspect.signature(getattr(MiniCPMV4_6ImageProcessor, name)).parameters
              for name in ("find_best_resize", "get_refine_size")}
    tf_takes_mode = all("downsample_mode" in p for p in params.values())
    tf_requires_mode = tf_takes_mode and all(
        p["downsample_mode"].default is inspect.Parameter.empty for p in params.values()
    )
    assert not _base.is_patched(processor_fix, m46_mod)
    try:
        vllm_process(vproc, image(*SIZES["large-wide"]), {})
        stock_error = None
    except Exception as exc:  # what stock vLLM raises is the point of the fixture
        stock_error = exc
    needed = (
        tf_requires_mode
        and isinstance(stock_error, TypeError)
        and "downsample_mode" in str(stock_error)
    )
    return dict(
        release=vllm.__version__.split("+")[0],
        transformers=transformers.__version__,
        tf_takes_mode=tf_takes_mode,
        tf_requires_mode=tf_requires_mode,
        stock_error=stock_error,
        needed=needed,
    )


@pytest.fixture(scope="module")
def vmodel(m46_mod, tiny_dir):
    """vLLM's ``MiniCPMV4_6ForConditionalGeneration`` on CPU with the tiny checkpoint loaded (through the q/k/v fix
    where this vLLM needs it) and post-processed as vLLM's loader does."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from support.vllm_build import build_vllm_model, load_checkpoint

    model = build_vllm_model(tiny_dir, load=False)
    with hotfix_mode_set("auto"):
        try:
            _base.run(qkv_loader, m46_mod)
            load_checkpoint(model, tiny_dir)
        finally:
            _base.revert(m46_mod)
    # vLLM's loader post-processes every module after loading (on CPU: its linear layers get their GEMM kernel).
    # Only the vision side runs here; some releases (0.30) cannot post-process the float32 text model's GDN conv on
    # CPU, so the language model is left out.
    with set_current_vllm_config(model.vllm_config):
        for name, child in model.named_children():
            if name not in ("language_model", "llm"):
                process_weights_after_loading(child, model.vllm_config.model_config, torch.device("cpu"))
    return model


@pytest.fixture(scope="module", autouse=True)
def _print_counts():
    yield
    if COUNTS:
        print("\n\nimage (WxH)             mode      vLLM prompt  vLLM embeds-mask  transformers  vision embeddings")
        for row in COUNTS:
            print("{:<22}  {:<8}  {:>11}  {:>16}  {:>12}  {:>17}".format(*row))


# --------------------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------------------


def test_known_combination(installed):
    """Measured combinations keep their behaviour; in particular 0.28.0 + transformers 5.24.0 is one that fails."""
    key = (installed["release"], installed["transformers"])
    print(f"\nvLLM {key[0]} + transformers {key[1]}: {installed}")
    if key in KNOWN:
        assert installed["needed"] == KNOWN[key], installed


def test_probe_matches_installed(m46_mod, installed):
    result = processor_fix.probe(m46_mod)
    print(f"\nprobe: {result}")
    assert result.broken == installed["needed"], result
    assert result.applicable == installed["tf_takes_mode"], result
    if not installed["tf_takes_mode"]:
        assert result.state is decision.State.CORRECT
        assert result.reason.startswith("not needed"), result.reason
    if installed["needed"]:
        assert STOCK_ERROR in result.reason
    # The probe left vLLM as it was.
    assert not _base.is_patched(processor_fix, m46_mod)


def test_stock_vllm(m46_mod, vproc, hf_proc, installed):
    """Stock vLLM fails with the reported TypeError exactly where needed; elsewhere its counts are transformers'."""
    img = image(*SIZES["large-wide"])
    info = vproc.info
    if installed["needed"]:
        assert isinstance(installed["stock_error"], TypeError)
        assert STOCK_ERROR in str(installed["stock_error"])
        with pytest.raises(TypeError, match=STOCK_ERROR.replace("(", r"\(").replace(")", r"\)")):
            vllm_process(vproc, img, {})
        # The count vLLM uses for start-up profiling fails the same way.
        with pytest.raises(TypeError, match="downsample_mode"):
            info.get_max_image_tokens()
    else:
        assert installed["stock_error"] is None, installed["stock_error"]
        for kwargs in MODES.values():
            out = vllm_process(vproc, img, kwargs)
            assert vllm_counts(vproc, out)[0] == hf_count(hf_proc, hf_process(hf_proc, img, kwargs))


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_apply_by_mode(m46_mod, vproc, installed, mode):
    """auto patches where needed, force wherever applicable (transformers takes the mode), off never; recorded in the
    same status record as the q/k/v fix."""
    stock = info_method(m46_mod)
    with processor_hotfix(m46_mod, mode) as fix:
        assert isinstance(fix, FixStatus)
        assert record.current().mode == mode
        assert record.current().fixes[processor_fix.NAME] is fix
        assert vllm_minicpm_hotfix.status()["fixes"][processor_fix.NAME]["applied"] == fix.applied
        want = {"auto": installed["needed"], "force": installed["tf_takes_mode"], "off": False}[mode]
        assert fix.applied == want, fix
        assert _base.is_patched(processor_fix, m46_mod) == want
        if mode != "off":
            assert fix.verdict == ("broken" if installed["needed"] else "correct"), fix
        if mode == "auto" and not installed["needed"]:
            assert fix.why.startswith("not needed"), fix.why
        if installed["needed"] and not fix.applied:  # off: still broken
            with pytest.raises(TypeError, match="downsample_mode"):
                vllm_process(vproc, image(*SIZES["large-wide"]), {})
        else:
            vllm_process(vproc, image(*SIZES["large-wide"]), {"downsample_mode": "4x"})
    assert info_method(m46_mod) is stock


def test_idempotent_and_revert(m46_mod, installed):
    """Applying twice wraps once; revert restores vLLM's own function object. Where the fix is not applicable even
    ``force`` sets nothing, however often it runs."""
    stock = info_method(m46_mod)
    with processor_hotfix(m46_mod, "force") as fix:
        assert fix.applied == installed["tf_takes_mode"]
        wrapper = info_method(m46_mod)
        again = _base.run(processor_fix, m46_mod)
        assert again.applied == fix.applied
        assert info_method(m46_mod) is wrapper
        if fix.applied:
            assert again.why == "already patched in this process"
            assert wrapper is not stock and wrapper.__wrapped__ is stock
        else:
            assert wrapper is stock
    assert info_method(m46_mod) is stock
    assert _base.revert_fix(processor_fix.NAME, m46_mod) is False


def test_transactional(m46_mod, installed, monkeypatch):
    """A failure while patching leaves vLLM's class exactly as it was (where not applicable, nothing is attempted)."""
    stock = info_method(m46_mod)
    real_set = _base.patching._set

    def set_then_fail(cls, attr, value, undo):
        real_set(cls, attr, value, undo)
        raise RuntimeError("injected failure after setting")

    monkeypatch.setattr(_base.patching, "_set", set_then_fail)
    with hotfix_mode_set("force"):
        if installed["tf_takes_mode"]:
            with pytest.raises(RuntimeError, match="injected"):
                _base.run(processor_fix, m46_mod)
        else:
            _base.run(processor_fix, m46_mod)
        assert info_method(m46_mod) is stock
        assert not record.current().fixes[processor_fix.NAME].applied
    assert _base.revert_fix(processor_fix.NAME, m46_mod) is False


# --------------------------------------------------------------------------------------------------------------------
# The post-import hook runs both fixes, each on its own
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def hook_cleanup(m46_mod):
    yield
    _base.revert(m46_mod)
    _base.revert_fix(processor_fix.NAME, m46_mod)


def test_hook_applies_both(m46_mod, installed, hook_cleanup):
    qkv_verdict = qkv_loader.probe(m46_mod)
    with hotfix_mode_set("auto"):
        hook.on_import(m46_mod)
        vllm_minicpm_hotfix.status()  # the processor-path probes run (as at vLLM's first processor)
        fixes = record.current().fixes
        assert set(fixes) >= {qkv_loader.NAME, processor_fix.NAME}
        assert fixes[processor_fix.NAME].applied == installed["needed"]
        assert _base.is_patched(processor_fix, m46_mod) == installed["needed"]
        assert fixes[qkv_loader.NAME].applied == qkv_verdict.broken
        assert fixes[qkv_loader.NAME].error is None and fixes[processor_fix.NAME].error is None
        json.dumps(vllm_minicpm_hotfix.status())


def test_hook_processor_failure_isolated(m46_mod, installed, hook_cleanup, monkeypatch):
    def boom(module):
        raise RuntimeError("processor fix exploded")

    monkeypatch.setattr(processor_fix, "probe", boom)
    qkv_verdict = qkv_loader.probe(m46_mod)
    with hotfix_mode_set("auto"):
        hook.on_import(m46_mod)  # must not raise
        vllm_minicpm_hotfix.status()  # the processor-path probes run (as at vLLM's first processor)
        fixes = record.current().fixes
        err = fixes[processor_fix.NAME]
        assert err.verdict == "error" and not err.applied and "processor fix exploded" in err.error
        assert fixes[qkv_loader.NAME].error is None
        assert fixes[qkv_loader.NAME].applied == qkv_verdict.broken
    assert not _base.is_patched(processor_fix, m46_mod)


def test_hook_qkv_failure_isolated(m46_mod, installed, hook_cleanup, monkeypatch):
    def boom(module):
        raise RuntimeError("qkv fix exploded")

    monkeypatch.setattr(qkv_loader, "probe", boom)
    with hotfix_mode_set("auto"):
        hook.on_import(m46_mod)  # must not raise
        vllm_minicpm_hotfix.status()  # the processor-path probes run (as at vLLM's first processor)
        fixes = record.current().fixes
        assert fixes[qkv_loader.NAME].verdict == "error" and "qkv fix exploded" in fixes[qkv_loader.NAME].error
        pfix = fixes[processor_fix.NAME]
        assert pfix.error is None and pfix.applied == installed["needed"]
        assert _base.is_patched(processor_fix, m46_mod) == installed["needed"]


# --------------------------------------------------------------------------------------------------------------------
# The counts: vLLM's placeholder count == transformers' <|image_pad|> count == vLLM's vision embeddings
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("size", list(SIZES))
def test_counts_agree(m46_mod, vproc, hf_proc, vmodel, installed, size, mode):
    img = image(*SIZES[size])
    kwargs = MODES[mode]
    with processor_hotfix(m46_mod, "auto") as fix:
        assert fix.applied == installed["needed"]
        out = vllm_process(vproc, img, kwargs)
        in_prompt, marked = vllm_counts(vproc, out)
        data = item_data(out)
        # The fix changes nothing but the count: the pixel values are transformers' own.
        hf_out = hf_process(hf_proc, img, kwargs)
        want = hf_count(hf_proc, hf_out)
        assert torch.equal(data["tgt_sizes"].to(torch.long), hf_out["target_sizes"].to(torch.long))
        embeds = vision_embeddings(vmodel, data)
    COUNTS.append((f"{size} {SIZES[size][0]}x{SIZES[size][1]}", mode, in_prompt, marked, want, embeds))
    assert in_prompt == marked == want == embeds, (size, mode, in_prompt, marked, want, embeds)
    divisor = 4 if mode == "4x" else 16
    assert want == int(hf_out["target_sizes"].to(torch.long).prod(-1).sum()) // divisor


def test_mode_reaches_the_rounding(m46_mod, vproc, installed):
    """The mode reaches find_best_resize/get_refine_size, not only the token divisor: with a transformers that rounds
    "4x" to patch*2 the wide image's 4x count is not 4x its 16x count; with one that always rounds to patch*4 it is."""
    from vllm.multimodal.parse import ImageSize

    with processor_hotfix(m46_mod, "auto"):
        info = vproc.info
        size = ImageSize(*SIZES["wide"])
        n16 = info.get_num_image_tokens(size, downsample_mode="16x")
        n4 = info.get_num_image_tokens(size, downsample_mode="4x")
    if installed["tf_takes_mode"]:
        assert n4 != 4 * n16, (n16, n4)
    else:
        assert n4 == 4 * n16, (n16, n4)


def test_concurrent_modes(m46_mod, vproc, installed):
    """The per-call views share no state: threads asking for different modes at once each get their own count."""
    from vllm.multimodal.parse import ImageSize

    sizes = [ImageSize(*s) for s in SIZES.values()]
    with processor_hotfix(m46_mod, "auto"):
        info = vproc.info
        expected = {m: [info.get_num_image_tokens(s, downsample_mode=m) for s in sizes] for m in ("16x", "4x")}
        errors: list = []

        def worker(m):
            try:
                for _ in range(30):
                    assert [info.get_num_image_tokens(s, downsample_mode=m) for s in sizes] == expected[m]
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(m,)) for m in ("16x", "4x") * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert expected["16x"] != expected["4x"]


def test_processor_default_mode_4x(m46_mod, tiny_dir, tmp_path, installed):
    """A checkpoint whose processor defaults to "4x" (no per-request override): vLLM resolves the processor's own
    mode, and its count still equals transformers' and differs from the 16x one."""
    from transformers import AutoProcessor

    ckpt = tmp_path / "tiny-4x"
    shutil.copytree(tiny_dir, ckpt)
    cfg_path = ckpt / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("image_processor", "video_processor"):
        if isinstance(cfg.get(key), dict):
            cfg[key]["downsample_mode"] = "4x"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    proc = make_processor(ckpt)
    hf = AutoProcessor.from_pretrained(str(ckpt))
    img = image(*SIZES["large-wide"])
    with processor_hotfix(m46_mod, "auto") as fix:
        assert fix.applied == installed["needed"]
        n4 = vllm_counts(proc, vllm_process(proc, img, {}))[0]
        n16 = vllm_counts(proc, vllm_process(proc, img, {"downsample_mode": "16x"}))[0]
    assert n4 == hf_count(hf, hf_process(hf, img, {}))
    assert n16 == hf_count(hf, hf_process(hf, img, {"downsample_mode": "16x"}))
    assert n4 != n16
