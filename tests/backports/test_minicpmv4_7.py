"""The MiniCPM-V 4.7 backport (``vllm_minicpm_hotfix/backports/minicpmv4_7.py``, its model classes in
``backports/models/minicpmv4_7.py``), without an engine: the probe, the registration through vLLM's registries, the
prompt, the positions and the load, each against a reference that is not the backport's output.

* **Probe** (every environment): ``missing`` where vLLM's ``ModelRegistry`` lacks ``MiniCPMV4_7ForConditionalGeneration``
  (0.22-0.30), ``correct`` "vLLM's own" where it has it (0.32, 0.33): pinned in tests/support/expected.py.
* **Stock** (0.22-0.30): ``ModelConfig(model=<a 4.7 checkpoint>)`` -- what ``LLM(...)`` and ``vllm serve`` build
  first -- raises vLLM's ``Model architectures ['MiniCPMV4_7ForConditionalGeneration'] are not supported for now``.
* **Registration** (0.22-0.30): the hook's :func:`vllm_minicpm_hotfix.backports.run` registers the lazy
  ``module:Class`` entry; vLLM's registry resolves it to the backport's class and ``MULTIMODAL_REGISTRY`` builds the
  backport's processor; ``unregister`` restores stock; ``off`` registers nothing; on 0.32/0.33 nothing is registered,
  under ``force`` too, and the summary line says "vLLM's own".
* **Prompt** (0.22-0.30, every fix applied as the hook applies them): vLLM's token ids equal transformers'
  ``MiniCPMV4_7Processor``'s over the seeded sweep of image sizes, every per-request and model-level kwarg, videos
  (no local ``<image_id>`` before a video: the backport's own text, stock fixes only) and several items.
* **Positions** (0.22-0.30): the backport's ``get_mrope_input_positions`` on the prompt and the items vLLM's processor
  builds (their real ``tgt_sizes`` fields) equals transformers' ``MiniCPMV4_7Model.get_rope_index`` on transformers'
  own processor output, position for position, and the rope delta too: images (sliced, wide, tall, unsliced, 4x),
  two images, videos of several frames.
* **Load** (0.22-0.30): the backport's model built on CPU and loaded with ``load_weights`` (the q/k/v fixes applied
  where the hook applies them): every parameter equals the checkpoint's tensors (fused ones as vLLM fuses them:
  ``qkv_proj`` = cat(q, k, v), ``gate_up_proj`` = cat(gate, up), the GDN ``in_proj_qkvz`` / ``in_proj_ba``, the
  experts' ``w13_weight[e]`` = cat(gate_e, up_e) and ``w2_weight[e]`` = down_e), ``torch.equal``; every checkpoint
  tensor is used; every vision layer is kept; the MoE text tower is ``Qwen3_5MoeForCausalLM``.
* **Fixes for 4.7's classes** (0.22-0.30): the frame budget (32, stock 16) and the placeholder guard's refusal naming
  "MiniCPM-V 4.7".

Placement: the backport's environments (:data:`BACKPORT_ENVS`) and, for "nothing registered", 0.32.0 / 0.33.0. No
engine; two tiny checkpoints written by transformers per session.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path

import pytest
import torch

import vllm_minicpm_hotfix
from support import expected as table
from support.backport47 import (
    assert_every_parameter_equals, forget_resolved, model_config, registered_as_the_hook_does, unregister_all,
    write_checkpoint,
)
from support.hotfix import hotfix
from support.prompt import (
    MODEL_KWARGS, PREREQUISITES, PROMPT, REQUEST_KWARGS, V47_ENVS, assert_all_equal, image, make_pair, processed,
    seeded_sizes, sizes_for, stock, video, vllm_ids, with_hotfix,
)
from vllm_minicpm_hotfix import backports, record
from vllm_minicpm_hotfix.backports import canvas, minicpmv4_7 as bp
from vllm_minicpm_hotfix.fixes import names

#: Where vLLM lacks 4.7 and the backport registers it (tests/support/expected.py BACKPORT_VERDICTS).
BACKPORT_ENVS = ("0.22.1", "0.23.0", "0.24.0", "0.26.0", "0.28.0", "0.28.0:tf5.20.0", "0.30.0")
here = pytest.mark.placed(*BACKPORT_ENVS)

NOT_SUPPORTED = "Model architectures ['MiniCPMV4_7ForConditionalGeneration'] are not supported for now"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backport47")
    return {"dense": write_checkpoint(root / "dense"), "moe": write_checkpoint(root / "moe", "--moe")}


@pytest.fixture
def registered(registry_module, importable, monkeypatch):
    """The backport registered as the hook registers it (``auto``) for one test; unregistered after."""
    with registered_as_the_hook_does(bp, registry_module, importable, monkeypatch) as row:
        yield row


@pytest.fixture(autouse=True)
def _stock_registry(registry_module):
    """Every test starts and ends with vLLM's model registry as vLLM made it."""
    assert not bp.registered(registry_module), "a previous test left the backport registered"
    forget_resolved()
    yield
    forget_resolved()
    assert not bp.registered(registry_module), "this test left the backport registered"


