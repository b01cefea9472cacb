"""The framework's promises about every fix, read from the fixes' own source and run on stand-in classes.

* **Every fix is a uniform card**: ``NAME`` is its module's name, ``LABEL``, ``MODELS`` (members of ``FAMILY``),
  ``AFTER`` (known fixes), ``PATCHES`` of the framework's kinds only, and a docstring of the one template (a summary
  line, then exactly the headings *What breaks*, *What the fix does*, *The decision*, *Upstream* (the vLLM issue or
  PR, or "none known") and *Remove when* (what its probe sees on a release that needs it no more), in that order;
  the backports' cards likewise, with *What is missing* and *What the backport does*).
* **Order is data**: ``REGISTRY`` lists each fix after every fix its ``AFTER`` names.
* **A fix holds only its behaviour**: no fix module calls the class policy (``covers``, ``note_unknown``,
  ``acts_for``), binds arguments (``binder``, ``signature``), builds its own wrapper (``functools.wraps`` / ``update_wrapper``) or
  sets a mark (``__wrapped__``, ``__vllm_minicpm_hotfix__``, ``__vllm_minicpm_hotfix_original__``), and none spells a
  vLLM class name the family module names -- read from each module's syntax tree.
* **The policy is the framework's**: on stand-in classes of the family's modules, a behaviour runs for a declared
  member's instance and never for an undeclared member's or an unknown subclass's (reported once); a factory that
  hands the framework a function instead of a patch is refused before anything is set.
* **The import graph**: no circle, and no module imports one on a higher floor (leaves, the framework, the fixes,
  the registry, the hook, the activation, the command line), from every import statement of the package.

Placement: the package's own logic, the same code and inputs everywhere: one environment (support.placement.LOGIC_ENV).
"""

from __future__ import annotations

import ast
import importlib
import re
import types
from pathlib import Path

import pytest
from support.placement import LOGIC_ENV

import vllm_minicpm_hotfix
from vllm_minicpm_hotfix import fixes
from vllm_minicpm_hotfix.fixes import REGISTRY, _base

pytestmark = pytest.mark.placed(*LOGIC_ENV)

PACKAGE = Path(vllm_minicpm_hotfix.__file__).parent
HEADINGS = ["What breaks", "What the fix does", "The decision", "Upstream", "Remove when"]
#: A backport's card (vllm_minicpm_hotfix/backports/): the same template for an architecture vLLM lacks.
BACKPORT_HEADINGS = ["What is missing", "What the backport does", "The decision", "Upstream", "Remove when"]
#: Names a fix module may not call or assign: the wrapper's opening is the framework's.
FORBIDDEN_CALLS = {"covers", "note_unknown", "acts_for", "binder", "wraps", "update_wrapper"}
FORBIDDEN_ATTRS = {"__wrapped__", "__vllm_minicpm_hotfix__", "__vllm_minicpm_hotfix_original__"}


def _heading_lines(lines: list[str]) -> list[int]:
    return [i for i in range(len(lines) - 1)
            if lines[i].strip() and re.fullmatch(r"-{3,}", lines[i + 1].strip() or "x")]


def _headings(doc: str) -> list[str]:
    lines = doc.splitlines()
    return [lines[i].strip() for i in _heading_lines(lines)]


def _section(doc: str, heading: str) -> str:
    """The text under ``heading`` (up to the next heading or the end), on one line."""
    lines = doc.splitlines()
    starts = _heading_lines(lines)
    i = next(i for i in starts if lines[i].strip() == heading)
    end = next((j for j in starts if j > i), len(lines))
    return " ".join(lines[i + 2:end]).strip()


def _upstream_ok(doc: str) -> bool:
    """An *Upstream* section names a vLLM issue or PR (``vllm-project/vllm#N``) or says ``none known``."""
    text = _section(doc, "Upstream")
    return bool(re.search(r"vllm-project/vllm#\d+", text)) or text.lower().startswith("none known")


def _tree(fix: types.ModuleType) -> ast.Module:
    return ast.parse(Path(fix.__file__).read_text())


