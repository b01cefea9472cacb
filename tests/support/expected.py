"""What stock vLLM does in each environment of the run, read from tests/data/stock.json (written by
``scripts/record-stock ENV``), and what it does here when the file has no row for this environment.

Two kinds of test read it:

* **Pin tests** (``pytest.mark.stock_pin``): they assert a per-release fact of *stock* vLLM -- a fix's probe verdict,
  a member's or a backport's, the error loading the bundled checkpoint, the prompt family, the quantized layouts, the
  LoRA tower flag. Where this environment has no recorded row (or the row lacks the fact) a pin test fails with one
  message naming the environment, the fact, what it observed here and the command that records it
  (:func:`missing`). Under ``scripts/record-stock`` (:data:`RECORD_VAR` set) it records what it observed instead.
* **Every other test**: it compares with an independent reference (the checkpoint, transformers, a correct stock
  release) and uses a stock fact only to know what to expect of the hotfix (applied or not, which error stock
  raises). On a recorded environment it gets the recorded fact; on one without a row it gets the fact as observed
  here on stock vLLM (:func:`observe`, run by tests/conftest.py before the first test, when no fix is applied), so it
  runs unchanged on a release nobody has recorded yet.

conftest sets :data:`STRICT` for the duration of each pin test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: The data file: ``{"environments": {"0.28.0:tf5.24.0": {...row...}}}`` (its "about" says what each field holds).
DATA = Path(__file__).resolve().parents[1] / "data" / "stock.json"
#: Set by ``scripts/record-stock`` to a file: pin tests append ``[path, observed]`` lines there instead of asserting.
RECORD_VAR = "VLLM_MINICPM_HOTFIX_RECORD_STOCK"
#: The family members other than 4.6 a row may hold verdicts for.
MEMBERS = ("MiniCPM-V 4.7", "MiniCPM-OCR")
#: Kept for the tests that iterate over the members (``table.MEMBER_VERDICTS``): member -> nothing.
MEMBER_VERDICTS: dict[str, dict] = {m: {} for m in MEMBERS}

#: True while a ``stock_pin`` test runs (tests/conftest.py).
STRICT = False
#: Facts observed on stock vLLM in this process (:func:`observe`): "verdicts", "members", "backports", "load_error".
OBSERVED: dict[str, Any] = {}


class UnknownEnvironment(LookupError):
    pass


def key(env: tuple[str, str]) -> str:
    return f"{env[0]}:tf{env[1]}"


def _load() -> dict[str, dict]:
    rows = json.loads(DATA.read_text())["environments"]
    return {k: (rows[r["same_as"]] if "same_as" in r else r) for k, r in rows.items()}


ROWS = _load()
#: The recorded environments: (vLLM release, transformers version).
ENVIRONMENTS = tuple(tuple(k.split(":tf")) for k in ROWS)


def installed_environment() -> tuple[str, str]:
    """``(vLLM release without the local part, transformers version)`` of this interpreter."""
    import transformers
    import vllm

    return vllm.__version__.split("+")[0], transformers.__version__


def row(env: tuple[str, str]) -> dict | None:
    return ROWS.get(key(env))


def recording() -> str | None:
    return os.environ.get(RECORD_VAR) or None


def needs_observing(env: tuple[str, str]) -> bool:
    """Whether this session must observe the stock facts: no row here, a row without a verdict for some fix of the
    registry (a fix added since it was recorded), or recording."""
    from vllm_minicpm_hotfix.fixes import names

    r = row(env)
    return r is None or recording() is not None or not set(names()) <= set(r.get("verdicts", {}))


def recorded_now(path: tuple[str, ...]) -> Any:
    """Recording: the value a pin test of this session recorded at ``path`` (None if none has yet)."""
    if not recording() or not Path(recording()).is_file():
        return None
    found = [v for p, v in map(json.loads, Path(recording()).read_text().splitlines()) if tuple(p) == path]
    return found[-1] if found else None


def missing(env: tuple[str, str], path: tuple[str, ...], seen: Any) -> str:
    what = ".".join(path)
    has = "has no recorded stock row" if row(env) is None else f"has no recorded {what}"
    return (f"vLLM {env[0]} / transformers {env[1]} {has} in tests/data/stock.json; observed: {what}={seen!r} "
            f"(on stock vLLM here); record it with scripts/record-stock {os.environ.get('VLLM_MINICPM_HOTFIX_ENV') or env[0]}"
            " and review the diff")


def _record(path: tuple[str, ...], seen: Any) -> None:
    with open(recording(), "a") as out:
        out.write(json.dumps([list(path), seen]) + "\n")


def _dig(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(data, dict) or part not in data:
            raise KeyError(part)
        data = data[part]
    return data


def pin(env: tuple[str, str], path: tuple[str, ...], seen: Any) -> Any:
    """For a pin test that observed ``seen`` itself: the recorded value at ``path`` of this environment's row (the
    test asserts ``seen`` against it). Recording: ``seen`` is recorded and returned. No row or no value there:
    fails naming what was observed."""
    import pytest

    if recording():
        _record(path, seen)
        return seen
    if not _has(row(env) or {}, path):
        pytest.fail(missing(env, path, seen))
    return _dig(row(env), path)


def _fact(env: tuple[str, str], path: tuple[str, ...]) -> Any:
    """The recorded fact at ``path``; outside a pin test, where there is none, the one observed here."""
    seen = _dig(OBSERVED, path) if _has(OBSERVED, path) else "not observed"
    if STRICT and recording():
        _record(path, seen)
        return seen
    r = row(env)
    if r is not None and _has(r, path):
        return _dig(r, path)
    if STRICT or seen == "not observed":
        raise UnknownEnvironment(missing(env, path, seen))
    return seen


def _has(data: Any, path: tuple[str, ...]) -> bool:
    try:
        _dig(data, path)
        return True
    except KeyError:
        return False


def verdict(fix: str, env: tuple[str, str]) -> str:
    """The stock verdict of ``fix``'s probe on vLLM's 4.6 classes in ``env``."""
    return _fact(env, ("verdicts", fix))


def member_verdicts(member: str, env: tuple[str, str]) -> dict[str, str] | None:
    """The stock verdicts of every fix on ``member``'s classes in ``env`` (None: the member is absent there)."""
    path = ("members", member)
    seen = OBSERVED.get("members", {}).get(member)
    if STRICT and recording():
        _record(path, seen)
        return seen
    r = row(env)
    if r is not None:
        return r.get("members", {}).get(member)
    if STRICT:
        raise UnknownEnvironment(missing(env, path, seen))
    return seen


