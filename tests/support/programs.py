"""Run the programs of ``tests/programs/`` in fresh interpreters.

A program is a plain file (``tests/programs/NAME.py``) that takes its parameters from ``argv`` and the environment
and, when it reports, prints one JSON object as its last line of stdout. It runs as a file, so ``sys.path[0]`` is
``tests/programs`` (never the working directory) and nothing is imported that the program does not import itself.
A folder ``tests/programs/NAME/`` is start-up code for a fresh interpreter's ``PYTHONPATH`` (a ``sitecustomize.py``):
used in place, or copied (:func:`site_copy`) where a test changes it or needs a path of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROGRAMS = Path(__file__).resolve().parents[1] / "programs"
#: How much of a failed program's stderr (and stdout: vLLM logs there) the assertion message shows, in characters.
TAIL = 6000


def program(name: str) -> Path:
    """The file of program ``name``; ``FileNotFoundError`` if there is none."""
    path = PROGRAMS / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no program {name!r} in {PROGRAMS}")
    return path


def site_copy(name: str, dest: str | os.PathLike) -> Path:
    """A copy of the folder ``tests/programs/NAME/`` at ``dest`` (which must not exist yet), without byte code;
    returns ``dest`` as a ``Path``."""
    src = PROGRAMS / name
    if not src.is_dir():
        raise FileNotFoundError(f"no folder {name!r} in {PROGRAMS}")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return Path(dest)


def run_program(name: str, *args: str | os.PathLike, python: str | os.PathLike = sys.executable,
                env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None, timeout: float = 300,
                flags: tuple[str, ...] = (), check: bool = True, new_session: bool = False,
                ) -> subprocess.CompletedProcess:
    """``python FLAGS tests/programs/NAME.py ARGS`` with ``env`` (None: this process's) in ``cwd``, output captured
    as text, bounded by ``timeout`` seconds (``subprocess.TimeoutExpired`` past it); ``new_session``: in a session
    (and process group) of its own, so that what it starts and stops (a vLLM engine) cannot signal the test's.

    Returns the ``CompletedProcess``. With ``check`` (the default) a non-zero exit raises ``AssertionError`` naming
    the program, its return code and the tail of its stderr and stdout."""
    cmd = [str(python), *flags, str(program(name)), *map(str, args)]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                          start_new_session=new_session)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"program {name} ({' '.join(cmd)}) exited {proc.returncode}\n"
            f"--- stderr (tail) ---\n{proc.stderr[-TAIL:]}\n--- stdout (tail) ---\n{proc.stdout[-TAIL // 3:]}"
        )
    return proc


def reported(proc: subprocess.CompletedProcess) -> tuple[dict, str]:
    """``(the JSON object a program printed last, everything it wrote)``: stdout then stderr (vLLM logs to stdout,
    Python's last-resort handler to stderr). Log lines after the object (the hotfix's summary line, written at exit
    by a process that never built vLLM's processor) are passed over."""
    lines = proc.stdout.strip().splitlines()
    last = next((line for line in reversed(lines) if line.startswith("{")), lines[-1] if lines else "")
    return json.loads(last), proc.stdout + proc.stderr


def run_reporting(name: str, *args: str | os.PathLike, **kwargs) -> tuple[dict, str]:
    """:func:`run_program` (which must exit 0), then :func:`reported`."""
    return reported(run_program(name, *args, **kwargs))