def test_every_fix_is_a_uniform_card():
    members = set(_base.FAMILY.values())
    names = {fix.NAME for fix in REGISTRY}
    for fix in REGISTRY:
        assert fix.NAME == fix.__name__.rpartition(".")[2], fix
        assert (PACKAGE.parent / "tests" / "fixes" / f"test_{fix.NAME}.py").is_file(), fix.NAME
        assert isinstance(fix.LABEL, str) and fix.LABEL, fix.NAME
        assert set(_base.models_of(fix)) <= members and _base.models_of(fix), fix.NAME
        assert set(getattr(fix, "AFTER", ())) <= names - {fix.NAME}, fix.NAME
        doc = fix.__doc__ or ""
        assert doc.splitlines()[0].strip(), fix.NAME  # a summary line first
        assert _headings(doc) == HEADINGS, (fix.NAME, _headings(doc))
        assert _upstream_ok(doc) and _section(doc, "Remove when"), fix.NAME
        for target, value in fix.PATCHES.items():
            inner = value.factory if isinstance(value, _base.OnImport) else value
            assert isinstance(inner, _base.Patch) or callable(inner), (fix.NAME, target, value)


def test_every_backport_is_a_uniform_card():
    """Each backport's docstring: a summary line, then exactly :data:`BACKPORT_HEADINGS`, in that order; its
    *Upstream* names a vLLM issue or PR or says "none known", and *Remove when* is not empty."""
    from vllm_minicpm_hotfix.backports import BACKPORTS

    assert BACKPORTS
    for bp in BACKPORTS:
        doc = bp.__doc__ or ""
        assert doc.splitlines()[0].strip(), bp.NAME
        assert _headings(doc) == BACKPORT_HEADINGS, (bp.NAME, _headings(doc))
        assert _upstream_ok(doc) and _section(doc, "Remove when"), bp.NAME


def test_registry_order_follows_after():
    assert fixes.out_of_order() == []
    by_name = {fix.NAME: fix for fix in REGISTRY}
    swapped = [by_name[n] for n in ("qkv_completeness_guard", "qkv_loader")]
    assert fixes.out_of_order(tuple(swapped)) == ["qkv_completeness_guard must come after qkv_loader"]
    assert any(getattr(fix, "AFTER", ()) for fix in REGISTRY)


def test_no_fix_writes_its_own_opening_or_names_a_vllm_class():
    class_names = {getattr(_base, n) for n in ("MODEL_CLASS", "INFO_CLASS", "PROCESSOR_CLASS", "ATTN_CLASS")}
    found = []
    for fix in REGISTRY:
        for node in ast.walk(_tree(fix)):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
                if name in FORBIDDEN_CALLS:
                    found.append(f"{fix.NAME}:{node.lineno} calls {name}")
                if name == "setattr" and any(isinstance(a, ast.Constant) and a.value in FORBIDDEN_ATTRS
                                             for a in node.args):
                    found.append(f"{fix.NAME}:{node.lineno} sets a mark")
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Attribute) and t.attr in FORBIDDEN_ATTRS:
                        found.append(f"{fix.NAME}:{node.lineno} sets {t.attr}")
            elif isinstance(node, ast.Constant) and node.value in class_names:
                found.append(f"{fix.NAME}:{node.lineno} spells {node.value!r} (take it from _base.family)")
    assert not found, "\n".join(found)


# --------------------------------------------------------------------------------------------------------------------
# The class policy, on stand-in classes of the family's own modules
# --------------------------------------------------------------------------------------------------------------------

M46, M47 = "vllm.model_executor.models.minicpmv4_6", "vllm.model_executor.models.minicpmv4_7"


def _classes():
    """A stand-in 4.6 class, its 4.7 subclass and an unknown ("4.8") subclass, each in the module that owns it."""
    base = type("StandIn46", (), {"__module__": M46, "f": lambda self, x, y=0: ("vllm", x, y)})
    v47 = type("StandIn47", (base,), {"__module__": M47})
    v48 = type("StandIn48", (base,), {"__module__": "somewhere.minicpmv4_8"})
    module = types.ModuleType("policy_stand_in")
    module.StandIn46 = base
    return module, base, v47, v48