def resolved(checkpoint: Path) -> str:
    """The architecture vLLM resolves ``checkpoint`` to in this process now, or the first line of its error."""
    forget_resolved()
    try:
        return model_config(checkpoint).architecture
    except Exception as exc:  # noqa: BLE001 - stock's answer is an error on most releases
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


# --------------------------------------------------------------------------------------------------------------------
# The probe and the registration
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.stock_pin
def test_probe_verdict_is_pinned(registry_module, environment):
    verdict = bp.probe(registry_module)
    assert verdict.state.value == table.backport_verdict(bp.NAME, environment), verdict
    if verdict.state.value == "correct":
        assert verdict.reason.startswith("vLLM's own") and "vllm.model_executor.models.minicpmv4_7" in verdict.reason
        assert verdict.applicable is False
    else:
        assert bp.ARCH in verdict.reason and "MiniCPMV4_7Config" in verdict.reason


#: Releases where stock vLLM does not refuse the architecture at once: it falls back to its Transformers modeling
#: backend (``TransformersMultiModalForCausalLM``), whose multimodal budget then fails on transformers' 4.7
#: processor (``LLM(...)`` dies at start-up with this error; seen 2026-12-02).
TRANSFORMERS_BACKEND = {"0.30.0": "'MiniCPMV4_7Processor' object has no attribute '_get_num_multimodal_tokens'"}


