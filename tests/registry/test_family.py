"""The model family: every fix acts for exactly the members it declares (``MODELS``), and says plainly what it does
not cover.

* **Wrappers hand undeclared classes to vLLM.** For every fix and every attribute it sets on a class of vLLM's 4.6
  module: a recording stand-in is put in place of vLLM's value, the fix applied over it, and the class attribute
  called for an instance of (a) the "4.8" subclasses of :mod:`family_subclass` (a real subclass registered with
  vLLM's ``ModelRegistry`` and ``MULTIMODAL_REGISTRY`` as vLLM registers a model, in a module no member owns) and
  (b) where vLLM has it, MiniCPM-V 4.7's own class for a fix that does not declare 4.7. The stand-in must receive
  exactly the call's arguments and its result must come back unchanged: a wrapper that acts (changes an argument,
  replaces or edits the result, raises) fails here. The same call for a declared member's instance must reach the
  fix's own code (the check would otherwise prove nothing): at least one wrapper per fix changes something there.
* **Status and doctor say so.** After the hook (``_base.run``) each fix that reaches the 4.8 classes through
  inheritance has a ``models`` row for each of them (``unknown``, not applied, the reason naming the class), and
  doctor's renderer shows it as WARN; the family members present have their own rows (``declared``, verdict).

Placement: every environment (no engine, no checkpoint; < 2 s after ``import vllm``).
"""

from __future__ import annotations


import pytest

import vllm_minicpm_hotfix
from support.hotfix import hotfix
from vllm_minicpm_hotfix.fixes import REGISTRY, _base, names


class _Call:
    """A stand-in for vLLM's value of one attribute: records each call and returns a fresh sentinel."""

    def __init__(self, name: str) -> None:
        self.name, self.calls = name, []

    def make(self):
        rec = self

        def stand_in(*args, **kwargs):
            out = object()
            rec.calls.append((args, kwargs, out))
            return out

        stand_in.__name__ = self.name
        return stand_in


def _class_targets(fix, m46):
    """``(owner class, attr)`` of each of ``fix``'s SETS that is a class of vLLM's 4.6 module."""
    out = []
    for target in fix.SETS:
        found = _base.resolve(m46, target)
        if found is not None and isinstance(found[0], type) and found[0].__module__ == m46.__name__:
            out.append(found)
    return out


def _sentinels(fn):
    """Sentinel arguments for vLLM's ``fn`` (its required parameters after ``self``: positional ones by position,
    keyword-only ones by name)."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())[1:]
    args = tuple(object() for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                 and p.default is p.empty)
    kwargs = {p.name: object() for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    return args, kwargs


def _instance(cls):
    return cls.__new__(cls)


def _call_through(fix, m46, owner, attr, cls):
    """Apply ``fix`` over a recording stand-in of ``owner.attr`` and call ``cls``'s attribute for an instance of
    ``cls`` with sentinel arguments: ``(recorded calls, args, kwargs, result or exception)``."""
    rec = _Call(attr)
    before = owner.__dict__.get(attr, _base._MISSING)
    vllms = getattr(owner, attr)
    setattr(owner, attr, rec.make())
    try:
        fix.apply(m46)
        try:
            obj = _instance(cls)
            args, kwargs = _sentinels(vllms)
            try:
                got = getattr(cls, attr)(obj, *args, **kwargs)
            except Exception as exc:  # a wrapper that acts may raise on the sentinels: that is acting
                got = exc
            return rec.calls, (obj, *args), kwargs, got
        finally:
            _base.revert_fix(fix.NAME)
    finally:
        if before is _base._MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, before)


def _undeclared(m46):
    """``(fix, owner, attr, class)`` for every attribute a fix sets and every class that reaches it and that the fix
    does not declare: the "4.8" subclasses, and 4.7's where the fix does not declare 4.7."""
    from support import family_subclass

    # 4.7's model module here: vLLM's own (0.32+) or the backport's (0.22-0.30)
    m47 = getattr(_base.member_modules(m46).get("MiniCPM-V 4.7"), "__member_module__", None)
    out = []
    for fix in REGISTRY:
        for owner, attr in _class_targets(fix, m46):
            sub = family_subclass.SUBCLASSES.get(owner)
            if sub is not None:
                out.append((fix, owner, attr, sub))
            if m47 is not None and "MiniCPM-V 4.7" not in _base.models_of(fix):
                sub47 = getattr(m47, owner.__name__.replace("4_6", "4_7"), None)
                if isinstance(sub47, type) and issubclass(sub47, owner):
                    out.append((fix, owner, attr, sub47))
    return out