def _fix(models, patches):
    fix = types.ModuleType("vllm_minicpm_hotfix.fixes.policy_stand_in_fix")
    fix.NAME, fix.LABEL, fix.MODELS, fix.PATCHES = "policy_stand_in_fix", "stand-in", models, patches
    return fix


def test_a_behaviour_runs_only_for_the_declared_classes(monkeypatch):
    module, base, v47, v48 = _classes()
    ran = []

    def behaviour(wrapped, instance, call):
        ran.append(type(instance).__name__)
        return ("fix", wrapped(*call.args, **call.kwargs), dict(call))

    fix = _base.complete(_fix((_base.V46,), {"StandIn46.f": _base.wrap(behaviour, bind=True)}))
    warned = []
    monkeypatch.setattr(_base.family.logger, "warning", lambda *a: warned.append(a))
    fix.apply(module)
    try:
        got = base().f(1, y=2)
        assert got[0] == "fix" and got[1] == ("vllm", 1, 2) and got[2]["x"] == 1 and got[2]["y"] == 2
        assert v47().f(1) == ("vllm", 1, 0)  # 4.7 not declared: vLLM's own, nothing reported
        assert v48().f(1) == ("vllm", 1, 0) and v48().f(2) == ("vllm", 2, 0)  # unknown: vLLM's own, reported once
        assert ran == ["StandIn46"]
        assert len(warned) == 1 and "StandIn48" in str(warned[0]) and "no member" in str(warned[0])
        assert base.f.__wrapped__.__qualname__.endswith("<lambda>") and base.f.__name__ == "<lambda>"
        assert getattr(base.__dict__["f"], _base.MARKER_ATTR) == fix.NAME
        with pytest.raises(TypeError):  # a call that does not bind is vLLM's own, which raises
            base().f()
        assert ran == ["StandIn46"]
    finally:
        _base.revert_fix(fix.NAME)
        _base.family._REPORTED.clear()
    assert base().f(1) == ("vllm", 1, 0)


def test_a_classmethod_and_a_staticmethod_target_bind_as_vllms_do():
    """A target is looked up as wrapt looks it up (the class ``__dict__`` along the MRO: the ``classmethod`` /
    ``staticmethod`` object, here inherited from the base) and wrapped by wrapt's ``FunctionWrapper``: called on the
    class and on an instance, the behaviour sees the class (classmethod) or no instance (staticmethod) and the
    arguments after it, by name too, and vLLM's own result; the base class keeps its own; revert restores both. A
    staticmethod has no instance to decide by: ``model=SELF`` is refused before anything is set."""
    base = type("StandIn46", (), {"__module__": M46, "make": classmethod(lambda cls, x, y=0: (cls.__name__, x, y)),
                                  "norm": staticmethod(lambda x, y=0: ("static", x, y))})
    sub = type("StandIn47", (base,), {"__module__": M47})
    module = types.ModuleType("policy_stand_in")
    module.StandIn46, module.StandIn47 = base, sub
    seen = []

    def by_name(wrapped, instance, call):
        seen.append((instance, dict(call), call.args, call.kwargs))
        return "fix", wrapped(*call.args, **call.kwargs)

    def plain(wrapped, instance, args, kwargs):
        seen.append((instance, args, kwargs))
        return "fix", wrapped(*args, **kwargs)

    fix = _base.complete(_fix((_base.V46,), {"StandIn47.make": _base.wrap(by_name, bind=True, model=_base.EVERY_CALL),
                                             "StandIn47.norm": _base.wrap(plain, model=_base.EVERY_CALL)}))
    fix.apply(module)
    try:
        assert sub.make(1, y=2) == ("fix", ("StandIn47", 1, 2)) and sub().make(3) == ("fix", ("StandIn47", 3, 0))
        assert seen == [(sub, {"cls": sub, "x": 1, "y": 2}, (1,), {"y": 2}), (sub, {"cls": sub, "x": 3}, (3,), {})]
        seen.clear()
        assert sub.norm(4) == ("fix", ("static", 4, 0)) and sub().norm(5, y=1) == ("fix", ("static", 5, 1))
        assert seen == [(None, (4,), {}), (None, (5,), {"y": 1})]
        assert base.make(1) == ("StandIn46", 1, 0) and base().norm(2) == ("static", 2, 0)  # the base keeps its own
        assert getattr(vars(sub)["make"], _base.MARKER_ATTR) == fix.NAME
        assert getattr(vars(base)["make"], _base.MARKER_ATTR, None) is None  # the mark is the wrapper's own
        assert _base.patched_by(sub, "norm") == fix.NAME and _base.patched_by(base, "norm") is None
    finally:
        _base.revert_fix(fix.NAME)
    assert "make" not in vars(sub) and "norm" not in vars(sub) and sub.make(1) == ("StandIn47", 1, 0)
    refused = _base.complete(_fix((_base.V46,), {"StandIn47.norm": _base.wrap(plain)}))
    with pytest.raises(TypeError, match="no instance"):
        refused.apply(module)
    assert "norm" not in vars(sub) and not _base.has_set(refused.NAME)


