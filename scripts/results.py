#!/usr/bin/env python3
"""The test run's figures: one place that reads what scripts/test produced and writes what README quotes.

    python3 scripts/results.py summarize OUT --releases SPEC... --wall SECONDS [--record docs/results]
    python3 scripts/results.py readme [--check]

``summarize`` reads, per environment, the JUnit XML, the exit status, the wall time and the report
(``VLLM_MINICPM_HOTFIX_REPORT``: versions and every fix's verdict) that scripts/test left in ``OUT``; prints one line
per environment and the total ``N passed, N failed, N skipped``; exits 1 if anything failed, was skipped, crashed
(pytest died before writing its report) or did not build. With ``--record DIR`` it also writes ``DIR/test-run.json``
and ``DIR/test-run.md`` (dated, with the commit measured), which README quotes.

``readme`` re-renders README.md's generated sections (between ``<!-- results:NAME -->`` and ``<!-- /results:NAME
-->``: ``releases``, one row per vLLM release, and ``run``) and writes the whole page ``docs/results/matrix.md`` (fix x
environment, quantized checkpoints) from ``docs/results/test-run.json``; ``--check`` only says whether both are up to
date (exit 1 if not).
Standard library only: it runs with the machine's own python3, outside the test environments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
README = REPO / "README.md"


def tag_of(spec: str) -> str:
    rel, _, opt = spec.partition(":")
    return f"{rel}-{opt}" if opt else rel


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def collect(out: Path, specs: list[str]) -> list[dict]:
    """One record per environment: counts, failures, skips, crash, seconds, versions, verdicts."""
    rows = []
    for spec in specs:
        tag = tag_of(spec)
        row: dict = {"environment": spec, "passed": 0, "failed": 0, "skipped": 0, "problems": [], "failures": [],
                     "skips": []}
        if (out / f"{tag}.failed").exists():
            row["problems"].append("environment build failed")
            row["failed"] += 1
            rows.append(row)
            continue
        rc = _read(out / f"{tag}.rc")
        seconds = _read(out / f"{tag}.seconds")
        row["seconds"] = int(seconds) if seconds and seconds.isdigit() else None
        xml = out / f"{tag}.xml"
        if xml.exists():
            try:
                root = ET.parse(xml).getroot()
            except ET.ParseError as exc:
                root = None
                row["problems"].append(f"unreadable JUnit report: {exc}")
            if root is not None:
                suite = root if root.tag == "testsuite" else root.find("testsuite")
                per_module: dict[str, float] = {}
                for case in suite.iter("testcase"):
                    name = f"{case.get('classname', '')}::{case.get('name', '')}"
                    module = case.get("file") or case.get("classname", "").rpartition(".")[0] or "?"
                    per_module[module] = per_module.get(module, 0.0) + float(case.get("time") or 0)
                    if case.find("failure") is not None or case.find("error") is not None:
                        row["failed"] += 1
                        row["failures"].append(name)
                    elif case.find("skipped") is not None:
                        row["skipped"] += 1
                        msg = case.find("skipped").get("message", "")
                        row["skips"].append(f"{name}: {msg}")
                    else:
                        row["passed"] += 1
                # Where the environment's time goes (JUnit's per-test seconds, fixtures included, summed per test
                # module): the first place to look when the run nears its time budget.
                row["slowest_modules"] = {m: round(t) for m, t in
                                          sorted(per_module.items(), key=lambda kv: -kv[1])[:8]}
        else:
            row["problems"].append("pytest wrote no report (it crashed or was killed)")
        # pytest: 0 all passed, 1 tests failed; anything else (2 interrupted, 3 internal error, 4 usage, 5 no tests,
        # 124/137 the runner's timeout) means the session did not complete: a failure of its own.
        if rc not in ("0", "1"):
            row["problems"].append(f"pytest exited {rc if rc is not None else '(no exit status)'}")
        if row["problems"]:
            row["failed"] += 1
        report = out / f"{tag}.json"
        if report.exists():
            info = json.loads(report.read_text())
            row.update({k: info.get(k) for k in ("vllm", "torch", "transformers", "python")})
            row["verdicts"] = {name: v["verdict"] for name, v in (info.get("fixes") or {}).items()}
            # fix -> member -> verdict for the family members other than 4.6 (runs recorded before they existed: none)
            row["member_verdicts"] = {name: v["models"] for name, v in (info.get("fixes") or {}).items()
                                      if v.get("models")}
            row["labels"] = {name: v.get("label", name) for name, v in (info.get("fixes") or {}).items()}
            row["observed"] = info.get("observed") or {}
            row["backports"] = info.get("backports") or {}
        rows.append(row)
    return rows


def summary_lines(rows: list[dict], wall: int | None) -> list[str]:
    lines = ["=============================== summary ==============================="]
    for row in rows:
        env = row["environment"]
        versions = (f"vLLM {row.get('vllm', env)} (torch {row.get('torch', '?')}, transformers "
                    f"{row.get('transformers', '?')}, Python {row.get('python', '?')})")
        verdicts = ", ".join(f"{k} {v}" for k, v in (row.get("verdicts") or {}).items()) or "verdicts unknown"
        secs = f"{row['seconds']} s" if row.get("seconds") is not None else "-"
        lines.append(f"{env:<18} {versions}: {verdicts}; {row['passed']} passed, {row['failed']} failed, "
                     f"{row['skipped']} skipped; {secs}")
        for p in row["problems"]:
            lines.append(f"    PROBLEM: {p}")
        for f in row["failures"]:
            lines.append(f"    FAILED: {f}")
        for s in row["skips"]:
            lines.append(f"    SKIPPED (counts as a failure of the run): {s}")
    if wall is not None:
        lines.append(f"wall time of the whole run: {wall // 60} min {wall % 60} s")
    p = sum(r["passed"] for r in rows)
    f = sum(r["failed"] for r in rows)
    s = sum(r["skipped"] for r in rows)
    lines.append(f"{p} passed, {f} failed, {s} skipped")
    return lines


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(rows: list[dict], wall: int | None, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    data = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "wall_seconds": wall,
        "passed": sum(r["passed"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        "skipped": sum(r["skipped"] for r in rows),
        "environments": rows,
    }
    (dest / "test-run.json").write_text(json.dumps(data, indent=1) + "\n")
    (dest / "test-run.md").write_text(render_run(data) + "\n")


# --------------------------------------------------------------------------------------------------------------------
# What README quotes
# --------------------------------------------------------------------------------------------------------------------


def render_run(data: dict) -> str:
    wall = data.get("wall_seconds")
    head = (f"`scripts/test --record` at commit `{data['commit']}`, {data['date']}: **{data['passed']} passed, "
            f"{data['failed']} failed, {data['skipped']} skipped**"
            + (f" in {wall // 60} min {wall % 60} s" if wall is not None else "") + ".")
    rows = ["| environment | vLLM | transformers | Python | passed | failed | skipped | minutes |",
            "|---|---|---|---|---|---|---|---|"]
    for r in data["environments"]:
        mins = f"{r['seconds'] / 60:.1f}" if r.get("seconds") is not None else "-"
        rows.append(f"| {r['environment']} | {r.get('vllm', '?')} | {r.get('transformers', '?')} | "
                    f"{r.get('python', '?')} | {r['passed']} | {r['failed']} | {r['skipped']} | {mins} |")
    return head + "\n\n" + "\n".join(rows)


#: The quantized layouts tests/fixes/test_quantized_vision.py and (bnb) test_unsupported_quant_method.py write and
#: record (``support.observed``), and the AWQ engine run of tests/e2e/test_quantized_engine.py, in README's words.
CHECKPOINTS = {
    "gptq": "GPTQ 4-bit language model, vision bf16",
    "gptq_list": "GPTQ with a module list in the config",
    "gptq_vitqkv": "GPTQ with the vit_merger q/k/v quantized too",
    "awq": "AWQ, skip list in transformers' names",
    "awq_unaligned": "AWQ whose vision sizes no 4-bit kernel takes",
    "bnb": "bitsandbytes NF4",
    "awq_engine": "AWQ twin generating through vLLM's engine (tests/e2e/test_quantized_engine.py)",
}


def render_verdicts(data: dict) -> str:
    """Fix x environment: what each fix's probe found on stock vLLM there -- **fixed** (broken, so ``auto`` applies the
    fix), ok (correct upstream), n/a (not applicable) -- and a last row with the environment's test counts."""
    envs = [r for r in data["environments"] if r.get("verdicts")]
    fixes: list[str] = []
    labels: dict[str, str] = {}
    for r in envs:
        for name in r["verdicts"]:
            if name not in fixes:
                fixes.append(name)
            labels.setdefault(name, (r.get("labels") or {}).get(name, name))

    def env_name(r: dict) -> str:
        rel = (r.get("vllm") or r["environment"]).split("+")[0]
        return f"{rel}<br>tf {r.get('transformers', '?')}" + ("<br>(unpinned)" if "unpinned" in r["environment"] else "")

    mark = {"broken": "**fixed**", "correct": "ok", "unrecognised": "n/a", "undetermined": "?"}
    lines = ["| what vLLM gets wrong (fix) | " + " | ".join(env_name(r) for r in envs) + " |",
             "|---|" + "---|" * len(envs)]
    members = sorted({m for r in envs for v in (r.get("member_verdicts") or {}).values() for m in v})

    def cell(r: dict, n: str) -> str:
        out = mark.get(r["verdicts"].get(n, ""), r["verdicts"].get(n, "-"))
        if members:  # release x model x fix: 4.6's verdict, then each other member's where this release has it
            out = f"4.6: {out}"
            for m in members:
                v = ((r.get("member_verdicts") or {}).get(n) or {}).get(m)
                if v is not None:
                    out += f"<br>{m.removeprefix('MiniCPM-V ')}: {mark.get(v, v)}"
        return out

    for n in fixes:
        cells = [cell(r, n) for r in envs]
        lines.append(f"| {labels[n]} (`{n}`) | " + " | ".join(cells) + " |")
    lines.append("| tests passed / failed | " + " | ".join(f"{r['passed']} / {r['failed']}" for r in envs) + " |")
    def pythons(r: dict) -> str:
        extra = (r.get("observed") or {}).get("pythons", {})
        out = [f"{r.get('python', '?')} (suite)"]
        for version, routes in sorted(extra.items()):
            out.append(f"{version}: " + ", ".join(sorted(routes)))
        return "<br>".join(out)

    lines.append("| Python (the suite's; others: activation routes that loaded the model) | "
                 + " | ".join(pythons(r) for r in envs) + " |")
    seen = [key for key in CHECKPOINTS if any(key in (r.get("observed") or {}).get("checkpoints", {}) for r in envs)]
    if seen:
        lines.append("| **quantized checkpoints** (tests/fixes/test_quantized_vision.py, test_unsupported_quant_method.py, tests/e2e/test_quantized_engine.py): stock vLLM "
                     "&rarr; with the hotfix |"
                     + " |" * len(envs))
        for key in seen:
            cells = []
            for r in envs:
                got = (r.get("observed") or {}).get("checkpoints", {}).get(key)
                cells.append(f"{got.get('stock', '?')} &rarr; {got.get('hotfix', '?')}" if got else "-")
            lines.append(f"| {CHECKPOINTS[key]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\n**fixed**: stock vLLM is broken there and the hotfix (auto) applies the fix; ok: correct upstream, left "
        f"alone. Each cell is the fix's own probe on that environment's stock vLLM, recorded by `scripts/test --record` "
        f"at commit `{data['commit']}`, {data['date']}, and asserted against `tests/support/expected.py` by that run. The "
        f"checkpoint rows are what the tests observed and asserted there; `-` where they do not run.")