@here
def test_stock_vllm_does_not_support_the_checkpoint(ckpts, release):
    """What ``LLM(model=...)`` and ``vllm serve`` build first, on stock vLLM: its "not supported" error -- or, where
    vLLM falls back to its Transformers backend (:data:`TRANSFORMERS_BACKEND`), the error that backend's multimodal
    budget raises at start-up."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    for ckpt in ckpts.values():
        if release not in TRANSFORMERS_BACKEND:
            with pytest.raises(Exception, match=re.escape(NOT_SUPPORTED)):
                model_config(ckpt)
            continue
        mc = model_config(ckpt)
        assert mc.architecture.startswith("TransformersMultiModal"), mc.architecture  # ...MoEForCausalLM for MoE
        info = MULTIMODAL_REGISTRY.create_processor(mc).info
        with pytest.raises(AttributeError, match=re.escape(TRANSFORMERS_BACKEND[release])):
            info.get_mm_max_tokens_per_item(2048, {"image": 1})


@here
def test_registered_through_vllms_registries(registry_module, ckpts, importable, monkeypatch, hotfix_mode):
    """``auto`` and ``force`` register the lazy ``module:Class`` entry; vLLM resolves the checkpoint to the backport's
    class and builds its processor; ``unregister`` gives stock back; ``off`` registers nothing."""
    from vllm.multimodal import MULTIMODAL_REGISTRY

    monkeypatch.setenv("PYTHONPATH", importable)
    registry = registry_module.ModelRegistry
    stock_answer = resolved(ckpts["dense"])
    for mode in ("auto", "force"):
        hotfix_mode(mode)
        rows = backports.run(registry_module)
        forget_resolved()  # this test resolved the checkpoint unregistered a moment ago
        try:
            row = vllm_minicpm_hotfix.status()["backports"][bp.NAME]
            assert (row["verdict"], row["registered"]) == ("missing", True), row
            assert record.backport_says(row) == "registered by the hotfix"
            assert rows[bp.NAME].member == "MiniCPM-V 4.7"
            entry = registry.models[bp.ARCH]
            assert (type(entry).__name__, entry.module_name, entry.class_name) == (
                "_LazyRegisteredModel", bp.MODEL_MODULE, bp.ARCH)
            mc = model_config(ckpts["dense"])
            assert mc.architectures == [bp.ARCH]
            cls, arch = registry.resolve_model_cls(mc.architectures, mc)
            assert (cls.__module__, cls.__name__, arch) == (bp.MODEL_MODULE, bp.ARCH, bp.ARCH)
            proc = MULTIMODAL_REGISTRY.create_processor(mc)
            assert (type(proc).__module__, type(proc).__name__) == (bp.MODEL_MODULE, "MiniCPMV4_7MultiModalProcessor")
            assert type(proc.info).__name__ == "MiniCPMV4_7ProcessingInfo"
        finally:
            assert bp.unregister(registry_module) is True
            unregister_all(registry_module)  # the other backports the hook registered with it
        assert bp.ARCH not in registry.get_supported_archs()
        assert resolved(ckpts["dense"]) == stock_answer  # stock's answer again (the test above: an error)
    hotfix_mode("off")
    rows = backports.run(registry_module)
    assert rows[bp.NAME].registered is False and "off" in rows[bp.NAME].why
    assert bp.ARCH not in registry.get_supported_archs()


@pytest.mark.placed(*V47_ENVS)
def test_vllms_own_is_left_alone(registry_module, ckpts, hotfix_mode):
    """Where vLLM registers 4.7 itself, nothing is registered (``force`` neither): the registry entry stays vLLM's,
    the checkpoint resolves to vLLM's own class, and status and the summary line say "vLLM's own"."""
    registry = registry_module.ModelRegistry
    before = registry.models[bp.ARCH]
    for mode in ("auto", "force"):
        hotfix_mode(mode)
        backports.run(registry_module)
        row = vllm_minicpm_hotfix.status()["backports"][bp.NAME]
        assert (row["verdict"], row["registered"]) == ("correct", False), row
        assert registry.models[bp.ARCH] is before
        mc = model_config(ckpts["dense"])
        cls, _ = registry.resolve_model_cls(mc.architectures, mc)
        assert cls.__module__ == "vllm.model_executor.models.minicpmv4_7"
        line = record.summary_line(record.current(), names())
        assert record.parse_summary(line, names())[0]["backports"]["MiniCPM-V 4.7"] == "vLLM's own", line


def test_a_failing_registration_leaves_vllm_as_it_was(registry_module, monkeypatch, hotfix_mode, caplog):
    """``register`` raising inside the hook: one WARNING line, the status row ``error``, the registry as before."""
    hotfix_mode("force")
    monkeypatch.setattr(backports, "BACKPORTS", (bp,))  # this backport alone (the others would register)
    before = dict(registry_module.ModelRegistry.models)
    monkeypatch.setattr(bp, "probe", lambda module: bp.Verdict(bp.State.MISSING, "stand-in: missing"))
    register = bp.register

    def boom(module):
        register(module)  # the real registration (over vLLM's own entry on 0.32+), then a failure
        raise RuntimeError("registration failed half-way")

    monkeypatch.setattr(bp, "register", boom)
    with caplog.at_level("WARNING", logger="vllm.minicpm_hotfix"):
        rows = backports.run(registry_module)
    assert rows[bp.NAME].verdict == "error" and "half-way" in rows[bp.NAME].error
    assert registry_module.ModelRegistry.models == before
    warnings = [r for r in caplog.records if "backport minicpmv4_7" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert record.backport_says(rows[bp.NAME]) == "failed"


# --------------------------------------------------------------------------------------------------------------------
# The prompt: transformers' MiniCPMV4_7Processor
# --------------------------------------------------------------------------------------------------------------------

VIDEO_SIZES = [(56, 56), (700, 400), (300, 900), (20, 36)]


@here
def test_prompt_ids_equal_transformers(m46, ckpts, registered):
    """Every fix applied as the hook applies them (the product): vLLM's prompt ids equal transformers' for >= 40
    seeded sizes, every per-request kwarg on every fifth size, videos (1 and 3 frames, kwargs) and several items."""
    pair = make_pair(ckpts["dense"], {})
    assert type(pair.vllm).__module__ == bp.MODEL_MODULE and type(pair.hf).__name__ == "MiniCPMV4_7Processor"
    sizes = sizes_for("real47")
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes]
    cases += [(f"{k} {w}x{h}", "image", [image(w, h)], kw) for kw in REQUEST_KWARGS
              for k, w, h in sizes_for("real47", seeded_sizes()[::5])]
    cases += [(f"{w}x{h}x{n}", "video", [video(w, h, n)], {}) for w, h in VIDEO_SIZES for n in (1, 3)]
    cases += [(f"{w}x{h}x2", "video", [video(w, h, 2)], kw) for kw in REQUEST_KWARGS for w, h in VIDEO_SIZES[1:3]]
    cases += [
        ("two images", "image", [image(*sizes[0][1:]), image(*sizes[9][1:])], {}),
        ("three images", "image", [image(*s[1:]) for s in sizes[17:20]], {"max_slice_nums": 2}),
        ("two videos", "video", [video(700, 400, 2), video(700, 400, 2, seed=1)], {}),
    ]
    with with_hotfix(m46):
        assert_all_equal(pair, cases)


