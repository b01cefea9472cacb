"""Throwaway environments with the package installed, for the tests (tests/activation/, tests/e2e/: imported through
tests/support/venvs.py) and the benchmarks (benchmarks/bench.py, benchmarks/serving.py).

The tests run inside one shared CPU environment built by ``scripts/cpu-env RELEASE`` (5-6 GB, reused by every test
and every colleague), which must never get this package installed. Each test that needs "the package pip-installed"
or "an image without wrapt" gets a throwaway *overlay* of it instead:

* a fresh venv on the same base interpreter (``python -m venv --without-pip``, ~0.1 s), whose site-packages holds a
  symbolic link to every entry of the shared environment's site-packages (~330 links, nothing copied), minus wrapt
  when the test wants an environment without it. The venv's site-packages is a real site directory, so ``site``
  processes the ``.pth`` files in it -- the shared ones through their links, and ours once it is installed --
  exactly as in a container. (``PYTHONPATH`` or ``--target`` would not: ``site`` runs ``.pth`` files only in site
  directories.)
* ``pip install``: the wheel built from a copy of the working tree by ``uv build`` (PEP 517 build isolation: the build
  backend, hatchling, comes from uv's cache -- offline -- or else from the package index), installed by
  ``uv pip install --no-deps`` into the overlay only. ``--no-deps`` also guarantees that the installer never touches
  the linked (shared) packages.

Everything the helpers start is bounded by a timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_minicpm_hotfix"
WRAPT_ENTRIES = ("wrapt", "wrapt-stubs")
_COPY_IGNORE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.pyc", "build", "dist", "*.egg-info", ".pytest_cache", ".whl", ".gl"
)


def site_packages(python: str | os.PathLike = sys.executable) -> Path:
    """The purelib site-packages of ``python``'s environment."""
    if Path(python) == Path(sys.executable):
        return Path(sysconfig.get_paths()["purelib"])
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return Path(out.stdout.strip())


def overlay_env(dest: Path, *, wrapt: bool = True, over: str | os.PathLike = sys.executable) -> Path:
    """A throwaway venv over the running environment, or over the environment of the interpreter ``over`` (see the
    module docstring); returns its ``python``."""
    base = site_packages(over)
    if any(p.name.startswith((PACKAGE, "vllm-minicpm-hotfix", "vllm_minicpm_hotfix", "_vllm_minicpm_hotfix"))
           for p in base.iterdir()):
        raise RuntimeError(f"{base} has vllm-minicpm-hotfix installed; the shared test environment must not")
    subprocess.run([str(over), "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    site = site_packages(python)
    for entry in base.iterdir():
        if entry.name == "__pycache__":
            continue
        if not wrapt and (entry.name in WRAPT_ENTRIES or entry.name.startswith("wrapt-")):
            continue
        link = site / entry.name
        if not link.exists():
            link.symlink_to(entry)
    return python


def source_copy(dest: Path) -> Path:
    """A copy of the working tree (no .git, caches or build output), so builds never write into the repository."""
    shutil.copytree(REPO, dest, ignore=_COPY_IGNORE)
    return dest


def build_wheel(dest: Path) -> Path:
    """Build the package's wheel from a copy of the working tree with ``uv build --wheel`` (PEP 517, build isolation:
    hatchling from uv's cache, else from the package index); returns the ``.whl``."""
    src = source_copy(dest / "src")
    out = dest / "dist"
    out.mkdir()
    run_uv("build", "--wheel", "--python", sys.executable, "--out-dir", str(out), str(src))
    wheels = list(out.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"uv build wrote {wheels} into {out}, expected one wheel")
    return wheels[0]


def uv() -> str:
    found = shutil.which("uv")
    if found is None:
        raise RuntimeError("uv is needed to install into the throwaway environments (scripts/cpu-env installs it)")
    return found


def run_uv(*args: str, timeout: float = 300) -> None:
    """``uv ARGS``, offline first (uv's cache holds the build backend after the first build), then with the package
    index if that fails."""
    errors = []
    for mode in (["--offline"], []):
        proc = subprocess.run([uv(), *args, *mode], capture_output=True, check=False, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": ""})
        if proc.returncode == 0:
            return
        errors.append(f"uv {' '.join(args + tuple(mode))}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    raise RuntimeError("\n".join(errors))


def pip_install(python: Path, *args: str) -> None:
    """``uv pip install --no-deps ARGS`` into ``python``'s environment (an overlay, never the shared one). An editable
    install (``-e DIR``) builds with build isolation, like a wheel."""
    if site_packages(python) == site_packages():
        raise RuntimeError("refusing to install into the shared test environment")
    run_uv("pip", "install", "--no-deps", "--python", str(python), *args)


def make_bundle(dest: Path, python: str | os.PathLike = sys.executable) -> Path:
    """``vllm-minicpm-hotfix bundle DEST`` run from the working tree by ``python``; returns ``DEST``."""
    proc = subprocess.run(
        [str(python), "-m", "vllm_minicpm_hotfix", "bundle", str(dest)],
        cwd=REPO, capture_output=True, check=False, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bundle failed:\n{proc.stdout}\n{proc.stderr}")
    return dest


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without anything that activates or configures the hotfix, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VLLM_MINICPM_HOTFIX", "VLLM_MINICPM_HOTFIX_DISABLED_FIXES", "VLLM_PLUGINS")}
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # tests/conftest.py sets it too; scripts/gpu-smoke.sh sets cuda
    env.update(extra)
    return env