def test_wrappers_hand_undeclared_classes_to_vllm(m46):
    cases = _undeclared(m46)
    assert {fix.NAME for fix, *_ in cases} >= {
        "qkv_loader", "qkv_completeness_guard", "mm_placeholders", "video_image_id_cache", "encoder_modes",
        "video_tower", "video_budget", "placeholder_guard", "quantized_vision",
    }  # every fix with a wrapper on a model, processing-info or processor class
    acted = []
    for fix, owner, attr, cls in cases:
        if not callable(getattr(owner, attr, None)):  # a data attribute (lora_support's): the class sees stock's
            before = getattr(cls, attr, _base._MISSING)
            fix.apply(m46)
            try:
                after = getattr(cls, attr, _base._MISSING)
            finally:
                _base.revert_fix(fix.NAME)
            if after is not before and after != before:
                acted.append(f"{fix.NAME}: {owner.__name__}.{attr} is {after!r} for {_base.class_name(cls)}, stock "
                             f"{before!r}")
            continue
        calls, args, kwargs, got = _call_through(fix, m46, owner, attr, cls)
        ok = len(calls) == 1 and calls[0][0] == args and calls[0][1] == kwargs and (
            got is calls[0][2] or (attr == "__init__" and got is None))
        if not ok:
            acted.append(f"{fix.NAME}: {owner.__name__}.{attr} acted for {_base.class_name(cls)} "
                         f"(calls {len(calls)}, result {got!r})")
    assert not acted, "\n".join(acted)


def _view48(m46):
    """vLLM's 4.6 module with its classes replaced by the "4.8" subclasses (what a probe then judges)."""
    from types import ModuleType

    from support import family_subclass as fs

    view = ModuleType(fs.__name__)
    view.__dict__.update({k: v for k, v in vars(m46).items() if not k.startswith("__")})
    for base, sub in fs.SUBCLASSES.items():
        setattr(view, base.__name__, sub)
    return view


def test_undeclared_subclass_behaves_as_stock(m46):
    """Each fix's probe -- its behavioural test of the installed code -- run on the "4.8" classes gives the same
    verdict with every fix applied (``force``) as on stock vLLM, while on the 4.6 classes the applied fixes answer
    correct: the fixes changed 4.6's behaviour and left the undeclared subclass's alone. Where this vLLM is broken
    for a fix (on 0.32.0: mm_placeholders, video_tower, video_budget, placeholder_guard, quantized_vision,
    qkv_completeness_guard) a wrapper acting for 4.8 would turn its verdict to correct."""
    view = _view48(m46)
    classed = [fix for fix in REGISTRY if _class_targets(fix, m46)]  # not unsupported_quant_method (vllm.config)
    stock = {fix.NAME: fix.probe(view).state.value for fix in classed}
    # qkv_loader replaces the load_weights of vLLM's window-attention class, which every member's model (a 4.8's
    # too) builds as it is: the 4.8 model loads its vit_merger through it by design, so it is left out here, and
    # qkv_completeness_guard's probe (which loads through that class) is judged without it.
    shared = [n for n in names() if n != "qkv_loader"]
    with hotfix(m46, "force", fixes=shared) as statuses:
        now = {fix.NAME: fix.probe(view).state.value for fix in classed if fix.NAME in shared}
        own = {fix.NAME: fix.probe(m46).state.value for fix in REGISTRY
               if fix.NAME in statuses and statuses[fix.NAME].applied}
    stock = {k: v for k, v in stock.items() if k in shared}
    assert now == stock, {k: (stock[k], now[k]) for k in stock if stock[k] != now[k]}
    assert set(own.values()) == {"correct"}, own
    assert "broken" in stock.values()  # this environment shows at least one fix whose stock verdict a wrapper flips


