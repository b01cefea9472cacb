"""The post-import hook and the status API, in this process and in fresh interpreters (real start-up, real import of
vLLM's model module)."""

from __future__ import annotations

import logging
import os
import types

import pytest
from support.hotfix import hotfix
from support.placement import FULL_ENVS, LOGIC_ENV
from support.programs import run_reporting

from vllm_minicpm_hotfix import decision, hook, record
from vllm_minicpm_hotfix.fixes import REGISTRY, _base, names, qkv_loader

ATTN = "MiniCPMV4_6ViTWindowAttentionSelfAttn"
MODEL = "MiniCPMV4_6ForConditionalGeneration"


def fresh_python(program: str, **env: str) -> tuple[dict, str]:
    """Run ``tests/programs/<program>.py`` in a new interpreter of this environment (the program puts our package
    first on ``sys.path``; nothing activated) and return the JSON object it prints last, with everything it logged
    (vLLM logs to stdout, Python's last resort to stderr)."""
    full_env = {**os.environ, "PYTHONPATH": "", "VLLM_TARGET_DEVICE": "cpu", **env}
    if "VLLM_MINICPM_HOTFIX" not in env:
        full_env.pop("VLLM_MINICPM_HOTFIX", None)
    return run_reporting(program, env=full_env, timeout=300)


#: ``auto`` decides per release, so its fresh interpreter runs everywhere; ``force`` and ``off`` do not depend on the
#: release's verdicts (every fix applied / none), so theirs run where the other fresh-interpreter modules run: one
#: release whose q/k/v loading is broken and one where it is correct (support.placement.FULL_ENVS). In this process every mode
#: runs everywhere (test_the_hook_logs_one_warning_line_per_process).
FRESH_MODES = ["auto", *(pytest.param(m, marks=pytest.mark.placed(*FULL_ENVS)) for m in ("force", "off"))]


@pytest.mark.parametrize("mode", FRESH_MODES)
def test_hook_applies_decision_when_vllm_imports_the_module(expected, release, mode):
    out, log = fresh_python("install_twice_then_import", VLLM_MINICPM_HOTFIX=mode)
    st = out["status"]
    want_applied = mode == "force" or (mode == "auto" and expected[0] == "broken")
    assert (out["first"], out["second"]) == (True, False)
    assert st["hook_installed"] and st["module_imported"] and st["mode"] == mode
    assert st["vllm_version"].split("+")[0] == release
    assert st["pid"] > 0
    fix = st["fixes"]["qkv_loader"]
    assert fix["applied"] is want_applied and out["patched"] is want_applied
    if mode != "off":
        assert fix["verdict"] == expected[0]
    lines = record.parse_summary(log, names())
    assert len(lines) == 1, log  # one WARNING line for the process, naming what it patched
    assert (lines[0]["pid"], lines[0]["mode"]) == (st["pid"], mode)
    assert lines[0]["vllm"].split("+")[0] == release
    assert lines[0]["applied"] == [n for n in names() if st["fixes"][n]["applied"]]
    assert ("qkv_loader" in lines[0]["applied"]) is want_applied


def test_install_after_module_import_patches_at_once(m46, expected, hotfix_mode):
    """wrapt calls the hook immediately when the module is already imported (it is, in this process); so does the
    hook on vLLM's model registry (the backports)."""
    from vllm_minicpm_hotfix.backports import BACKPORTS

    try:
        hotfix_mode("force")
        hook._installed = False
        assert hook.install() is True
        assert _base.is_patched(qkv_loader, m46)
        assert record.current().fixes["qkv_loader"].applied
        assert set(record.current().backports) == {b.NAME for b in BACKPORTS}
        assert hook.install() is False
    finally:
        _base.revert(m46)
        for backport in BACKPORTS:
            backport.unregister()


