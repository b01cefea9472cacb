"""The program ``doctor`` runs in fresh interpreters of the environment it examines.

``doctor`` starts this file **by path** (``python [its interpreter flags] .../cli/doctor/child.py MODE NAMES ...``),
never as ``python -m vllm_minicpm_hotfix...``: a ``-m`` run would import the package's ``__init__`` before anything else,
and the point of the child is to see whether the *environment's own* activation paths -- the ``.pth`` file,
``sitecustomize.py``, vLLM's ``vllm.general_plugins`` entry point -- armed and installed the hotfix. So until vLLM and
the model module are imported this file uses nothing but ``sys``, ``os``, ``json`` and ``time``; the names it looks
for (the package, the model module, the start-up module's finder flag, the sitecustomize marker) come in ``NAMES``, a
JSON object written by :func:`vllm_minicpm_hotfix.cli.doctor.facts.child_names` from the modules that define them.

Modes:

``startup NAMES``
    Prints one JSON object (:func:`startup_facts`): what interpreter start-up did -- ``sys.path``, the
    ``sitecustomize`` that ran and what it chained to, whether the hotfix's start-up module is waiting for
    ``import vllm`` and what armed it (``pth`` / ``sitecustomize``). Imports nothing: ~50 ms.
``vllm NAMES OUT_FILE PACKAGE_PARENT``
    Writes one JSON object to ``OUT_FILE`` (:func:`vllm_process`): the start-up facts, then ``import vllm``,
    ``vllm.plugins.load_general_plugins()`` (as every vLLM process does), the import of the model module, a snapshot
    of the hotfix's state after each step, what the hook recorded (``vllm_minicpm_hotfix.status()`` -- only if an
    activation path imported the package; ``member_records``: its per-member rows read again once every family
    member's model module is imported, so they hold each member's stock verdict), the wrapt in use, and every registered fix's probe re-run on the classes
    as they now stand. ``PACKAGE_PARENT`` (the folder holding the doctor's own copy of the package) is appended to the
    *end* of ``sys.path`` only for those probes, and only if the package is not importable otherwise.

As a script its own folder (the package folder) would be ``sys.path[0]``; vLLM's processes do not have it, so
:func:`drop_script_dir` removes it before anything else is imported. Importing this module (tests do) runs nothing.
"""

import sys


def drop_script_dir():
    """Remove the entry Python put first on ``sys.path`` for this script (its folder), as vLLM's processes do not
    have it. Nothing to do under ``-P`` / ``-I`` (``sys.flags.safe_path``: no entry was added)."""
    if getattr(sys.flags, "safe_path", False) or not sys.path:
        return
    os = sys.modules.get("os")  # loaded by ``site`` already (and a frozen module from Python 3.11 on)
    if os is None:  # python -S
        import os
    os_path = os.path
    here = os_path.dirname(os_path.realpath(__file__))
    try:
        if os_path.realpath(sys.path[0] or ".") == here:
            del sys.path[0]
    except (OSError, TypeError):  # an odd first entry: not ours
        pass


def one_line(exc, limit=800):
    """``Type: message`` on one line."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def waiting_finder(names):
    """The hotfix's start-up module waiting on ``sys.meta_path`` for ``import vllm`` (any copy), or None."""
    return next((f for f in sys.meta_path if getattr(f, names["finder_flag"], False)), None)


def startup_facts(names):
    """What start-up did in this interpreter (see the module docstring). JSON-serialisable."""
    sc = sys.modules.get("sitecustomize")
    chained = getattr(sc, "CHAINED", None)
    finder = waiting_finder(names)
    return {
        "path": [p for p in sys.path if isinstance(p, str)],
        "sitecustomize": getattr(sc, "__file__", None),
        "ours": bool(getattr(sc, names["sitecustomize_marker"], False)),
        "chained": getattr(chained, "__file__", None) if chained is not None else None,
        "armed_by": getattr(finder, "source", None) if finder is not None else None,
        "package_imported": names["package"] in sys.modules,
    }