@pytest.mark.stock_pin
def test_member_verdicts_are_pinned(m46, environment, monkeypatch):
    """Under ``auto`` the hook probes every family member present here on its own classes: ``status()`` records per
    member the stock verdict tests/support/expected.py pins (4.7 only where vLLM and transformers have it), applies each fix
    exactly for the declared members whose verdict is broken, and the patched member's re-probe answers correct."""
    from support import expected as table

    from vllm_minicpm_hotfix.fixes._base import deferred

    monkeypatch.setattr(deferred, "EAGER", True)  # every fix probed at import: the pinned verdicts are stock's
    present = set(_base.member_modules(m46))
    pinned = {m: table.member_verdicts(m, environment) for m in table.MEMBER_VERDICTS}
    assert present - {"MiniCPM-V 4.6"} == {m for m, v in pinned.items() if v is not None}, (present, pinned)
    with hotfix(m46, "auto", fixes=None):
        fixes = vllm_minicpm_hotfix.status()["fixes"]
        views = _base.member_modules(m46)
        for fix in REGISTRY:
            for member, want in ((m, v[fix.NAME]) for m, v in pinned.items() if v is not None):
                row = fixes[fix.NAME]["models"][member]
                assert row["verdict"] == want, (fix.NAME, member, row)
                assert row["applied"] is (want == "broken"), (fix.NAME, member, row)
                if row["applied"]:
                    now = fix.probe(views[member])
                    assert now.state.value == "correct", (fix.NAME, member, now.reason)


def test_status_and_doctor_name_undeclared_subclasses(m46):
    from support import family_subclass  # noqa: F401 - defines and registers the "4.8" classes

    from vllm_minicpm_hotfix.cli.doctor import table as doctor_render, verdict as doctor_judge

    with hotfix(m46, "force", fixes=None):
        fixes = vllm_minicpm_hotfix.status()["fixes"]
    from support import family_subclass as fs

    reached = set()
    for fix in REGISTRY:
        want = {_base.class_name(fs.SUBCLASSES[o]) for o, _ in _class_targets(fix, m46) if o in fs.SUBCLASSES}
        if not want:
            continue
        reached.add(fix.NAME)
        rows = fixes[fix.NAME]["models"]
        unknown = {k: r for k, r in rows.items() if r.get("unknown")}
        assert set(unknown) >= want, (fix.NAME, rows)
        for cls_name in want:
            row = unknown[cls_name]
            assert row["applied"] is False and row["declared"] is False, row
            assert cls_name in row["why"] and "does not cover it" in row["why"], row
        assert rows["MiniCPM-V 4.6"]["declared"] is True, rows
    present = _base.member_modules(m46)
    for fix in REGISTRY:
        rows = fixes[fix.NAME]["models"]
        for member in present:
            assert rows[member]["declared"] is (member in _base.models_of(fix)), (fix.NAME, member, rows[member])

    # doctor, from what its child process reports (the same functions it runs there)
    from vllm_minicpm_hotfix.cli.doctor import child as doctor_child

    child = {"status": {"fixes": fixes}}
    child.update(doctor_child.probe_fixes({"package": "vllm_minicpm_hotfix"}, m46, ""))
    verdicts = doctor_judge.assess_fixes(child)
    rows = doctor_render._fix_rows(verdicts)
    warn = [r for r in rows if r[1] == "WARN" and "family_subclass.MiniCPMV4_8" in r[2]]
    assert {r[0].split(" [")[0] for r in warn} == reached, rows


# --------------------------------------------------------------------------------------------------------------------
# MiniCPM-V 4.7 (vLLM 0.32+ with transformers >= 5.19): canvas M-RoPE positions, the frame budget
# --------------------------------------------------------------------------------------------------------------------

from support.prompt import PROMPT, V47_ENVS, image, make_pair, vllm_ids, with_hotfix, write_v47  # noqa: E402


@pytest.fixture(scope="module")
def v47(tmp_path_factory):
    return write_v47(tmp_path_factory.mktemp("v47") / "ckpt")


#: (width, height, request kwargs): sliced, wide, tall, and two of the requests whose prompts stock gets wrong.
MROPE_CASES = [(449, 448, {}), (640, 480, {}), (300, 900, {}), (640, 480, {"slice_mode": False}),
               (448, 448, {"scale_resolution": 224}), (300, 200, {"use_image_id": False})]


def _vllm_canvas_model(config):
    """vLLM's ``MiniCPMV4_7ForConditionalGeneration`` with only what ``get_mrope_input_positions`` reads, set by its
    own ``_init_canvas_mrope`` from ``config`` (the checkpoint's); created without ``__init__`` (no weights)."""
    from torch import nn
    from vllm.model_executor.models import minicpmv4_7 as m47

    model = m47.MiniCPMV4_7ForConditionalGeneration.__new__(m47.MiniCPMV4_7ForConditionalGeneration)
    nn.Module.__init__(model)
    model.config = config
    model._init_canvas_mrope(None)  # returns before its tokenizer fallback: the config carries every id
    return model