def _version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+]", version))


def releases(data: dict) -> list[dict]:
    """One record per vLLM release of the run, oldest first: ``release``, ``transformers`` (the versions measured
    with it), ``applied`` (the fixes whose probe found stock vLLM broken in at least one of its environments, in
    registry order) and ``only`` (fix -> the transformers versions where it applies, for a fix that applies with some
    of them only)."""
    by_release: dict[str, list[dict]] = {}
    for r in data["environments"]:
        if r.get("verdicts"):
            by_release.setdefault((r.get("vllm") or r["environment"]).split("+")[0], []).append(r)
    out = []
    for rel in sorted(by_release, key=_version_key):
        envs = by_release[rel]
        applied = []
        for r in envs:
            applied += [n for n, v in r["verdicts"].items() if v == "broken" and n not in applied]
        only = {}
        for n in applied:
            where = sorted({r.get("transformers", "?") for r in envs if r["verdicts"].get(n) == "broken"},
                           key=_version_key)
            if any(r["verdicts"].get(n) != "broken" for r in envs):
                only[n] = where
        out.append({"release": rel, "applied": applied, "only": only,
                    "transformers": sorted({r.get("transformers", "?") for r in envs}, key=_version_key)})
    return out


def first_release_needing_none(rows: list[dict], index: int) -> str | None:
    """The first measured release newer than ``rows[index]`` whose stock vLLM needs none of that release's fixes."""
    mine = set(rows[index]["applied"])
    return next((r["release"] for r in rows[index + 1:] if not mine & set(r["applied"])), None)


