"""What ``doctor`` concludes from the facts :mod:`vllm_minicpm_hotfix.cli.doctor.facts` gathered.

* :func:`assess_fixes` -- per registered fix, from the fresh vLLM process: the verdict on vLLM as shipped, the verdict
  now (the fix's probe re-run after the hook), whether the hook applied it.
* :func:`judge` -- the verdict: ``(ok, one line saying why and what to do)``. All of doctor's decision is in it.
* :func:`removal` -- the sentence doctor ends with: is the package still needed here, and which measured release
  needs none of the fixes this vLLM needs (:mod:`vllm_minicpm_hotfix.cli.releases`, from the packaged recorded run).

Nothing here starts a process or reads the environment: both take the report dict and return plain values, so the
judgement can be tested on hand-made reports.
"""

from __future__ import annotations

import sys
from typing import Any

from ... import plugin
from .. import releases
from ...hook import TARGET_MODULE
from ...record import backport_says

def assess_fixes(child: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per fix of the registry, from the fresh vLLM process (``child``): ``label``; ``stock`` / ``stock_reason`` (the
    verdict on vLLM as shipped: the hook's record where the fix was applied, else the probe); ``now`` /
    ``now_reason`` (the probe re-run on the classes as they are after the hook); ``applied``; ``needed`` (stock is
    not correct); ``ok`` (the probe now says correct); ``hook_error``; ``why`` (the hook's decision); ``scope`` (the
    checkpoints a scoped fix is limited to, e.g. quantized ones: its verdict does not decide doctor's); ``scope_check``
    (the command that checks a checkpoint for that scope, None: ``--model``); ``first_use`` (the hook defers its probe
    to the first use of its code path; the child probed it); ``wraps`` (``"Class.attr"`` -> the fix whose wrapper of
    that attribute this fix's wrapper calls: two fixes on one attribute); ``left_out``
    (``VLLM_MINICPM_HOTFIX_DISABLED_FIXES`` names it: the hook left it out in vLLM's processes)."""
    recorded = (child.get("status") or {}).get("fixes") or {}
    members = (child.get("member_records") or {}).get("fixes") or {}  # the per-member rows once all were imported
    first_use = child.get("first_use") or {}
    out: dict[str, dict[str, Any]] = {}
    for name, probe in (child.get("fixes") or {}).items():
        rec = recorded.get(name) or {}
        if name in members:
            rec = {**rec, "models": members[name]}
        deferred = bool(rec.get("first_use"))
        if name in first_use:  # probed at first use in vLLM's processes; the child probed it as that use would
            rec = {**rec, **first_use[name]}
        applied = bool(probe.get("patched"))
        if not applied:
            stock, stock_reason = probe["state"], probe["reason"]
        elif rec.get("verdict") not in (None, "error", "n/a"):
            stock, stock_reason = rec["verdict"], rec.get("reason", "")
        else:
            stock, stock_reason = "unknown", "patched before the hook recorded a verdict"
        out[name] = {
            "label": probe.get("label") or name, "stock": stock, "stock_reason": stock_reason,
            "now": probe["state"], "now_reason": probe["reason"], "applied": applied,
            "needed": stock != "correct", "ok": probe["state"] == "correct",
            "hook_error": rec.get("error"), "why": rec.get("why"), "scope": probe.get("scope"),
            "scope_check": probe.get("scope_check"), "models": _assess_models(probe, rec),
            "first_use": deferred, "wraps": dict(rec.get("wraps") or {}), "left_out": bool(rec.get("left_out")),
        }
    return out


def _assess_models(probe: dict[str, Any], rec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per family member (and undeclared subclass) of one fix: ``declared``, ``unknown``, ``stock`` / ``stock_reason``
    (the hook's per-member verdict where it recorded one, else the probe), ``now`` / ``now_reason``, ``applied``,
    ``ok`` (declared and now correct)."""
    out: dict[str, dict[str, Any]] = {}
    recorded = rec.get("models") or {}
    for member, row in (probe.get("models") or {}).items():
        hook = recorded.get(member) or {}
        stock = hook.get("verdict") if hook.get("verdict") not in (None, "n/a", "error") else row["state"]
        out[member] = {
            "declared": bool(row.get("declared")), "unknown": bool(row.get("unknown")),
            "stock": stock, "stock_reason": hook.get("reason") or row.get("reason", ""),
            "now": row["state"], "now_reason": row.get("reason", ""), "applied": bool(hook.get("applied")),
            "ok": bool(row.get("declared")) and row["state"] == "correct",
        }
    return out


def removal(report: dict[str, Any]) -> dict[str, Any] | None:
    """The last sentence of doctor and ``removal`` of ``--json`` (:func:`vllm_minicpm_hotfix.cli.releases.removal`):
    from the fixes stock vLLM here is not correct for. None when doctor could not read the fixes (no vLLM, no 4.6
    model module, a failed vLLM process)."""
    fixes = report.get("fixes") or {}
    if not fixes:
        return None
    version = (report.get("child") or {}).get("vllm_version") or report["vllm"].get("version")
    return releases.removal([n for n, f in fixes.items() if f["needed"]], version)


def hook_active(report: dict[str, Any]) -> bool:
    """Whether the post-import hook was installed at any step of the fresh vLLM process."""
    steps = (report.get("child") or {}).get("steps") or {}
    return any(s.get("hook_installed") for s in steps.values())


def judge(report: dict[str, Any]) -> tuple[bool, str]:
    """``(ok, one line saying why and what to do)``; the line starts with ``OK:`` or ``FAIL:``.

    In order: vLLM must be installed, import, and have the 4.6 model module; no fix may have failed inside the hook;
    then every fix whose probe on the classes as they now stand is not ``correct`` fails the check -- with the
    reason it is still broken (no activation path fired, the patch did not take, the mode kept it off, the operator
    left it out with ``VLLM_MINICPM_HOTFIX_DISABLED_FIXES``) -- except a fix scoped to some checkpoints (``SCOPE``),
    which only warns.
    """
    child = report.get("child") or {}
    fixes = report["fixes"]
    version = child.get("vllm_version") or report["vllm"]["version"]
    if not report["vllm"]["installed"]:
        return False, (f"FAIL: vLLM is not installed for {sys.executable}: run doctor with the Python that runs "
                       f"`vllm serve` (its environment is the one that needs the hotfix)")
    if child.get("error"):
        return False, f"FAIL: {child['error']}: fix the vLLM installation first"
    if child.get("module") is False:
        return False, (f"FAIL: vLLM {version} has no MiniCPM-V 4.6 model ({TARGET_MODULE} missing; added in vLLM "
                       f"0.22): upgrade vLLM")
    failed = next((n for n, f in fixes.items() if f.get("hook_error")), None)
    if failed is not None:
        return False, (f"FAIL: the hotfix's {failed} failed inside vLLM's process ({fixes[failed]['hook_error']}); "
                       f"vLLM is left unpatched: report it (the log line 'vllm-minicpm-hotfix: the post-import hook "
                       f"failed' has the traceback)")
    backports = (child.get("status") or {}).get("backports") or {}
    failed = next((n for n, b in backports.items() if b.get("verdict") == "error"), None)
    if failed is not None:
        return False, (f"FAIL: the hotfix's backport {failed} ({backports[failed].get('member')}) failed inside vLLM's "
                       f"process ({backports[failed].get('error')}); vLLM is left without it: report it (the log "
                       f"line 'vllm-minicpm-hotfix: the backport {failed}' has the traceback)")
    broken = [n for n, f in fixes.items() if not f["ok"] and not f.get("scope")]  # scoped: WARN rows only
    # Another family member (4.7) a fix declares whose classes still fail its probe: as wrong as a 4.6 failure.
    members = [(n, m, r) for n, f in fixes.items() if not f.get("scope")
               for m, r in (f.get("models") or {}).items() if r.get("declared") and not r.get("ok")]
    if not broken and members:
        n, m, r = members[0]
        return False, (f"FAIL: vLLM {version} serves {m} with {fixes[n].get('label') or n} still {r['now']} "
                       f"({r['now_reason']}; stock {r['stock']}, {'patched' if r['applied'] else 'not patched'}): "
                       f"run `vllm-minicpm-hotfix verify` and report it")
    if not broken:
        patched = sum(1 for f in fixes.values() if f["applied"])
        upstream = sum(1 for f in fixes.values() if f["ok"] and not f["applied"])
        state = "hotfix active" if hook_active(report) else "hotfix not active"
        said = [(b.get("member"), backport_says(b)) for b in backports.values()]
        members = "".join(f"; {member}: {says}" for member, says in said if says)  # "; MiniCPM-V 4.7: vLLM's own"
        return True, (f"OK: a vLLM {version} started from this environment loads MiniCPM-V 4.6 correctly "
                      f"({patched} fixes patched by the hotfix, {upstream} correct upstream; {state}){members}")
    listed = ", ".join(broken)
    what = listed if len(listed) <= 60 else f"{len(broken)} fixes: the FAIL rows above"
    if not hook_active(report):
        return False, (f"FAIL: vLLM {version} needs the hotfix ({what}) but it is not active in a fresh vLLM "
                       f"process: {activation_advice(report)}")
    left_out = [n for n in broken if fixes[n].get("left_out")]
    if left_out:
        return False, (f"FAIL: vLLM {version}: {', '.join(left_out)} left out by VLLM_MINICPM_HOTFIX_DISABLED_FIXES, so "
                       f"vLLM keeps {'that defect' if len(left_out) == 1 else 'those defects'} "
                       f"({fixes[left_out[0]]['stock_reason']}): take "
                       f"{'it' if len(left_out) == 1 else 'them'} out of the variable to fix it")
    first = fixes[broken[0]]
    if first["applied"]:
        return False, (f"FAIL: the hotfix patched {broken[0]} but vLLM's loading still fails the check "
                       f"({first['now_reason']}): run `vllm-minicpm-hotfix verify` and report it")
    return False, (f"FAIL: vLLM {version}: {what}; the hotfix is active but did not apply it "
                   f"({first.get('why') or 'not applied'}): {mode_advice(report, first)}")


def mode_advice(report: dict[str, Any], fix: dict[str, Any]) -> str:
    """What to do when the hook ran but left a needed fix alone."""
    if fix["stock"] in ("unrecognised", "undetermined"):
        known = releases.known_range()  # the releases of the recorded run (data/releases.json)
        return ("run `vllm-minicpm-hotfix verify` on the checkpoint; if it fails, set VLLM_MINICPM_HOTFIX=force"
                + (f" (or use a vLLM release this hotfix was measured on, {known})" if known else ""))
    if ((report.get("child") or {}).get("status") or {}).get("mode") == "off":
        return "unset VLLM_MINICPM_HOTFIX (or set it to auto)"
    return "set VLLM_MINICPM_HOTFIX=auto"


def activation_advice(report: dict[str, Any]) -> str:
    """What to do when the hook did not activate in the fresh vLLM process."""
    act = report["activation"]
    sc = act["sitecustomize"]
    if report["mode"]["value"] == "off":
        return "VLLM_MINICPM_HOTFIX=off switches it off: unset it (or set it to auto)"
    if "-S" in report["python"]["flags"]:
        return "python runs with -S (no site: no .pth, no sitecustomize): drop -S"
    pth, ep = act["pth"]["files"], act["entry_point"]["registered"]
    if ep and not act["vllm_plugins"]["allows_ours"] and not pth:
        allow = act["vllm_plugins"]["VLLM_PLUGINS"]
        near = " (remove the spaces)" if act["vllm_plugins"]["near_miss"] else ""
        return (f"VLLM_PLUGINS={allow!r} leaves out the '{plugin.NAME}' plugin{near}: "
                f"set VLLM_PLUGINS={(allow + ',') if allow else ''}{plugin.NAME}")
    if act["bundles"] and sc["pythonpath_ignored"]:
        return "the bundle is on PYTHONPATH but python runs with -E/-I, which ignores PYTHONPATH: drop the flag"
    if sc["shadowed_by"]:
        return (f"another sitecustomize ({sc['shadowed_by']}) comes before the hotfix's on sys.path: put the bundle "
                f"folder first in PYTHONPATH")
    if act["pth"].get("outside_site_dirs") and not pth:
        return (f"{act['pth']['outside_site_dirs'][0]} is on PYTHONPATH (pip install --target?), not in a site "
                f"directory, so Python does not run it: write a bundle (`vllm-minicpm-hotfix bundle DIR`, "
                f"PYTHONPATH=DIR) or pip install into the environment")
    if not (ep or pth or sc["ours"]):
        return ("the hotfix is not installed in this environment: `pip install` it (a clone or its wheel) into the "
                "Python that runs vllm, or put a `vllm-minicpm-hotfix bundle` folder on PYTHONPATH")
    return "no activation path fired in a fresh vLLM process (see the activation rows above)"
