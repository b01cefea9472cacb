"""Fresh interpreters of an activation route: what one looks like after start-up, and after importing vLLM's model
module."""

from __future__ import annotations

from support.venvs import clean_env
from support.programs import run_reporting


HEAVY = ("wrapt", "torch", "vllm", "transformers")


# --------------------------------------------------------------------------------------------------------------------
# Environments (built once per module; cheap: a wheel, two venvs of symbolic links, a bundle)
# --------------------------------------------------------------------------------------------------------------------


def started(python, *, pythonpath: str = "", cwd, **env: str) -> tuple[dict, str]:
    """What a fresh interpreter looks like right after start-up, before it imports anything itself."""
    return run_reporting("started", python=python, env=clean_env(PYTHONPATH=pythonpath, **env), cwd=cwd, timeout=60)


def import_m46(python, *args: str, pythonpath: str = "", cwd, **env: str) -> tuple[dict, str]:
    """tests/programs/import_m46.py: vLLM's model module imported as vLLM would, then vLLM's general plugins loaded
    (``--no-plugins``: not), and a report of what activated."""
    return run_reporting("import_m46", *args, python=python, env=clean_env(PYTHONPATH=pythonpath, **env), cwd=cwd,
                         timeout=300)

