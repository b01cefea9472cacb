"""The registry of fixes against the installed vLLM: every fix has the interface, every fix's verdict on stock vLLM is
the one tests/support/expected.py pins for this environment, and the post-import hook runs exactly the registry."""

from __future__ import annotations

import json

from support import expected as table
import pytest

import vllm_minicpm_hotfix
from vllm_minicpm_hotfix import decision, hook, record
from vllm_minicpm_hotfix.fixes import REGISTRY, _base, by_name, names
from vllm_minicpm_hotfix.fixes._base import deferred


def test_every_fix_has_the_interface():
    assert len(set(names())) == len(REGISTRY), names()
    for fix in REGISTRY:
        assert isinstance(fix.NAME, str) and fix.NAME.isidentifier(), fix
        assert isinstance(fix.LABEL, str) and fix.LABEL, fix
        assert isinstance(fix.SETS, tuple) and fix.SETS and all(isinstance(t, str) for t in fix.SETS), fix
        assert callable(fix.probe) and callable(fix.apply), fix
        assert isinstance(fix.PATCHES, dict) and fix.SETS == tuple(fix.PATCHES), fix
        assert all(callable(f) or isinstance(f, (_base.Patch, _base.OnImport)) for f in fix.PATCHES.values()), fix
        assert by_name(fix.NAME) is fix
    with pytest.raises(KeyError, match="no fix named"):
        by_name("nope")


def _patch_module():
    """A model module stand-in: ``Model.f`` and ``Model.g`` (functions), ``Model.h`` absent."""
    import types

    module = types.ModuleType("patch_table_stand_in")

    class Model:
        def f(self):
            return "f"

        def g(self):
            return "g"

    module.Model = Model
    return module, Model


def _wrapping(tag):
    def factory(original, owner):
        def wrapper(self):
            return f"{tag}({original(self)})"

        return wrapper

    return factory


def test_apply_patches_sets_marks_records_and_reverts():
    """One table, one transaction: each factory gets the value there now and the owner; a factory returning None
    leaves its target alone; every value set is marked with the fix, recorded and reverted."""
    module, model = _patch_module()
    seen = []

    def keep_owner(original, owner):
        seen.append(owner)
        return None

    table = {"Model.f": _wrapping("w"), "Model.g": keep_owner, "Model.h": lambda original, owner: None}
    assert _base.apply_patches("patch_table_test", module, table) == ["Model.f"]
    try:
        assert model().f() == "w(f)" and model().g() == "g" and "h" not in vars(model)
        assert seen == [model]
        assert _base.patched_by(model, "f") == "patch_table_test" and _base.patched_by(model, "g") is None
    finally:
        assert _base.revert_fix("patch_table_test")
    assert model().f() == "f" and not _base.has_set("patch_table_test")


def test_apply_patches_is_all_or_nothing():
    """A factory that raises, or a target whose owner is not there, leaves every class as it was."""
    module, model = _patch_module()
    before = dict(vars(model))

    def boom(original, owner):
        raise RuntimeError("synthetic")

    with pytest.raises(RuntimeError, match="synthetic"):
        _base.apply_patches("patch_table_test", module, {"Model.f": _wrapping("w"), "Model.g": boom})
    assert dict(vars(model)) == before
    with pytest.raises(AttributeError, match="Missing.f"):
        _base.apply_patches("patch_table_test", module, {"Model.f": _wrapping("w"), "Missing.f": _wrapping("x")})
    assert dict(vars(model)) == before and not _base.has_set("patch_table_test")


