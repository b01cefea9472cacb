"""What tests observed in this environment, for README's release table (``scripts/results.py``)."""

from __future__ import annotations

#: section -> key -> {what: observation}. Written only by a test that has just asserted the observation, so a failed
#: or deselected test leaves its cell empty; dumped into the environment's report by conftest's
#: ``pytest_sessionfinish``.
RUN_FACTS: dict[str, dict[str, dict[str, str]]] = {}


def observed(section: str, key: str, **what: str) -> None:
    """Record an observation a test has just asserted (see :data:`RUN_FACTS`)."""
    RUN_FACTS.setdefault(section, {}).setdefault(key, {}).update(what)