@pytest.mark.placed(*V47_ENVS)
def test_v47_mrope_positions_equal_transformers(m46, v47):
    """For the prompt the hotfix builds (equal to transformers'), vLLM's canvas ``get_mrope_input_positions`` -- fed
    the item's ``tgt_sizes`` as its engine feeds them -- equals transformers' ``MiniCPMV4_7Model.get_rope_index``,
    position for position (``[T, H, W]``), with the hotfix (``canvas_mrope``) as vLLM builds the model from this
    checkpoint. Stock vLLM turns canvas M-RoPE on only when the config says ``uses_mrope_canvas`` or a ``mrope_mode``
    containing "canvas"; transformers' ``MiniCPMV4_7Config`` has neither field and its model always lays out the
    canvas, so stock serves this checkpoint with sequential positions (shown below, first)."""
    import types

    import torch
    from transformers import MiniCPMV4_7ForConditionalGeneration

    pair = make_pair(v47, {})
    hf = pair.hf
    reference = MiniCPMV4_7ForConditionalGeneration.from_pretrained(str(v47)).model
    config = reference.config
    assert _vllm_canvas_model(config)._uses_canvas_mrope is False  # stock, as vLLM builds it from this checkpoint
    misses = []
    with with_hotfix(m46):
        model = _vllm_canvas_model(config)
        assert model._uses_canvas_mrope is True
        for w, h, kw in MROPE_CASES:
            img = image(w, h)
            out = hf(text=[PROMPT.format(mm=hf.image_token)], images=[img], **kw)
            ids = vllm_ids(pair, "image", [img], kw)
            assert ids == out["input_ids"][0].tolist(), (w, h, kw)
            want, _ = reference.get_rope_index(out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
                                               target_sizes=out["target_sizes"])
            feature = types.SimpleNamespace(
                data={"tgt_sizes": types.SimpleNamespace(data=torch.as_tensor(out["target_sizes"]))},
                mm_position=types.SimpleNamespace(offset=ids.index(config.image_start_id)),
            )
            got, _ = model.get_mrope_input_positions(ids, [feature])
            if not torch.equal(got, want[:, 0, :]):
                misses.append(f"{w}x{h} {kw}: {int((got != want[:, 0, :]).sum())} positions differ")
            seq = torch.arange(len(ids)).unsqueeze(0).expand(3, -1)
            assert not torch.equal(want[:, 0, :], seq), "the canvas of an image is not sequential positions"
    assert not misses, misses


@pytest.mark.placed(*V47_ENVS)
def test_v47_frame_budget(m46, v47):
    """The frames per video 4.7's processing info budgets for equal what vLLM's video loader samples (32, from
    ``VideoMediaIO``): stock vLLM budgets 16."""
    from vllm_minicpm_hotfix.fixes import video_budget

    def budget():
        info = make_pair(v47, {}).vllm.info
        assert _base.model_of(info) == "MiniCPM-V 4.7", type(info)
        return info.get_num_frames_with_most_features(2048 * 8, {"video": 1}), video_budget.loader_frames(info)

    stock_frames, loader = budget()
    with hotfix(m46, "auto", fixes=("video_budget",)):
        fixed, _ = budget()
    assert (stock_frames, loader, fixed) == (16, 32, 32)


@pytest.mark.placed(*V47_ENVS)
def test_v47_refusal_names_the_served_model(m46, v47):
    """With the prompt fix left out, the stock-killing 4.7 request (``slice_mode: false`` on 449x448) reaches
    ``placeholder_guard``, whose refusal names the model actually served: "MiniCPM-V 4.7", not 4.6."""
    from vllm_minicpm_hotfix.fixes import names
    from vllm_minicpm_hotfix.fixes.placeholder_guard import PlaceholderMismatchError

    pair = make_pair(v47, {})
    with hotfix(m46, "auto", fixes=tuple(n for n in names() if n != "mm_placeholders")):
        with pytest.raises(PlaceholderMismatchError) as err:
            vllm_ids(pair, "image", [image(449, 448)], {"slice_mode": False})
    assert str(err.value).startswith("MiniCPM-V 4.7: image item 0 of this request has "), str(err.value)


