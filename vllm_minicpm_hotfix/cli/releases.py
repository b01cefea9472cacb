"""The measured releases: which fixes the hotfix applies on each vLLM release of the recorded test run, the
sentence ``doctor`` ends with (is the package still needed here, and which measured release needs none of it), and
the range of releases ``doctor`` points a user to (:func:`known_range`).

The facts ship with the package as ``data/releases.json``, derived by ``scripts/release-facts`` (:func:`derive`) from
the recorded run ``docs/results/test-run.json`` that ``scripts/test --record`` writes; tests/release/test_release.py fails
when the two differ. Nothing here is typed by hand, and nothing imports vLLM.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

#: The packaged facts (``load()``).
DATA = Path(__file__).resolve().parents[1] / "data" / "releases.json"

NOTHING_NEEDED = "nothing to fix on this vLLM: the package can be removed"
NONE_FIXES_ALL = "needed, and no measured release fixes all of them"


def derive(run: dict[str, Any]) -> dict[str, Any]:
    """The packaged facts from a recorded run (the dict of ``docs/results/test-run.json``): ``commit``, ``date``
    and ``environments``, one per environment of the run, in the run's order, each with ``environment`` (the
    ``scripts/test`` spec), ``vllm``, ``transformers``, ``applied`` (the NAMEs whose stock verdict there is
    ``broken``: what the hotfix applies under ``auto``) and ``verdicts`` (NAME -> stock verdict). Raises ``KeyError``
    on a run without these fields."""
    envs = []
    for e in run["environments"]:
        verdicts = dict(e["verdicts"])
        envs.append({
            "environment": e["environment"], "vllm": e["vllm"], "transformers": e["transformers"],
            "applied": [n for n, v in verdicts.items() if v == "broken"], "verdicts": verdicts,
        })
    return {"commit": run["commit"], "date": run["date"], "environments": envs}


def load(path: Path = DATA) -> dict[str, Any]:
    """The packaged facts (see :func:`derive`); ``{"environments": []}`` if the file is missing or unreadable (a
    broken install must not break ``doctor``)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"environments": []}


def _key(version: str) -> tuple[int, ...]:
    """``"0.28.0"`` -> ``(0, 28, 0)``; a local or dev suffix is ignored (``0.28.0+cpu``, ``0.29.0rc1`` -> 0.29.0)."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def known_range(facts: dict[str, Any] | None = None) -> str | None:
    """The vLLM releases the recorded run measured, as ``doctor`` names them to a user: ``"0.22-0.33"`` (the oldest
    and the newest measured ``major.minor``; one release alone: ``"0.28"``), or None when the facts list none."""
    facts = load() if facts is None else facts
    keys = sorted({_key(e["vllm"])[:2] for e in facts.get("environments", []) if e.get("vllm")})
    if not keys:
        return None
    first, last = (".".join(map(str, k)) for k in (keys[0], keys[-1]))
    return first if first == last else f"{first}-{last}"


def removal(needed: list[str], installed: str | None, facts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Whether the package is still needed here, in one sentence.

    ``needed``: the NAMEs of the fixes stock vLLM here is not correct for (``doctor``'s ``needed``); ``installed``:
    this vLLM's version. Returns ``sentence`` (one of :data:`NOTHING_NEEDED`, ``"needed for N fixes; vLLM X.Y.Z
    (measured, transformers T) needs none of them"``, :data:`NONE_FIXES_ALL`), ``needed``, ``release`` (the measured
    environment named, else None) and ``measured_at`` (the recorded run's commit and date). A measured release needs
    none of them when every one of ``needed`` has the stock verdict ``correct`` there; of those, the oldest release
    newer than ``installed`` is named, else the newest one.
    """
    facts = load() if facts is None else facts
    measured = {"commit": facts.get("commit"), "date": facts.get("date")}
    if not needed:
        return {"sentence": NOTHING_NEEDED, "needed": [], "release": None, "measured_at": measured}
    fits = [e for e in facts.get("environments", []) if all(e["verdicts"].get(n) == "correct" for n in needed)]
    fits.sort(key=lambda e: (_key(e["vllm"]), e["transformers"]))
    here = _key(installed) if installed else ()
    newer = [e for e in fits if _key(e["vllm"]) > here]
    pick = newer[0] if newer else (fits[-1] if fits else None)
    if pick is None:
        sentence = NONE_FIXES_ALL
    else:
        n = len(needed)
        sentence = (f"needed for {n} fix{'es' if n != 1 else ''}; vLLM {pick['vllm']} (measured, transformers "
                    f"{pick['transformers']}) needs none of them")
    release = None if pick is None else {k: pick[k] for k in ("environment", "vllm", "transformers")}
    return {"sentence": sentence, "needed": list(needed), "release": release, "measured_at": measured}