def backport_verdict(name: str, env: tuple[str, str]) -> str:
    """The stock verdict of backport ``name``'s probe in ``env``."""
    return _fact(env, ("backports", name))


def stock_load_error(env: tuple[str, str]) -> str | None:
    """What stock vLLM raises loading the bundled 4.6 checkpoint in ``env`` (None: it loads)."""
    return _fact(env, ("load_error",))


def observe(m46: Any, tiny: Path) -> None:
    """Observe the cheap stock facts once, on vLLM's classes as vLLM defined them (nothing applied): every fix's probe
    on the 4.6 classes and on each other member's, every backport's probe, and what loading ``tiny`` raises."""
    if OBSERVED:
        return
    from vllm_minicpm_hotfix.backports import BACKPORTS
    from vllm_minicpm_hotfix.fixes import REGISTRY, _base

    members = {m: view for m, view in _base.member_modules(m46).items() if view is not m46}
    OBSERVED["verdicts"] = {fix.NAME: fix.probe(m46).state.value for fix in REGISTRY}
    OBSERVED["members"] = {m: {fix.NAME: (fix.probe(view).state.value if m in _base.models_of(fix) else "n/a")
                               for fix in REGISTRY} for m, view in members.items()}
    OBSERVED["backports"] = {b.NAME: b.probe().state.value for b in BACKPORTS}
    OBSERVED["load_error"] = observe_load_error(tiny)


def error_text(exc: BaseException) -> str:
    """What a pin records of an error: its message's first line up to the first ``{`` (vLLM prints sets of parameter
    names there, in an order that changes between processes), or the class name of an error without a message."""
    text = str(exc).splitlines()[0].split("{")[0].rstrip() if str(exc).strip() else ""
    return text or type(exc).__name__


def observe_load_error(checkpoint: Path) -> str | None:
    """What stock vLLM's ``load_weights`` raises on ``checkpoint`` (:func:`error_text`; None: it loads)."""
    from support.vllm_build import build_vllm_model, load_checkpoint

    model = build_vllm_model(checkpoint, load=False)
    try:
        load_checkpoint(model, checkpoint)
    except ValueError as exc:
        return error_text(exc)
    return None