def test_a_revert_for_one_model_module_undoes_what_the_fix_set_in_another_module_too(monkeypatch):
    """``revert_fix(NAME, module)`` restores every value the fix set for ``module``, wherever it set it: a target in
    the model module's classes and one in another module (``"pkg.module:Class.attr"``, as processor_downsample_mode
    wraps vLLM 0.34's own ``MiniCPMOcrProcessingInfo``). Afterwards ``is_patched(fix, module)`` is False -- the
    question every test's teardown asks -- and nothing of the fix is left in either class."""
    import sys

    module, base, _, _ = _classes()
    other = types.ModuleType("policy_elsewhere")
    other.Elsewhere = type("Elsewhere", (), {"__module__": other.__name__, "g": lambda self: "vllm"})
    monkeypatch.setitem(sys.modules, other.__name__, other)
    outer = _base.wrap(lambda w, i, a, k: ("fix", w(*a, **k)))
    fix = _base.complete(_fix((_base.V46,), {"StandIn46.f": outer,
                                             "policy_elsewhere:Elsewhere.g": _base.on_import(outer)}))
    own_f, own_g = base.__dict__["f"], other.Elsewhere.__dict__["g"]
    fix.apply(module)
    try:
        assert other.Elsewhere.__dict__["g"] is not own_g and base.__dict__["f"] is not own_f
        assert _base.is_patched(fix, module)
        assert _base.revert_fix(fix.NAME, module) is True
        assert other.Elsewhere.__dict__["g"] is own_g and base.__dict__["f"] is own_f
        assert not _base.is_patched(fix, module) and not _base.has_set(fix.NAME)
        assert _base.revert_fix(fix.NAME, module) is False
    finally:
        _base.revert_fix(fix.NAME)


def test_a_factory_must_hand_the_framework_a_patch():
    module, base, _, _ = _classes()
    fix = _base.complete(_fix((_base.V46,), {"StandIn46.f": lambda old, owner: (lambda self, x, y=0: "own")}))
    with pytest.raises(TypeError, match="returns a Patch"):
        fix.apply(module)
    assert base().f(1) == ("vllm", 1, 0) and not _base.has_set(fix.NAME)
    with pytest.raises(TypeError, match="not a Patch or a factory"):
        _base.complete(_fix((_base.V46,), {"StandIn46.f": "not a patch"}))


# --------------------------------------------------------------------------------------------------------------------
# The import graph
# --------------------------------------------------------------------------------------------------------------------

#: The floors, lowest first: a module may import its own floor or a lower one.
FLOORS = (
    ("record", "decision", "_wrapt", "checkpoint", "quant_layout", "metrics"),
    ("fixes._base", "fixes._proxies", "fixes._mm_prompt", "fixes._mm_items", "fixes._stand_ins"),  # the framework (with its parts)
    ("fixes.*",),  # each fix
    ("fixes", "backports"),  # the registry; the backports (models vLLM lacks), beside it
    ("hook",),
    ("_bootstrap", "plugin", ""),  # the activation and the package itself
    ("cli", "__main__"),
)