def render_releases(data: dict) -> str:
    """README's table: one row per release -- the fixes the hotfix applies there and the first newer measured release
    that needs none of them, if any."""
    rows = releases(data)
    lines = ["| vLLM | transformers | fixes the hotfix applies there | first newer release needing none of them |",
             "|---|---|---|---|"]
    newest = rows[-1]["release"] if rows else None
    for i, r in enumerate(rows):
        names = [f"`{n}`" + (f" (transformers {', '.join(r['only'][n])})" if n in r["only"] else "")
                 for n in r["applied"]]
        fixes = f"{len(r['applied'])}: " + ", ".join(names) if names else "none: the package can be removed"
        if r["release"] == newest:
            later = "none measured (newest measured)"
        else:
            found = first_release_needing_none(rows, i)
            still = len(set(r["applied"]) & set(rows[-1]["applied"]))
            later = f"**{found}**" if found else f"none measured ({newest} still needs {still} of them)"
        lines.append(f"| {r['release']} | {', '.join(r['transformers'])} | {fixes} | {later} |")
    return "\n".join(lines) + (
        f"\n\nEach fix applies where its own probe finds stock vLLM broken (`auto`); recorded by `scripts/test --record` "
        f"at commit `{data['commit']}`, {data['date']}. What each fix is, the full fix &times; release &times; "
        f"transformers matrix and the quantized checkpoints: [docs/results/matrix.md](docs/results/matrix.md).")