@pytest.mark.placed(*V47_ENVS)
def test_doctor_fails_a_declared_member_left_broken(m46):
    """A fix applied for 4.6 but not acting for 4.7 (which it declares), 4.7's classes still broken: doctor's row for
    the fix on 4.7 is FAIL and its verdict fails naming MiniCPM-V 4.7, while every 4.6 row is OK."""
    from vllm_minicpm_hotfix.cli.doctor import child as doctor_child, table as doctor_render, verdict as doctor_judge

    with hotfix(m46, "force", fixes=None):
        _base._ACTIVE["mm_placeholders"] = frozenset({"MiniCPM-V 4.6"})  # as if the hook had chosen 4.6 only
        child = {"status": vllm_minicpm_hotfix.status(), "vllm_version": "x", "steps": {"s": {"hook_installed": True}}}
        child.update(doctor_child.probe_fixes({"package": "vllm_minicpm_hotfix"}, m46, ""))
    verdicts = doctor_judge.assess_fixes(child)
    rows = {r[0]: r for r in doctor_render._fix_rows(verdicts)}
    assert rows["mm_placeholders [MiniCPM-V 4.7]"][1] == "FAIL", rows["mm_placeholders [MiniCPM-V 4.7]"]
    assert all(rows[fix.NAME][1] == "OK" for fix in REGISTRY), rows
    ok, line = doctor_judge.judge({"child": child, "fixes": verdicts, "vllm": {"installed": True, "version": "x"}})
    assert not ok and "MiniCPM-V 4.7" in line and "image/video placeholder text" in line, line


# --------------------------------------------------------------------------------------------------------------------
# The order vLLM imports the members' modules in: each member probed on its own classes, once complete
# --------------------------------------------------------------------------------------------------------------------

M46, M47 = "vllm.model_executor.models.minicpmv4_6", "vllm.model_executor.models.minicpmv4_7"


def _member_import(*modules: str) -> tuple[dict, str]:
    """tests/programs/member_import.py in a fresh interpreter of this environment: (its JSON, its log)."""
    import os

    from support.paths import REPO
    from support.programs import run_reporting

    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_MINICPM_HOTFIX", "PYTHONPATH")}
    return run_reporting("member_import", REPO, *modules, env={**env, "VLLM_TARGET_DEVICE": "cpu"}, timeout=300)


@pytest.mark.placed("0.33.0")
@pytest.mark.parametrize("order", [(M47,), (M46,), (M46, M47)], ids=["4.7 served", "4.6 served", "4.6 then 4.7"])
def test_each_member_is_probed_on_its_own_classes_whatever_the_import_order(environment, order):
    """Serving 4.7, vLLM imports ``minicpmv4_7``, which imports ``minicpmv4_6`` first: the hook then runs before
    4.7's classes exist. It waits for that import to end and probes 4.7 on 4.7's own classes, with the verdicts
    tests/support/expected.py pins for them, and the fixes act for 4.7 exactly where its verdict is broken; one summary line
    names both members. Serving 4.6, ``minicpmv4_7`` is never imported and nothing of 4.7 is probed. Imported
    later (4.6 first), the hook runs again for both members on stock classes, and says so in one more WARNING line.
    Placed on 0.33.0 (one fresh vLLM import each; 0.32.0 has the same modules, and its session is a long one)."""
    from support import expected as table
    from support.hotfix_log import summaries

    out, log = _member_import(*order)
    lines = summaries(log)
    assert len(lines) == 1, log[-4000:]
    if order == (M46,):
        assert out["imported"] == [M46] and out["models"] == ["MiniCPM-V 4.6"], out
        assert all("MiniCPM-V 4.7" not in rows for rows in out["rows"].values()), out["rows"]
        assert lines[0]["models"] == ["MiniCPM-V 4.6"]
        return
    pinned = table.member_verdicts("MiniCPM-V 4.7", environment)
    assert out["models"] == ["MiniCPM-V 4.6", "MiniCPM-V 4.7"], out
    assert lines[0]["models"] == (["MiniCPM-V 4.6", "MiniCPM-V 4.7"] if order == (M47,) else ["MiniCPM-V 4.6"])
    for name, want in pinned.items():
        verdict, applied = out["rows"][name]["MiniCPM-V 4.7"]
        assert verdict == want, (name, out["rows"][name])
        assert applied is (want == "broken"), (name, out["rows"][name])
        assert ("MiniCPM-V 4.7" in out["active"].get(name, ())) is (want == "broken"), (name, out["active"])
    rerun = [line for line in log.splitlines() if "imported in pid" in line and "every fix re-run" in line]
    assert len(rerun) == (1 if order == (M46, M47) else 0), log[-4000:]


def test_the_hook_watches_every_other_member_module():
    """hook.MEMBER_MODULES (kept out of the light hook module's imports) is every family module but the hook's own."""
    from vllm_minicpm_hotfix import hook

    assert set(hook.MEMBER_MODULES) == set(_base.FAMILY) - {hook.TARGET_MODULE}