def test_applying_twice_patches_once(m46):
    with hotfix(m46, "force") as fix:
        patched_fn = getattr(m46, ATTN).__dict__["load_weights"]
        patched_model_fn = getattr(m46, MODEL).__dict__["load_weights"]
        again = _base.run(qkv_loader, m46)
        assert fix.applied and again.applied and "already patched" in again.why
        assert getattr(m46, ATTN).__dict__["load_weights"] is patched_fn
        assert getattr(m46, MODEL).__dict__["load_weights"] is patched_model_fn
        assert patched_model_fn.__wrapped__.__name__ == "load_weights"
        assert not getattr(patched_model_fn.__wrapped__, _base.MARKER_ATTR, None)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def captured():
    """Every record of the hotfix's logger, whatever level vLLM's logging left it at (0.32+ configures it lazily, so
    its INFO records would otherwise be dropped in this process)."""
    handler = _Capture()
    level = record.logger.level
    record.logger.addHandler(handler)
    record.logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        record.logger.removeHandler(handler)
        record.logger.setLevel(level)


def test_failure_inside_hook_is_logged_and_leaves_vllm_as_it_was(m46, monkeypatch, captured, hotfix_mode):
    """The patch fails half-way (after the self-attention's load_weights is set): nothing escapes, and both classes
    are restored to exactly what vLLM defined."""
    attn, model = getattr(m46, ATTN), getattr(m46, MODEL)
    before = (dict(attn.__dict__), dict(model.__dict__))

    def boom(*a, **k):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(qkv_loader, "attn_class_of", boom)
    hotfix_mode("force")
    try:
        hook.on_import(m46)  # must not raise
        _base.deferred.resolve_group()  # the processor-path probes, as at vLLM's first processor
        from vllm_minicpm_hotfix.fixes import REGISTRY

        for other in REGISTRY:  # the other fixes ran normally under force (quantized_vision sets the model's __init__)
            if other.NAME != "qkv_loader":
                _base.revert_fix(other.NAME)
        assert (dict(attn.__dict__), dict(model.__dict__)) == before
        fix = record.current().fixes["qkv_loader"]
        assert fix.verdict == "error" and not fix.applied and "synthetic failure" in fix.error
        assert any(r.levelno == logging.WARNING and "hook failed" in r.getMessage() for r in captured)
    finally:
        _base.revert(m46)  # the other fix (processor) ran normally under force


def _about_subclass(rec: logging.LogRecord) -> bool:
    """A line about a class no family member owns (tests/support/family_subclass.py registers a "4.8" in this session)."""
    return "is no member of the family" in rec.getMessage()


def test_unrecognised_layout_is_left_alone_and_named_in_the_summary(m46, captured, hotfix_mode):
    """A vLLM whose model module lacks the self-attention class (a layout this fix does not know): nothing touched,
    even with force; its reason at INFO, and the process's summary line names it under "could not tell"."""
    fake = types.ModuleType("vllm.model_executor.models.minicpmv4_6")
    fake.MiniCPMV4_6ForConditionalGeneration = getattr(m46, MODEL)
    before = dict(getattr(m46, MODEL).__dict__)
    for mode in ("auto", "force"):
        captured.clear()
        hotfix_mode(mode)
        fix = _base.run(qkv_loader, fake)
        assert not fix.applied and fix.verdict == "unrecognised"
        assert [r.levelno for r in captured if not _about_subclass(r)] == [logging.INFO]
        assert "qkv_loader" in captured[0].getMessage() and "layout not recognised" in captured[0].getMessage()
        (parsed,) = record.parse_summary(record.summary_line(record.current(), names()), names())
        assert parsed["could_not_tell"] == ["qkv_loader"], parsed
        assert dict(getattr(m46, MODEL).__dict__) == before