@here
@pytest.mark.parametrize("model_kwargs", MODEL_KWARGS, ids=str)
def test_prompt_ids_with_model_kwargs(m46, ckpts, registered, model_kwargs):
    """``--mm-processor-kwargs``, alone and under a per-request override."""
    pair = make_pair(ckpts["dense"], model_kwargs)
    sizes = seeded_sizes()[1::5]
    cases = [(f"{k} {w}x{h}", "image", [image(w, h)], {}) for k, w, h in sizes]
    cases += [(f"{w}x{h}x2", "video", [video(w, h, 2)], {}) for w, h in VIDEO_SIZES[:2]]
    cases += [(f"{k} {w}x{h}", "image", [image(w, h)], {"slice_mode": True, "max_slice_nums": 9})
              for k, w, h in sizes[:3]]
    with with_hotfix(m46):
        assert_all_equal(pair, cases)


@here
def test_video_has_no_local_image_id(m46, ckpts, registered):
    """4.7's own text, without the placeholder fix: transformers' 4.7 processor puts no ``<image_id>`` before a video
    and neither does the backport's (vLLM's 4.6 text starts with ``<image_id>0</image_id>``)."""
    pair = make_pair(ckpts["dense"], {})
    tok = pair.tokenizer
    id_start = tok.convert_tokens_to_ids("<image_id>")
    with stock(m46):
        ids = vllm_ids(pair, "video", [video(56, 56, 2)], {})
        text47 = pair.vllm.get_video_prompt_texts(_frame_size(56, 56), 2, downsample_mode="16x", video_idx=0)
        text46 = type(pair.vllm).__mro__[1].get_video_prompt_texts(  # vLLM's 4.6 text of the same video
            pair.vllm, _frame_size(56, 56), 2, downsample_mode="16x", video_idx=0)
    want = pair.hf(text=[PROMPT.format(mm=pair.hf.video_token)], videos=[video(56, 56, 2)], do_sample_frames=False)
    assert id_start not in ids and id_start not in want["input_ids"][0].tolist()
    assert text46 == "<image_id>0</image_id>" + text47, (text46[:60], text47[:60])


def _frame_size(w: int, h: int):
    from vllm.multimodal.parse import ImageSize

    return ImageSize(width=w, height=h)


# --------------------------------------------------------------------------------------------------------------------
# Canvas M-RoPE positions: transformers' MiniCPMV4_7Model.get_rope_index
# --------------------------------------------------------------------------------------------------------------------

#: (label, modality, items as (w, h) or (w, h, frames), request kwargs)
POSITION_CASES = [
    ("449x448 sliced", "image", [(449, 448)], {}),
    ("640x480 wide", "image", [(640, 480)], {}),
    ("300x900 tall", "image", [(300, 900)], {}),
    ("300x200 unsliced", "image", [(300, 200)], {}),
    ("640x480 slice_mode false", "image", [(640, 480)], {"slice_mode": False}),
    ("640x480 4x", "image", [(640, 480)], {"downsample_mode": "4x"}),
    ("448x448 scale_resolution 224", "image", [(448, 448)], {"scale_resolution": 224}),
    ("two images", "image", [(449, 448), (300, 200)], {}),
    ("video 3 frames", "video", [(120, 90, 3)], {}),
    ("video sliced 2 frames", "video", [(700, 400, 2)], {}),
    ("two videos", "video", [(120, 90, 2), (120, 90, 2, 1)], {}),  # same size: transformers 5.20 cannot batch others
]