def _floor(name: str) -> int:
    rel = name[len("vllm_minicpm_hotfix"):].lstrip(".")
    for i, floor in enumerate(FLOORS):
        for entry in floor:
            if rel == entry or (entry and not entry.endswith("*") and rel.startswith(entry + ".")):
                return i
    for i, floor in enumerate(FLOORS):
        if any(e.endswith("*") and rel.startswith(e[:-1]) for e in floor):
            return i
    raise AssertionError(f"{name} is on no floor of FLOORS")


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("vllm_minicpm_hotfix")}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module or ""
            if not base.startswith("vllm_minicpm_hotfix"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    out.discard(name)
    return out


def test_the_import_graph_has_no_circle_and_no_import_back_up():
    known = _modules()
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    up = [f"{a} (floor {_floor(a)}) imports {b} (floor {_floor(b)})"
          for a, deps in graph.items() for b in deps if _floor(b) > _floor(a)]
    assert not up, "\n".join(sorted(up))
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, " -> ".join(trail[trail.index(node):] + [node])
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            visit(dep, trail + [node])
        state[node] = 2

    for name in sorted(graph):
        visit(name, [])
    assert graph["vllm_minicpm_hotfix.fixes._proxies"] == {"vllm_minicpm_hotfix._wrapt"}


def test_the_framework_parts_stay_small():
    parts = [*(PACKAGE / "fixes" / "_base").glob("*.py"), *(PACKAGE / "fixes").glob("_*.py")]
    sizes = {p.relative_to(PACKAGE).as_posix(): len(p.read_text().splitlines()) for p in parts}
    assert len(sizes) >= 9, sizes
    assert max(sizes.values()) <= 350, sizes


# --------------------------------------------------------------------------------------------------------------------
# One fix off without the rest, and the refusals counted
# --------------------------------------------------------------------------------------------------------------------


def test_a_left_out_fix_is_recorded_and_what_comes_after_it_runs_alone(monkeypatch):
    """``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` names a fix: nothing of it is probed or set, its status says why; a fix
    that must come after it runs and says it runs without it; names no fix has are one WARNING naming the fixes."""
    from vllm_minicpm_hotfix import decision, hook, record

    module, base, _, _ = _classes()
    probed = []

    def make(name, after=()):
        fix = _fix((_base.V46,), {"StandIn46.f": _base.wrap(lambda w, i, a, k: ("fix", name, w(*a, **k)))})
        fix.NAME, fix.AFTER, fix.__name__ = name, after, f"vllm_minicpm_hotfix.fixes.{name}"
        fix.probe = lambda m: probed.append(name) or decision.Verdict(decision.State.BROKEN, "stand-in")
        return _base.complete(fix)

    first, second = make("policy_first"), make("policy_second", after=("policy_first",))
    monkeypatch.setenv(decision.DISABLED_VAR, " Policy_First ,no_such_fix")
    monkeypatch.setattr(record, "_STATUS", None)
    warned = []
    monkeypatch.setattr(hook.logger, "warning", lambda *a: warned.append(a[1] if len(a) > 1 else a[0]))
    try:
        hook._check_disabled(["policy_first", "policy_second"])
        one, two = _base.run(first, module), _base.run(second, module)
        assert probed == ["policy_second"] and not _base.has_set("policy_first")
        assert one.left_out and not one.applied and one.verdict == "left out" and decision.DISABLED_VAR in one.why
        assert two.applied and "policy_first left out" in two.why and "runs without it" in two.why
        assert base().f(1) == ("fix", "policy_second", ("vllm", 1, 0))
        assert len(warned) == 1 and "no_such_fix" in warned[0] and "policy_first, policy_second" in warned[0]
        line = record.summary_line(record.current(), ["policy_first", "policy_second"])
        assert "; left out: #1;" in line, line
        assert record.parse_summary(line, ["policy_first", "policy_second"])[0]["left_out"] == ["policy_first"]
    finally:
        _base.revert_fix("policy_second")


@pytest.mark.parametrize("listed", ["policy_qkv_old", "policy_qk", "policy_qkv_", " POLICY_QKV_OLD ,policy_q"])
def test_a_left_out_name_matches_one_fix_exactly(monkeypatch, listed):
    """``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` leaves out the fix it names exactly (spaces and case aside), never one
    whose name the listed one extends or begins: with fixes ``policy_qkv`` and ``policy_qkv_old`` (as ``qkv_loader``
    and a ``qkv_loader_old`` would be), listing ``policy_qkv_old`` leaves out that one only, and a prefix or an
    extension of ``policy_qkv`` leaves out nothing and is reported as a name no fix has."""
    from vllm_minicpm_hotfix import decision, hook, record

    module, base, _, _ = _classes()

    def make(name):
        fix = _fix((_base.V46,), {"StandIn46.f": _base.wrap(lambda w, i, a, k: (name, w(*a, **k)))})
        fix.NAME, fix.__name__ = name, f"vllm_minicpm_hotfix.fixes.{name}"
        fix.probe = lambda m: decision.Verdict(decision.State.BROKEN, "stand-in")
        return _base.complete(fix)

    short, long = make("policy_qkv"), make("policy_qkv_old")
    names = [short.NAME, long.NAME]
    monkeypatch.setenv(decision.DISABLED_VAR, listed)
    monkeypatch.setattr(record, "_STATUS", None)
    warned = []
    monkeypatch.setattr(hook.logger, "warning", lambda *a: warned.append(a[1] if len(a) > 1 else a[0]))
    exact = {n.strip().lower() for n in listed.split(",")} & set(names)
    try:
        hook._check_disabled(names)
        ran = {fix.NAME: _base.run(fix, module) for fix in (short, long)}
        assert {n for n, entry in ran.items() if entry.left_out} == exact, (listed, ran)
        assert {n for n, entry in ran.items() if entry.applied} == set(names) - exact, (listed, ran)
        unknown = {n.strip().lower() for n in listed.split(",")} - exact
        assert len(warned) == bool(unknown) and all(n in warned[0] for n in unknown), warned
    finally:
        for name in names:
            _base.revert_fix(name)


def test_a_refusal_is_counted_once_for_the_fix_that_refused(monkeypatch):
    """A behaviour's ``Refusal`` is counted once (in the innermost built function it passes, whatever wraps it), by
    fix and cause, and raised on -- or its ``response`` returned; a ValueError of another kind is not counted."""
    from vllm_minicpm_hotfix import metrics

    module, base, _, _ = _classes()
    calls = {"x": 0}

    def inner(wrapped, instance, args, kwargs):
        if args[0] == "refuse":
            raise _base.Refusal("refused: x", cause="stand_in_cause")
        if args[0] == "answer":
            raise _base.Refusal("refused: y", cause="answered", response="an error response")
        if args[0] == "other":
            raise ValueError("not a refusal")
        return wrapped(*args, **kwargs)

    def outer(wrapped, instance, args, kwargs):
        calls["x"] += 1
        return wrapped(*args, **kwargs)

    one = _base.complete(_fix((_base.V46,), {"StandIn46.f": _base.wrap(inner)}))
    two = _base.complete(_fix((_base.V46,), {"StandIn46.f": _base.wrap(outer)}))
    two.NAME = "policy_outer"
    monkeypatch.setattr(metrics, "COUNTS", {})
    one.apply(module)
    two.apply(module)
    try:
        with pytest.raises(_base.Refusal, match="refused: x"):
            base().f("refuse")
        assert base().f("answer") == "an error response"
        with pytest.raises(ValueError, match="not a refusal"):
            base().f("other")
        assert calls["x"] == 3
        assert metrics.COUNTS == {(one.NAME, "stand_in_cause"): 1, (one.NAME, "answered"): 1}
    finally:
        _base.revert_fix("policy_outer")
        _base.revert_fix(one.NAME)