@pytest.mark.parametrize("mode", ["auto", "force", "off"])
def test_the_hook_logs_one_warning_line_per_process(m46, expected, monkeypatch, captured, hotfix_mode, mode):
    """The real hook on the real model module: exactly one WARNING record (the summary: members, vLLM version, mode,
    pid, the NAMEs applied, the pointer to doctor; under 350 characters with this session's "4.8" not covered), one
    INFO record per fix with its reason,
    and running the hook again in the same process (a second copy of the package) logs no second summary."""
    hotfix_mode(mode)
    monkeypatch.delattr(record.logger, "_vllm_minicpm_hotfix_summary_pid", raising=False)
    try:
        hook.on_import(m46)
        _base.deferred.resolve_group()  # the processor-path probes, as at vLLM's first processor: the line now
        st = record.current()
        warnings = [r for r in captured if r.levelno >= logging.WARNING]
        infos = [r for r in captured if r.levelno == logging.INFO and not _about_subclass(r)]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        line = warnings[0].getMessage()
        assert "\n" not in line and len(line) < 350, line
        parsed = record.parse_summary(line, names())
        assert len(parsed) == 1 and parsed[0]["line"] == line, line
        applied = [n for n in names() if st.fixes[n].applied]
        assert parsed[0]["applied"] == applied and parsed[0]["pid"] == os.getpid() and parsed[0]["mode"] == mode
        assert parsed[0]["vllm"] == st.vllm_version and parsed[0]["models"][0] == "MiniCPM-V 4.6"
        assert ("qkv_loader" in applied) is (mode == "force" or (mode == "auto" and expected[0] == "broken"))
        assert line.endswith("details: vllm-minicpm-hotfix doctor")
        assert len(infos) == len(REGISTRY)  # each fix's reason, at INFO (the processor path's when it is probed)
        for fix in REGISTRY:
            assert [r for r in infos if r.getMessage().startswith(f"vllm-minicpm-hotfix: {fix.NAME} ({fix.LABEL}) ")]
        captured.clear()
        hook.on_import(m46)  # the same process again: every fix is already patched, no second summary
        assert not [r for r in captured if r.levelno >= logging.WARNING]
    finally:
        _base.revert(m46)


def _unknown_rows(*modules: str) -> dict[str, dict]:
    """``FixStatus.models`` rows of subclasses no family member owns, one class in each of ``modules``."""
    return {f"{m}.MiniCPMV4_8ProcessingInfo": {"declared": False, "verdict": "n/a", "applied": False, "unknown": True}
            for m in modules}


#: vLLM's prefix on the summary line, at its longest: ``(APIServer pid=12345) WARNING 12-08 01:02:03 [record.py:267] ``.
PREFIX = 60