def _member_cell(r: dict, backport: dict) -> str:
    """One environment's answer for one backported member: how this vLLM serves it, from the backport's probe on
    stock vLLM and the fixes' probes on that member's classes."""
    fixes = sum(1 for v in (r.get("member_verdicts") or {}).values() if v.get(backport["member"]) == "broken")
    if backport["verdict"] == "missing":
        return f"registered by the hotfix, {fixes} fixes"
    if backport["verdict"] == "correct" and backport["reason"].startswith("vLLM's own"):
        return f"vLLM's own, {fixes} fixes"
    return "cannot be served: " + _first_clause(backport["reason"])


def _first_clause(reason: str) -> str:
    """``reason`` up to its first ``": "`` (where a probe's reason goes on to details), without a trailing
    ``(module:Class)`` it names or a parenthesis left open."""
    head = reason.split(": ")[0]
    if head.count("(") > head.count(")") or (head.endswith(")") and ":" in head[head.rfind("("):]):
        head = head[: head.rindex("(")].rstrip()
    return head


def _by_transformers(answers: dict[str, list[str]]) -> str:
    """One cell from ``{answer: [transformers versions]}``: the answer, or each answer with its versions."""
    if len(answers) == 1:
        return next(iter(answers))
    return "; ".join(f"{a} (transformers {', '.join(sorted(set(t), key=_version_key))})" for a, t in answers.items())