def test_on_import_target_is_set_when_its_module_is_imported(tmp_path, monkeypatch):
    """An ``on_import`` target in a module not imported yet is not imported by the fix: it is set when the module is
    imported, if the fix is still applied then; one whose module is imported is set with the rest."""
    import importlib
    import sys

    module, model = _patch_module()
    name = "patch_table_later"
    (tmp_path / f"{name}.py").write_text("def later():\n    return 'later'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    table = {"Model.f": _wrapping("w"), f"{name}:later": _base.on_import(lambda original, owner: lambda: "wrapped")}
    try:
        assert _base.apply_patches("patch_table_test", module, table) == ["Model.f"]
        assert name not in sys.modules
        later = importlib.import_module(name)
        assert later.later() == "wrapped" and _base.patched_by(later, "later") == "patch_table_test"
        _base.revert_fix("patch_table_test")
        assert later.later() == "later"
        assert _base.apply_patches("patch_table_test", module, table) == ["Model.f", f"{name}:later"]
        assert later.later() == "wrapped"
    finally:
        _base.revert_fix("patch_table_test")
        sys.modules.pop(name, None)
    assert later.later() == "later" and model().f() == "f"


def test_one_name_per_fix():
    """A fix's NAME is its module's name, and the name of its test file, tests/fixes/test_<NAME>.py."""
    from support.paths import REPO

    tests = REPO / "tests"
    for fix in REGISTRY:
        assert fix.__name__ == f"vllm_minicpm_hotfix.fixes.{fix.NAME}", (fix.__name__, fix.NAME)
        assert (tests / "fixes" / f"test_{fix.NAME}.py").is_file(), fix.NAME


@pytest.mark.stock_pin
@pytest.mark.parametrize("name", names())
def test_stock_verdict_is_pinned(m46, environment, name):
    """The probe on stock vLLM gives the verdict tests/support/expected.py pins here (a fix or an environment missing from the
    table fails)."""
    try:
        want = table.verdict(name, environment)
    except table.UnknownEnvironment as exc:
        pytest.fail(str(exc))
    got = by_name(name).probe(m46)
    print(f"\n{name} on vLLM {environment[0]} + transformers {environment[1]}: {got.state.value}: {got.reason}")
    assert got.state.value == want, got


@pytest.mark.parametrize("name", names())
def test_probe_after_apply_says_correct(m46, environment, name, monkeypatch, hotfix_mode):
    """Where a fix applies (force), its own probe re-run on the patched classes answers ``correct``: what doctor uses
    to verify the patched code in a fresh vLLM process (a fix probed at first use is probed at import here)."""
    fix = by_name(name)
    monkeypatch.setattr(deferred, "EAGER", True)
    hotfix_mode("force")
    try:
        entry = _base.run(fix, m46)
        if entry.applied:
            assert _base.is_patched(fix, m46)
            after = fix.probe(m46)
            assert after.state is decision.State.CORRECT, after
        else:
            assert not _base.is_patched(fix, m46)
    finally:
        _base.revert(m46)


def test_hook_runs_the_registry_and_status_lists_every_fix(m46, environment, monkeypatch, hotfix_mode):
    """Every fix probed at import (``VLLM_MINICPM_HOTFIX_PROBES=eager``: the ones probed at first use too) records
    the pinned verdict."""
    monkeypatch.setenv(deferred.ENV_VAR, "eager")
    hotfix_mode(None)
    try:
        hook.on_import(m46)
        st = vllm_minicpm_hotfix.status()
        json.dumps(st)
        assert list(st["fixes"]) == names()
        others = [table.member_verdicts(m, environment) or {} for m in st["models"] if m != "MiniCPM-V 4.6"]
        for name, entry in st["fixes"].items():
            want = table.verdict(name, environment)
            assert entry["verdict"] == want, entry
            # applied where 4.6 or another member present needs it (canvas_mrope: 4.7 only)
            assert entry["applied"] is (want == "broken" or any(v.get(name) == "broken" for v in others)), entry
            assert entry["label"] == by_name(name).LABEL
            assert entry["first_use"] is False, entry
            assert _base.is_patched(by_name(name), m46) is entry["applied"]
        # As doctor re-probes after the hook: with every fix applied (some wrap the same attribute), each applied
        # fix's own probe still answers correct.
        for name, entry in st["fixes"].items():
            if entry["applied"]:
                after = by_name(name).probe(m46)
                assert after.state is decision.State.CORRECT, (name, after)
    finally:
        _base.revert(m46)


def test_hook_defers_the_probes_of_unused_paths(m46, environment, hotfix_mode):
    """By default the fixes with ``DEFER_AT`` are recorded "probed at first use" (verdict ``deferred``, not applied,
    their trigger in place) and every other fix as pinned. ``status()`` probes the processor path's group (as vLLM's
    first processor would): pinned verdicts, applied where broken; resolving the rest gives the pinned verdicts too."""
    hotfix_mode(None)
    try:
        hook.on_import(m46)
        st = record.current().as_dict()
        later = [n for n in names() if getattr(by_name(n), "DEFER_AT", None)]
        group = [n for n in later if by_name(n).DEFER_AT is _base.PROCESSOR_PATH]
        assert later and group and set(group) != set(later), (later, group)
        for name, entry in st["fixes"].items():
            if name in later:
                assert (entry["verdict"], entry["applied"], entry["first_use"]) == ("deferred", False, True), entry
                assert deferred.pending(name)
            else:
                assert entry["verdict"] == table.verdict(name, environment), entry
        st = vllm_minicpm_hotfix.status()  # the processor path's probes now
        assert list(st["fixes"]) == names()
        others = [table.member_verdicts(m, environment) or {} for m in st["models"] if m != "MiniCPM-V 4.6"]
        for name in later:
            entry = st["fixes"][name]
            if name in group:  # as probed at import (test_hook_runs_the_registry_and_status_lists_every_fix)
                want = table.verdict(name, environment)
                needed = want == "broken" or any(v.get(name) == "broken" for v in others)
                assert (entry["verdict"], entry["applied"], entry["first_use"]) == (want, needed, True), entry
                assert not deferred.pending(name) and _base.is_patched(by_name(name), m46) is needed
            else:
                assert entry["verdict"] == "deferred" and deferred.pending(name), entry
        resolved = deferred.resolve_all()
        assert sorted(resolved) == sorted(set(later) - set(group))
        for name in later:
            entry = vllm_minicpm_hotfix.status()["fixes"][name]
            want = table.verdict(name, environment)
            needed = want == "broken" or any(v.get(name) == "broken" for v in others)
            assert (entry["verdict"], entry["applied"], entry["first_use"]) == (want, needed, True), entry
    finally:
        _base.revert(m46)


def test_a_fix_reverted_while_its_group_waits_is_never_applied(m46, environment, hotfix_mode):
    """``revert_fix`` of a fix waiting in the processor path's group (what a process that wants stock vLLM's
    behaviour for it does right after the hook): the group's probe, when it comes, leaves it unapplied and vLLM's
    own code in place, and applies the others as usual; reverting every member removes the group's triggers."""
    hotfix_mode(None)
    group = [n for n in names() if getattr(by_name(n), "DEFER_AT", None) is _base.PROCESSOR_PATH]
    broken = [n for n in group if table.verdict(n, environment) == "broken"]
    assert len(broken) >= 2, broken  # one to revert, one to see applied
    try:
        hook.on_import(m46)
        assert _base.revert_fix(broken[0]) is True
        st = vllm_minicpm_hotfix.status()  # the group's probes now
        assert (st["fixes"][broken[0]]["applied"], st["fixes"][broken[0]]["why"]) == (False, "reverted")
        assert not _base.is_patched(by_name(broken[0]), m46)
        assert st["fixes"][broken[1]]["applied"] is True and _base.is_patched(by_name(broken[1]), m46)
        _base.revert(m46)
        hook.on_import(m46)
        for name in group:
            _base.revert_fix(name)
        assert not _base.has_set(_base.PROCESSOR_PATH.name)
        vllm_minicpm_hotfix.status()
        assert not any(_base.is_patched(by_name(n), m46) for n in group)
    finally:
        _base.revert(m46)


def _bind_or_error(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except TypeError:
        return TypeError


#: The vLLM methods whose arguments the wrappers read by name through ``_base.arguments`` (module, class, method).
BOUND_METHODS = (
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "apply"),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_merge_mm_kwargs"),
    ("vllm.model_executor.models.minicpmv", "MiniCPMVMultiModalProcessor", "process_mm_inputs"),
    ("vllm.multimodal.processing", "BaseMultiModalProcessor", "_get_mm_prompt_updates"),
    ("vllm.model_executor.models.minicpmv4_6", "MiniCPMV4_6ProcessingInfo", "get_slice_image_placeholder"),
)


def test_weak_memo_keeps_an_entry_only_for_the_same_live_objects():
    """_base.WeakMemo (the request path's memos): a hit needs the very objects the entry was kept with, alive; an
    object that cannot be weakly referenced is not kept; the memo is cleared when it holds ``limit`` entries."""
    import gc

    class Processor:
        pass

    class Slotted:
        __slots__ = ()

    memo = _base.WeakMemo(limit=2)
    a = Processor()
    memo.put(("text", id(a)), (a,), "of a")
    assert memo.get(("text", id(a)), (a,)) == "of a"
    assert memo.get(("text", id(a)), (Processor(),)) is None  # another object under the same key
    key = ("text", id(a))
    del a
    gc.collect()
    assert memo.get(key, (Processor(),)) is None  # the kept object is gone: even an object reusing its id misses
    memo.put(("slotted",), (Slotted(),), 1)
    assert memo.get(("slotted",), (Slotted(),)) is None
    memo.put(("x",), (), 1)  # two entries held now (limit 2): the next put clears them first
    memo.put(("y",), (), 2)
    assert memo.get(("x",)) is None and memo.get(("y",)) == 2


@pytest.mark.parametrize("where", BOUND_METHODS, ids=lambda w: f"{w[1]}.{w[2]}")
def test_arguments_bind_as_inspect_does(m46, where):
    """``_base.arguments`` (the wrappers' access by name, a zip for plain signatures) against
    ``inspect.Signature.bind`` on the installed vLLM's own methods: the same arguments by name for every call shape
    (all positional, all by keyword, mixed; the instance apart, as wrapt passes it, or not), and TypeError exactly
    where inspect raises."""
    import importlib
    import inspect

    mod_name, cls_name, attr = where
    original = getattr(getattr(importlib.import_module(mod_name), cls_name), attr)
    original = getattr(original, "__wrapped__", original)
    sig = inspect.signature(original)
    names = list(sig.parameters)
    assert len(names) >= 2, sig
    values = [object() for _ in names]
    calls = [(values, {}), ([], dict(zip(names, values))), (values[:1], dict(zip(names[1:], values[1:]))),
             (values[:-1], {}), (values + [object()], {}), (values, {names[-1]: values[-1]}),
             (values[:1], {"no_such_argument": 1, **dict(zip(names[1:], values[1:]))})]
    thin = _base.Signature.of(original)
    for args, kwargs in calls:
        want = _bind_or_error(lambda *a, **k: dict(sig.bind(*a, **k).arguments), *args, **kwargs)
        assert _bind_or_error(lambda *a, **k: _base.arguments(thin, None, a, k), *args, **kwargs) == want, \
            (attr, len(args), sorted(kwargs))
        if args:
            assert _bind_or_error(lambda *a, **k: _base.arguments(thin, a[0], a[1:], k), *args, **kwargs) == want, \
                (attr, "instance apart", len(args), sorted(kwargs))