@pytest.mark.placed(*LOGIC_ENV)  # record's own code on made-up statuses (all 262144 subsets)
def test_summary_line_stays_short_for_any_set_of_fixes():
    """Every subset of the fixes, with the longest values a real process has: one line, parsed back to the same
    subset, within ``record.SUMMARY_BUDGET`` with vLLM's prefix (60 characters); so with subclasses no family member
    owns at their longest as well (a module name of 15 characters, the most the line spells out, on every fix), with
    a backport's part on the longest, and on 0.28.0's line with two fixes left out and both backports registered."""
    import itertools

    reg = names()
    st = record.Status(pid=4194304, mode="force", vllm_version="0.33.0rc2.dev123+g0123abcd.cpu",
                       models=["MiniCPM-V 4.6", "MiniCPM-V 4.7"])
    longest = longest_uncovered = 0
    for k in range(len(reg) + 1):
        for chosen in itertools.combinations(reg, k):
            st.fixes = {n: record.FixStatus(n, "broken", "", n in chosen, "") for n in reg}
            line = record.summary_line(st, reg)
            longest = max(longest, len(line))
            (parsed,) = record.parse_summary("INFO 12-01 [x.py:1] " + line, reg)
            assert parsed["applied"] == list(chosen) and parsed["models"] == st.models
            for n in reg:
                st.fixes[n].models = _unknown_rows("vllm_plugin.minicpmv4_8_ext")
            line = record.summary_line(st, reg)
            assert "; not covered: minicpmv4_8_ext; details: " in line, line
            longest_uncovered = max(longest_uncovered, len(line))
            (parsed,) = record.parse_summary("INFO 12-01 [x.py:1] " + line, reg)
            assert parsed["applied"] == list(chosen) and parsed["models"] == st.models
    assert longest + PREFIX <= record.SUMMARY_BUDGET, longest
    assert longest_uncovered + PREFIX <= record.SUMMARY_BUDGET, longest_uncovered
    # A backport's part (record._backports_part) at its longest, on the longest line: within the budget, parsed back.
    st.fixes = {n: record.FixStatus(n, "broken", "", False, "") for n in reg}
    st.fixes[reg[0]].applied = True  # "all but" the other 17 names: the longest rendering
    for says, row in (("registered by another plugin", ("correct", "registered by vllm_plugin_x:Cls", False)),
                      ("registered by the hotfix", ("missing", "", True)), ("vLLM's own", ("correct", "vLLM's own", False))):
        st.backports = {"minicpmv4_7": record.BackportStatus("minicpmv4_7", "MiniCPM-V 4.7", row[0], row[1], row[2], "")}
        line = record.summary_line(st, reg)
        assert len(line) + PREFIX <= record.SUMMARY_BUDGET, (len(line), line)
        (parsed,) = record.parse_summary("INFO 12-01 [x.py:1] " + line, reg)
        assert parsed["backports"] == {"MiniCPM-V 4.7": says} and parsed["applied"] == [reg[0]], line
    # 0.28.0 under auto (7 fixes not needed), two of them left out, the 4.7 and OCR backports registered.
    st = record.Status(pid=4194304, mode="auto", vllm_version="0.28.0", models=["MiniCPM-V 4.6"])
    not_needed = reg[1::3][:7]
    st.fixes = {n: record.FixStatus(n, "correct" if n in not_needed else "broken", "", n not in not_needed, "",
                                    left_out=n in not_needed[:2]) for n in reg}
    st.backports = {m: record.BackportStatus(m, m, "missing", "", True, "") for m in ("MiniCPM-V 4.7", "MiniCPM-OCR")}
    line = record.summary_line(st, reg)
    assert len(line) + PREFIX <= record.SUMMARY_BUDGET, (len(line), line)
    (parsed,) = record.parse_summary(line, reg)
    assert parsed["left_out"] == not_needed[:2] and parsed["applied"] == [n for n in reg if n not in not_needed]
    assert parsed["backports"] == {"MiniCPM-V 4.7": "registered by the hotfix"} and "; 4.7, OCR: registered by" in line