def render_members(data: dict) -> str:
    """README's first-screen table: which family member each release serves, and how -- vLLM's own classes with the
    hotfix's fixes, registered by the hotfix (a backport), or not at all and why. A release measured with several
    transformers versions names the version where the answers differ."""
    by_release: dict[str, list[dict]] = {}
    for r in data["environments"]:
        if r.get("verdicts"):
            by_release.setdefault((r.get("vllm") or r["environment"]).split("+")[0], []).append(r)
    members: list[tuple[str, str]] = []
    for envs in by_release.values():
        for r in envs:
            for name, b in (r.get("backports") or {}).items():
                if (name, b["member"]) not in members:
                    members.append((name, b["member"]))
    applied = {row["release"]: len(row["applied"]) for row in releases(data)}
    lines = ["| " + " | ".join(["vLLM", "MiniCPM-V 4.6", *(m for _, m in members)]) + " |",
             "|---|---|" + "---|" * len(members)]
    for rel in sorted(by_release, key=_version_key):
        envs = by_release[rel]
        cells = [f"vLLM's own, {applied.get(rel, 0)} fixes"]
        for name, _ in members:
            answers: dict[str, list[str]] = {}
            for r in envs:
                b = (r.get("backports") or {}).get(name)
                answers.setdefault(_member_cell(r, b) if b else "not measured", []).append(r.get("transformers", "?"))
            cells.append(_by_transformers(answers))
        lines.append(f"| {rel} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + (
        f"\n\nFrom the probes of `scripts/test --record` at commit `{data['commit']}` on stock vLLM in each "
        f"environment; a fix counts where its probe finds that member's classes broken.")


#: The page docs/results/matrix.md, generated whole by ``readme`` (its first line says so).
MATRIX = RESULTS / "matrix.md"


def render_matrix(data: dict) -> str:
    return ("<!-- generated by `python3 scripts/results.py readme` from docs/results/test-run.json: do not edit -->\n"
            "# Fixes per release, transformers and checkpoint: the recorded run\n\n"
            "One column per environment of the run (vLLM release and the transformers it was measured with), one row "
            "per fix (its label and `NAME`, the module in `vllm_minicpm_hotfix/fixes/`), then the test counts, the "
            "Pythons and what each quantized checkpoint does on stock vLLM and with the hotfix. README's table "
            "(one row per release) is drawn from the same run.\n\n" + render_verdicts(data) + "\n")


SECTIONS = {"run": render_run, "releases": render_releases, "members": render_members}


def render_readme(text: str, data: dict) -> str:
    for name, render in SECTIONS.items():
        pattern = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        text = pattern.sub(lambda m: m.group(1) + render(data) + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("out", type=Path)
    s.add_argument("--releases", nargs="+", required=True)
    s.add_argument("--wall", type=int)
    s.add_argument("--record", type=Path)
    r = sub.add_parser("readme")
    r.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)

    if args.cmd == "summarize":
        rows = collect(args.out, args.releases)
        print("\n".join(summary_lines(rows, args.wall)))
        if args.record:
            record(rows, args.wall, args.record)
            print(f"recorded in {args.record}/test-run.json and test-run.md; `python3 scripts/results.py readme` "
                  f"updates README.md")
        bad = any(r["failed"] or r["skipped"] for r in rows) or not sum(r["passed"] for r in rows)
        return 1 if bad else 0

    data = json.loads((RESULTS / "test-run.json").read_text())
    wanted = {README: render_readme(README.read_text(), data), MATRIX: render_matrix(data)}
    if args.check:
        stale = [p for p, new in wanted.items() if not p.exists() or p.read_text() != new]
        for p in stale:
            print(f"{p.relative_to(REPO)} differs from docs/results/test-run.json: run "
                  "`python3 scripts/results.py readme`")
        return 1 if stale else 0
    for p, new in wanted.items():
        p.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