def hotfix_snapshot(names):
    """The hotfix's state in this process right now, read without importing anything."""
    boot = sys.modules.get(names["package"] + "._bootstrap")
    hook = sys.modules.get(names["package"] + ".hook")
    return {
        "package_imported": names["package"] in sys.modules,
        "waiting_for_vllm": waiting_finder(names) is not None,
        "hook_installed": bool(getattr(hook, "_installed", False)),
        "activations": list(getattr(boot, "activations", None) or []),
    }


def wrapt_in_use():
    """The wrapt this process imported (by the hook), or None."""
    w = sys.modules.get("wrapt")
    if w is None:
        return None
    using_c = getattr(sys.modules.get("wrapt.__wrapt__"), "_using_c_extension", None)
    if using_c is None:
        using_c = getattr(getattr(w, "FunctionWrapper", None), "__module__", "") == "wrapt._wrappers"
    return {"file": getattr(w, "__file__", None), "version": getattr(w, "__version__", None),
            "c_extension": bool(using_c)}


def probe_fixes(names, module, pkg_parent):
    """Every registered fix's probe on ``module`` as it now stands (patched or not): ``{NAME: {label, state, reason,
    applicable, patched, scope, scope_check}}`` (``scope``: the fix's ``SCOPE``, the checkpoints it is limited to, or
    None; ``scope_check``: its ``SCOPE_CHECK``, the command that checks a checkpoint for that, or None), plus
    ``fixes_error`` if the fixes cannot be imported. Fixes the hook left "probed at first use" are resolved first
    (probed, applied or not, as at their first use): ``first_use`` gives ``{NAME: their record after that}``."""
    import importlib
    import importlib.util

    out = {"fixes": {}}
    try:
        if importlib.util.find_spec(names["package"]) is None:
            sys.path.append(pkg_parent)
        fixes = importlib.import_module(names["package"] + ".fixes")
        base = importlib.import_module(names["package"] + ".fixes._base")
        registry = fixes.REGISTRY
    except BaseException as exc:  # noqa: BLE001 - reported, the rest of the facts still count
        out["fixes_error"] = one_line(exc)
        return out
    try:  # every member's model module imported first: importing one after the hook ran re-runs the hook
        members = base.member_modules(module)
    except BaseException:  # noqa: BLE001 - an older copy of the package without the family: 4.6 alone
        members = {}
    try:  # fixes probed at first use of their code path: probe them now, as that first use would
        try:
            deferred = importlib.import_module(names["package"] + ".fixes._base.deferred")
        except ImportError:  # a copy of the package from before the framework was split
            deferred = importlib.import_module(names["package"] + ".fixes._deferred")
        out["first_use"] = {n: {"verdict": e.verdict, "reason": e.reason, "applied": e.applied, "why": e.why,
                                "error": e.error} for n, e in deferred.resolve_all().items()}  # fmt: skip
    except BaseException as exc:  # noqa: BLE001
        out["first_use_error"] = one_line(exc)
    for fix in registry:
        try:
            v = fix.probe(module)
            out["fixes"][fix.NAME] = {"label": fix.LABEL, "state": v.state.value, "reason": v.reason,
                                      "applicable": v.applicable, "patched": base.is_patched(fix, module),
                                      "scope": getattr(fix, "SCOPE", None),
                                      "scope_check": getattr(fix, "SCOPE_CHECK", None),
                                      "models": member_probes(base, fix, module, members, v)}
        except BaseException as exc:  # noqa: BLE001 - a probe must never raise; if one does, say so
            out["fixes"][fix.NAME] = {"label": fix.LABEL, "state": "undetermined", "applicable": False,
                                      "reason": "probe failed: " + one_line(exc), "patched": False}
    return out