@pytest.mark.parametrize("modules, said", [
    (["minicpmv4_8"], "minicpmv4_8"),
    (["minicpmv4_8", "x"], "minicpmv4_8, x"),  # 14 characters of names: still named
    (["family_subclass", "test_mm_placeholders"], "2 modules"),
    (["a_plugin_module_of_a_long_name"], "1 module"),
    ([f"m{i}" for i in range(1000)], "1000 modules"),
])
def test_summary_line_names_what_is_not_covered_in_a_bounded_part(modules, said):
    """Subclasses no family member owns (tests/registry/test_family.py and tests/fixes/test_mm_placeholders.py leave
    some in the process): named by module where the names take at most 15 characters, else counted -- the part
    never grows with them."""
    reg = names()
    st = record.Status(pid=1234, mode="auto", vllm_version="0.28.0", models=["MiniCPM-V 4.6"])
    st.fixes = {n: record.FixStatus(n, "broken", "", True, "") for n in reg}
    st.fixes[reg[0]].models = _unknown_rows(*modules[: len(modules) // 2])
    st.fixes[reg[-1]].models = _unknown_rows(*modules[len(modules) // 2:])
    line = record.summary_line(st, reg)
    assert line == (f"vllm-minicpm-hotfix: MiniCPM-V 4.6, vLLM 0.28.0, mode auto, pid 1234: patched "
                    f"{len(reg)}/{len(reg)} (all); not covered: {said}; details: vllm-minicpm-hotfix doctor")
    (parsed,) = record.parse_summary(line, reg)
    assert parsed["applied"] == reg


def test_mode_parsing():
    assert decision.mode_from_env({}) == (decision.Mode.AUTO, None)
    assert decision.mode_from_env({"VLLM_MINICPM_HOTFIX": " Force "})[0] is decision.Mode.FORCE
    assert decision.mode_from_env({"VLLM_MINICPM_HOTFIX": "off"})[0] is decision.Mode.OFF
    mode, problem = decision.mode_from_env({"VLLM_MINICPM_HOTFIX": "of"})
    assert mode is decision.Mode.AUTO and "'of'" in problem


def test_decide_table():
    v = decision.Verdict
    S = decision.State
    M = decision.Mode
    assert decision.decide(M.AUTO, v(S.BROKEN, "x")).apply
    assert not decision.decide(M.AUTO, v(S.CORRECT, "x")).apply
    assert not decision.decide(M.AUTO, v(S.UNDETERMINED, "x")).apply
    assert decision.decide(M.FORCE, v(S.CORRECT, "x")).apply
    assert decision.decide(M.FORCE, v(S.UNDETERMINED, "x")).apply
    assert not decision.decide(M.FORCE, v(S.UNRECOGNISED, "x")).apply
    assert not decision.decide(M.OFF, v(S.BROKEN, "x")).apply


def test_status_is_json_serialisable_and_cheap_to_import():
    out, _ = fresh_python("status_only")
    assert out["mods"] == []
    assert out["st"]["hook_installed"] is False and out["st"]["fixes"] == {}


def test_start_up_module_reads_the_off_switch_as_the_decision_does():
    """``_vllm_minicpm_hotfix_arm`` may import nothing, so it keeps its own copy of the env var and its off values."""
    import _vllm_minicpm_hotfix_arm as arm

    assert arm.ENV_VAR == decision.ENV_VAR
    assert arm.OFF_VALUES == decision.OFF_VALUES
    for value in ("off", " OFF ", "0", "Disabled", "auto", "force", "", "bogus"):
        env = {decision.ENV_VAR: value}
        assert arm.disabled(env) is (decision.mode_from_env(env)[0] is decision.Mode.OFF), value


@pytest.mark.parametrize("value, level", [(None, logging.WARNING), ("INFO", logging.INFO), ("debug", logging.DEBUG),
                                          ("WARNING", logging.WARNING), ("nonsense", logging.WARNING)])
def test_each_fix_reason_shows_only_when_vllm_logging_level_asks(value, level):
    """vLLM logs at INFO by default; the hotfix's per-fix reasons (INFO) show only when ``VLLM_LOGGING_LEVEL`` is set
    to INFO or DEBUG, so a default ``vllm serve`` log has the one WARNING line per process and nothing else."""
    environ = {} if value is None else {"VLLM_LOGGING_LEVEL": value}
    assert record.level_from_env(environ) == level


def test_parse_summary_reads_each_process_line_of_a_log():
    """Two processes' summary lines in one log, with other lines (some with ';') between: two records, each with its
    own pid and fixes -- a pattern spanning lines once read the API server's and the worker's as one."""
    reg = names()
    lines = []
    for pid, chosen in ((30653, reg[:2]), (30841, reg[2:5])):
        st = record.Status(pid=pid, mode="auto", vllm_version="0.22.1", models=["MiniCPM-V 4.6"])
        st.fixes = {n: record.FixStatus(n, "broken", "", n in chosen, "") for n in reg}
        lines.append(record.summary_line(st, reg))
    log = "\n".join([f"(APIServer pid=30653) WARNING 12-01 [record.py:1] {lines[0]}", "INFO a; b; c (x) y",
                     f"WARNING 12-01 [record.py:1] {lines[1]}", "(Worker pid=30841) INFO done; ok"])
    parsed = record.parse_summary(log, reg)
    assert [(p["pid"], p["applied"]) for p in parsed] == [(30653, reg[:2]), (30841, reg[2:5])], parsed