def _features(out) -> list:
    """The request's items as vLLM's engine hands them to ``get_mrope_input_positions`` (``MultiModalFeatureSpec``:
    ``modality``, ``data`` -- the processor's own ``MultiModalKwargsItem`` --, ``mm_position``)."""
    feats = []
    for modality, items in out["mm_kwargs"].items():
        for item, where in zip(items, out["mm_placeholders"][modality]):
            feats.append(types.SimpleNamespace(modality=modality, data=item, mm_position=where))
    return feats[::-1]  # the method sorts them by offset itself


def _model(config):
    """The backport's model class with only what ``get_mrope_input_positions`` reads (no weights)."""
    from torch import nn

    m47 = importlib.import_module(bp.MODEL_MODULE)
    model = m47.MiniCPMV4_7ForConditionalGeneration.__new__(m47.MiniCPMV4_7ForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = config
    model.canvas_markers = m47.canvas_markers(config)
    return model


@here
def test_positions_equal_transformers(m46, ckpts, registered):
    from transformers import MiniCPMV4_7ForConditionalGeneration

    pair = make_pair(ckpts["dense"], {})
    reference = MiniCPMV4_7ForConditionalGeneration.from_pretrained(str(ckpts["dense"])).model
    model = _model(reference.config)
    misses = []
    with with_hotfix(m46):
        for label, modality, specs, kw in POSITION_CASES:
            items = [image(*s) if modality == "image" else video(*s) for s in specs]
            out = processed(pair, modality, items, kw)
            ids = list(out["prompt_token_ids"])
            pad = pair.hf.image_token if modality == "image" else pair.hf.video_token
            text = [PROMPT.format(mm=pad * len(items))]
            hf = pair.hf(text=text, **({"images": items} if modality == "image" else
                                      {"videos": items, "do_sample_frames": False}), **kw)
            assert ids == hf["input_ids"][0].tolist(), label
            want, delta = reference.get_rope_index(hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                                                   target_sizes=hf.get("target_sizes"),
                                                   target_sizes_videos=hf.get("target_sizes_videos"),
                                                   downsample_mode=kw.get("downsample_mode"))
            got, got_delta = model.get_mrope_input_positions(ids, _features(out))
            if not torch.equal(got, want[:, 0, :]) or got_delta != int(delta[0, 0]):
                misses.append(f"{label}: {int((got != want[:, 0, :]).sum())} positions differ, delta {got_delta} "
                              f"vs {int(delta[0, 0])}")
            assert not torch.equal(want[:, 0, :], torch.arange(len(ids)).expand(3, -1)), "canvas == sequential"
    assert not misses, misses


@here
def test_positions_of_a_text_prompt_and_of_a_broken_item_are_sequential(ckpts, caplog):
    """No items: sequential, as transformers; an item without patch grids (never from vLLM's processor): one
    WARNING line and sequential positions, never an exception (it runs in the engine)."""
    from transformers import AutoConfig

    model = _model(AutoConfig.from_pretrained(str(ckpts["dense"])))
    got, delta = model.get_mrope_input_positions(list(range(7)), [])
    assert torch.equal(got, torch.arange(7).expand(3, -1)) and delta == 0
    broken = types.SimpleNamespace(modality="image", data={}, mm_position=types.SimpleNamespace(offset=2))
    with caplog.at_level("WARNING", logger="vllm.minicpm_hotfix"):
        got, delta = model.get_mrope_input_positions(list(range(9)), [broken])
    assert torch.equal(got, torch.arange(9).expand(3, -1)) and delta == 0
    assert any("carries no tgt_sizes" in r.getMessage() for r in caplog.records)


@here
def test_the_positions_method_has_the_installed_protocols_signature():
    from vllm.model_executor.models.interfaces import SupportsMRoPE

    m47 = importlib.import_module(bp.MODEL_MODULE)
    ours = list(inspect.signature(m47.MiniCPMV4_7ForConditionalGeneration.get_mrope_input_positions).parameters)
    theirs = list(inspect.signature(SupportsMRoPE.get_mrope_input_positions).parameters)
    assert ours == theirs


def test_canvas_groups_frames_as_transformers():
    """The pure layout on a hand-made prompt (no vLLM, no transformers): a video's two frames separated only by
    markers are one group; text between them would split it."""
    mk = canvas.Markers(image_start=10, image_end=11, slice_start=12, slice_end=13, newline=14, image_pad=1,
                        video_pad=2)
    ids = [5, 10, 2, 2, 2, 2, 11, 10, 2, 2, 2, 2, 11, 6]
    (group,) = canvas.groups(ids, mk)
    assert (group.start, group.end, len(group.frames)) == (1, 13, 2)
    pos, delta = canvas.positions(ids, mk, [], [(8, 8), (8, 8)], merge=4)
    assert pos.shape == (3, len(ids)) and delta == int(pos.max()) + 1 - len(ids)
    assert canvas.groups([5, 10, 2, 2, 2, 2, 11, 7, 10, 2, 2, 2, 2, 11], mk)[0].frames[0].end == 7
    assert len(canvas.groups([5, 10, 2, 2, 2, 2, 11, 7, 10, 2, 2, 2, 2, 11], mk)) == 2


# --------------------------------------------------------------------------------------------------------------------
# The load: every parameter against the checkpoint's tensors
# --------------------------------------------------------------------------------------------------------------------

def _expert_parallel_group() -> None:
    """vLLM's model-parallel groups with an expert-parallel one, as its workers make them for a MoE model: vLLM's
    ``initialize_model_parallel`` creates the EP group only where the current config has no model or a MoE one, so
    groups an earlier dense build of this process made are made again (single rank, CPU)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from support.vllm_build import ensure_distributed

    ensure_distributed()
    if getattr(ps, "_EP", None) is not None:
        return
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    with set_current_vllm_config(VllmConfig()):
        ps.initialize_model_parallel(1, 1)


@here
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_parameter_equals_the_checkpoint(m46, ckpts, registered, environment, kind):
    from support.vllm_build import build_vllm_model, checkpoint_tensors, load_checkpoint
    from vllm.model_executor.models import qwen3_5

    m47 = importlib.import_module(bp.MODEL_MODULE)
    ckpt = checkpoint_tensors(ckpts[kind])
    _expert_parallel_group()
    with hotfix(m46, "auto", fixes=("qkv_loader", "qkv_completeness_guard")):
        model = build_vllm_model(ckpts[kind], load=False, model_cls=m47.MiniCPMV4_7ForConditionalGeneration)
        load_checkpoint(model, ckpts[kind])
    config = model.config
    assert len(model.vpm.encoder.layers) == config.vision_config.num_hidden_layers  # 4.7 keeps every vision layer
    lm_cls = qwen3_5.Qwen3_5MoeForCausalLM if kind == "moe" else qwen3_5.Qwen3_5ForCausalLM
    assert type(model.language_model) is lm_cls
    if kind == "moe":
        assert model.language_model.num_logical_experts == config.text_config.num_experts
    params, used, aliases = assert_every_parameter_equals(model, ckpt)
    if config.tie_word_embeddings:  # one tensor: the embedding is the head
        lm = model.language_model
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
    print(f"\n{kind} ({environment[0]}): {len(params)} parameters equal to {len(used)} checkpoint tensors "
          f"({len(aliases)} more names alias them)")


# --------------------------------------------------------------------------------------------------------------------
# The fixes act for the backport's classes
# --------------------------------------------------------------------------------------------------------------------


@here
def test_frame_budget_is_what_the_loader_samples(m46, ckpts, registered):
    """4.7's processing info budgets the 32 frames vLLM's video loader samples (stock: 16). Stock here means the
    fixes a request needs to reach the budget at all (transformers 5.24's ``downsample_mode``: :data:`PREREQUISITES`)."""
    from vllm_minicpm_hotfix.fixes import _base, video_budget

    def budget():
        info = make_pair(ckpts["dense"], {}).vllm.info
        assert _base.model_of(info) == "MiniCPM-V 4.7", type(info)
        return info.get_num_frames_with_most_features(2048 * 8, {"video": 1}), video_budget.loader_frames(info)

    with hotfix(m46, "auto", fixes=PREREQUISITES):
        stock_frames, loader = budget()
    with hotfix(m46, "auto", fixes=(*PREREQUISITES, "video_budget")):
        fixed, _ = budget()
    assert (stock_frames, loader, fixed) == (16, 32, 32)


@here
def test_refusal_names_the_served_model(m46, ckpts, registered):
    """With the prompt fix left out, a stock-killing request (``slice_mode: false`` on 449x448) reaches the guard,
    whose refusal (HTTP 400 in a server) names "MiniCPM-V 4.7"."""
    from vllm_minicpm_hotfix.fixes.placeholder_guard import PlaceholderMismatchError

    pair = make_pair(ckpts["dense"], {})
    with hotfix(m46, "auto", fixes=tuple(n for n in names() if n != "mm_placeholders")):
        with pytest.raises(PlaceholderMismatchError) as err:
            vllm_ids(pair, "image", [image(449, 448)], {"slice_mode": False})
    assert str(err.value).startswith("MiniCPM-V 4.7: image item 0 of this request has "), str(err.value)


@here
def test_summary_line_says_registered_by_the_hotfix(m46, registered):
    line = record.summary_line(record.current(), names())
    (parsed,) = record.parse_summary(line, names())
    assert parsed["backports"] == {"MiniCPM-V 4.7": "registered by the hotfix"}, line


# --------------------------------------------------------------------------------------------------------------------
# doctor: what it says of a backport (its renderer and verdict on hand-made child reports)
# --------------------------------------------------------------------------------------------------------------------


def _child(**backport) -> dict:
    row = {"name": bp.NAME, "member": bp.MEMBER, "verdict": "missing", "reason": "vLLM's registry has no X",
           "registered": True, "why": "missing here: ...", "error": None, "label": bp.LABEL, **backport}
    return {"status": {"backports": {bp.NAME: row}}}


@pytest.mark.placed("0.30.0")  # doctor's own code on made-up reports: the same everywhere (support.placement.LOGIC_ENV)
@pytest.mark.parametrize(("row", "status", "says"), [
    ({}, "OK", "registered by the hotfix (vLLM's registry has no X)"),
    ({"verdict": "correct", "registered": False, "reason": "vLLM's own: its registry has X (vllm.m:X)"}, "OK",
     "vLLM's own (its registry has X (vllm.m:X))"),
    ({"registered": False, "why": "VLLM_MINICPM_HOTFIX=off"}, "WARN", "not registered (VLLM_MINICPM_HOTFIX=off)"),
    ({"verdict": "error", "registered": False, "error": "RuntimeError: boom"}, "FAIL", "failed (RuntimeError: boom)"),
    ({"verdict": "unrecognised", "registered": False, "reason": "transformers 5.1 has no MiniCPMV4_7Config"}, "-",
     "not served here (transformers 5.1 has no MiniCPMV4_7Config)"),
], ids=["registered", "vllm-own", "off", "failed", "unrecognised"])
def test_doctor_row(row, status, says):
    from vllm_minicpm_hotfix.cli.doctor import table as doctor_table

    ((check, got_status, detail),) = doctor_table._backport_rows(_child(**row))
    assert (check, got_status, detail) == (f"backport {bp.NAME}", status, f"MiniCPM-V 4.7: {says}")


@pytest.mark.placed("0.30.0")
def test_doctor_fails_on_a_backport_that_failed_in_the_hook():
    from vllm_minicpm_hotfix.cli.doctor import verdict as doctor_verdict

    child = {**_child(verdict="error", registered=False, error="RuntimeError: boom"), "vllm_version": "0.28.0",
             "module": True, "steps": {"s": {"hook_installed": True}}}
    report = {"child": child, "fixes": {}, "vllm": {"installed": True, "version": "0.28.0"}}
    ok, line = doctor_verdict.judge(report)
    assert not ok and line.startswith("FAIL: the hotfix's backport minicpmv4_7 (MiniCPM-V 4.7) failed") and "boom" in line
    ok, line = doctor_verdict.judge({**report, "child": {**child, **_child()}})
    assert ok and line.endswith("; MiniCPM-V 4.7: registered by the hotfix"), line