def member_probes(base, fix, module, members, own_verdict):
    """Per family member present (``members``: :func:`fixes._base.member_modules`) the fix's probe on that member's
    classes as they now stand -- ``{member: {declared, state, reason}}`` (``own_verdict`` is the probe already run on
    ``module``'s own member) -- plus one row per subclass no member owns (``unknown``: true). Never raises."""
    rows = {}
    declared = base.models_of(fix) if hasattr(base, "models_of") else ()
    for member, view in members.items():
        if member not in declared:
            rows[member] = {"declared": False, "state": "n/a", "reason": f"{fix.NAME} does not declare {member}"}
            continue
        try:
            v = own_verdict if view is module else fix.probe(view)
            reason = base.member_reason(view, v.reason) if hasattr(base, "member_reason") else v.reason
            rows[member] = {"declared": True, "state": v.state.value, "reason": reason}
        except BaseException as exc:  # noqa: BLE001
            rows[member] = {"declared": True, "state": "undetermined", "reason": "probe failed: " + one_line(exc)}
    try:
        for cls_name, row in base.unknown_subclasses(fix, module).items():
            rows[cls_name] = {"declared": False, "unknown": True, "state": "n/a", "reason": row["why"]}
    except BaseException:  # noqa: BLE001
        pass
    return rows


def vllm_process(names, pkg_parent):
    """Start vLLM as its processes start and report each step (see the module docstring). Never raises."""
    import importlib
    import os

    res = {"pid": os.getpid(), "steps": {}, "error": None}
    res["steps"]["startup"] = hotfix_snapshot(names)
    start = startup_facts(names)
    res["sitecustomize"] = {"file": start["sitecustomize"], "ours": start["ours"], "chained": start["chained"]}
    try:
        import vllm

        res["vllm_version"] = str(getattr(vllm, "__version__", "?"))
    except BaseException as exc:  # noqa: BLE001 - a broken vLLM is the answer, not a crash
        res["error"] = "import vllm failed: " + one_line(exc)
        return res
    res["steps"]["import vllm"] = hotfix_snapshot(names)
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except BaseException as exc:  # noqa: BLE001
        res["plugins_error"] = one_line(exc)
    res["steps"]["plugins"] = hotfix_snapshot(names)
    module = None
    try:
        module = importlib.import_module(names["model_module"])
        res["module"] = True
    except ModuleNotFoundError as exc:
        res["module"] = False
        res["module_error"] = one_line(exc)
    except BaseException as exc:  # noqa: BLE001
        res["module"] = False
        res["error"] = f"importing {names['model_module']} failed: " + one_line(exc)
    res["steps"]["model module"] = hotfix_snapshot(names)

    # What the hook recorded -- only if the environment's own activation imported the package.
    pkg = sys.modules.get(names["package"])
    res["status"] = pkg.status() if pkg is not None else None
    res["package_file"] = getattr(pkg, "__file__", None)
    res["wrapt"] = wrapt_in_use()
    if module is not None:
        res.update(probe_fixes(names, module, pkg_parent))
        if pkg is not None:
            # probe_fixes imported every other member's model module (4.7, OCR), as a process serving that member
            # does: the hook re-ran every fix with them (hook.on_member_import), probing each member on its stock
            # classes. The record read above (what vLLM's process had after importing the 4.6 module) knew 4.6
            # alone, and a member row built from it would judge the member by the probe on the patched classes
            # ("not needed" where its stock classes are broken and inherit the patched 4.6 methods): the members'
            # rows come from the record as it is now.
            try:
                later = pkg.status()
                res["member_records"] = {"models": later.get("models"),
                                         "fixes": {n: f.get("models") or {} for n, f in later["fixes"].items()}}
            except BaseException as exc:  # noqa: BLE001 - the earlier record stands; say why
                res["member_records_error"] = one_line(exc)
    return res


def main(argv):
    """``startup NAMES`` or ``vllm NAMES OUT_FILE PACKAGE_PARENT`` (see the module docstring). Returns 0; 2 on a
    usage error."""
    import json
    import time

    if len(argv) == 2 and argv[0] == "startup":
        print(json.dumps(startup_facts(json.loads(argv[1]))))
        return 0
    if len(argv) == 4 and argv[0] == "vllm":
        names, out_path, pkg_parent = json.loads(argv[1]), argv[2], argv[3]
        t0 = time.time()
        res = vllm_process(names, pkg_parent)
        res["seconds"] = round(time.time() - t0, 2)
        with open(out_path, "w") as f:
            json.dump(res, f, default=str)
        return 0
    print("usage: child.py startup NAMES | vllm NAMES OUT_FILE PACKAGE_PARENT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    drop_script_dir()
    sys.exit(main(sys.argv[1:]))
