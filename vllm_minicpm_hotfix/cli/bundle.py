"""``vllm-minicpm-hotfix bundle DIR``: a self-contained folder to mount into an existing vLLM container and name in
``PYTHONPATH`` -- nothing is installed in the image.

The folder holds::

    DIR/sitecustomize.py                     arms the hotfix at start-up, then runs the image's own sitecustomize
    DIR/_vllm_minicpm_hotfix_arm.py          the small start-up module it imports (the package waits for vLLM)
    DIR/vllm_minicpm_hotfix/                 this package (its .py files as installed here)
    DIR/_vllm_minicpm_hotfix_vendor/wrapt/   a pure-Python copy of wrapt (its .py files and LICENSE, no C extension)
    DIR/vllm-minicpm-hotfix-bundle.json      what made it: package and wrapt versions, the Python it was made with
    DIR/**/__pycache__/                      bytecode for the Python that made it (hash-checked, so copying is fine)

vLLM images do not ship wrapt; the vendored copy is used only when the image has none (it is appended to the *end* of
``sys.path``, and only once vLLM is being imported; see :mod:`vllm_minicpm_hotfix._bootstrap`). The package is pure
Python, so a bundle made on one machine works with any CPython >= 3.10 in the container. Its bytecode serves only
the Python minor version that made it: on a read-only mount with another version every process compiles the two
start-up files (``sitecustomize.py``, ``_vllm_minicpm_hotfix_arm.py``; ~3 ms), so make the bundle with the image's
Python (or run ``python -m compileall -q --invalidation-mode checked-hash DIR`` once with it).

Usage::

    vllm-minicpm-hotfix bundle ./minicpm-hotfix
    docker run ... -v "$PWD/minicpm-hotfix:/opt/vllm-minicpm-hotfix:ro" -e PYTHONPATH=/opt/vllm-minicpm-hotfix \\
        vllm/vllm-openai:v0.28.0 --model openbmb/MiniCPM-V-4.6 ...

Exit codes: 0 written; 1 cannot be written (DIR holds something else, no wrapt to copy, ...); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from .. import __version__
from .._bootstrap import ARM_MODULE, SITECUSTOMIZE_MARKER, VENDOR_DIR

PACKAGE = "vllm_minicpm_hotfix"
MANIFEST = "vllm-minicpm-hotfix-bundle.json"
#: The line that identifies the hotfix's sitecustomize.py (the repository's top-level sitecustomize.py has it).
SITECUSTOMIZE_LINE = f"{SITECUSTOMIZE_MARKER} = True"
#: The top-level sitecustomize.py inside the package (a symbolic link in the repository, a copy in the wheel).
SITECUSTOMIZE_IN_PACKAGE = "_sitecustomize.py.txt"
#: The top-level start-up module's file (next to the package; pyproject.toml ships it).
ARM_FILE = f"{ARM_MODULE}.py"
#: What a bundle consists of; only these are replaced when DIR is an earlier bundle.
ENTRIES = ("sitecustomize.py", ARM_FILE, "__pycache__", PACKAGE, VENDOR_DIR, MANIFEST)
CONTAINER_DIR = "/opt/vllm-minicpm-hotfix"


class BundleError(Exception):
    """The bundle cannot be written; the message says why."""


def package_dir() -> Path:
    """The ``vllm_minicpm_hotfix`` folder this module is in (the one a bundle copies)."""
    return Path(__file__).resolve().parents[1]


def sitecustomize_source() -> Path:
    """The hotfix's ``sitecustomize.py``: the copy a wheel carries inside the package, else the file next to the
    package (a clone of the repository, an editable install, or a bundle made from a bundle)."""
    for candidate in (package_dir() / SITECUSTOMIZE_IN_PACKAGE, package_dir().parent / "sitecustomize.py"):
        try:
            if SITECUSTOMIZE_LINE in candidate.read_text(encoding="utf-8"):
                return candidate
        except OSError:
            continue
    raise BundleError(
        f"cannot find the hotfix's sitecustomize.py (looked for {package_dir() / SITECUSTOMIZE_IN_PACKAGE} and "
        f"{package_dir().parent / 'sitecustomize.py'}); reinstall vllm-minicpm-hotfix"
    )


def arm_module_source() -> Path:
    """The start-up module ``_vllm_minicpm_hotfix_arm.py`` installed next to this package (wheel, editable install,
    clone of the repository, bundle)."""
    candidate = package_dir().parent / ARM_FILE
    if not candidate.is_file():
        raise BundleError(f"cannot find {candidate} next to the package; reinstall vllm-minicpm-hotfix")
    return candidate


def write_bytecode(dest: Path) -> None:
    """Compile the bundle's own ``.py`` files for this interpreter (``compileall``), hash-checked: valid wherever the
    folder is copied or mounted, and never stale (a changed source is recompiled)."""
    import compileall
    import py_compile

    mode = py_compile.PycInvalidationMode.CHECKED_HASH
    ok = all(compileall.compile_file(str(dest / name), quiet=1, invalidation_mode=mode)
             for name in ("sitecustomize.py", ARM_FILE))
    ok = all([ok] + [compileall.compile_dir(str(dest / name), quiet=1, invalidation_mode=mode)
                     for name in (PACKAGE, VENDOR_DIR) if (dest / name).is_dir()])
    if not ok:
        raise BundleError(f"compiling the bundle's Python files in {dest} failed (see the messages above)")


def find_wrapt() -> tuple[Path, str | None, Path | None]:
    """``(package folder, version, LICENSE file or None)`` of the wrapt this interpreter imports."""
    try:
        import wrapt
    except ImportError as exc:
        raise BundleError(
            f"wrapt is not importable here ({exc}), so there is nothing to vendor: `pip install 'wrapt>=2'` first, "
            "or pass --no-wrapt if every image you mount the bundle into has wrapt"
        ) from None
    folder = Path(wrapt.__file__).resolve().parent
    version = getattr(wrapt, "__version__", None)
    license_file = folder / "LICENSE" if (folder / "LICENSE").is_file() else None  # a copy vendored by a bundle
    if license_file is None:
        try:
            from importlib import metadata

            dist = metadata.distribution("wrapt")
            for f in dist.files or []:
                located = Path(dist.locate_file(f)).resolve()
                if f.name.upper().startswith(("LICENSE", "COPYING")) and located.is_file():
                    license_file = located
                    break
        except Exception:  # noqa: BLE001, S110 - no licence found is not fatal; the bundle says which wrapt it is
            pass
    return folder, version, license_file


def copy_wrapt(dest_vendor: Path) -> str | None:
    """Copy wrapt's pure-Python sources (every ``*.py`` of the package, no C extension) and its licence to
    ``dest_vendor/wrapt``. Returns the wrapt version."""
    folder, version, license_file = find_wrapt()
    target = dest_vendor / "wrapt"
    target.mkdir(parents=True)
    sources = sorted(folder.glob("*.py"))
    if not any(p.name == "__init__.py" for p in sources):
        raise BundleError(f"{folder} does not look like the wrapt package (no __init__.py)")
    for src in sources:
        shutil.copyfile(src, target / src.name)
    if license_file is not None and license_file.is_file():
        shutil.copyfile(license_file, target / "LICENSE")
    return version


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".pyo")) or n == SITECUSTOMIZE_IN_PACKAGE}


def prepare_target(dest: Path, force: bool) -> None:
    """Make ``dest`` ready: create it, or clear an earlier bundle there. Anything else in it is left alone, and a
    non-empty folder that is not a bundle is refused unless ``force``."""
    if dest.exists() and not dest.is_dir():
        raise BundleError(f"{dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    present = {p.name for p in dest.iterdir()}
    if present and MANIFEST not in present and not force:
        raise BundleError(f"{dest} is not empty and holds no earlier bundle; choose an empty folder or pass --force")
    theirs = dest / "sitecustomize.py"
    if theirs.is_file() and SITECUSTOMIZE_LINE not in theirs.read_text(encoding="utf-8", errors="replace"):
        raise BundleError(f"{theirs} is not the hotfix's; refusing to replace it")
    for name in ENTRIES:
        path = dest / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def write_bundle(dest: str | os.PathLike, *, wrapt: bool = True, force: bool = False) -> dict:
    """Write the bundle into ``dest`` and return its manifest (also written as ``vllm-minicpm-hotfix-bundle.json``).

    Raises:
        BundleError: ``dest`` holds something else, wrapt is missing (with ``wrapt=True``), or the sitecustomize
            template cannot be found.
    """
    dest = Path(dest).resolve()
    if dest == package_dir().parent or dest.is_relative_to(package_dir()):
        raise BundleError(f"{dest} is where this package lives; choose another folder")
    template = sitecustomize_source()
    arm = arm_module_source()
    if wrapt:
        find_wrapt()  # fail before touching dest
    prepare_target(dest, force)
    shutil.copytree(package_dir(), dest / PACKAGE, ignore=_ignore)
    shutil.copyfile(template, dest / "sitecustomize.py")
    shutil.copyfile(arm, dest / ARM_FILE)
    wrapt_version = copy_wrapt(dest / VENDOR_DIR) if wrapt else None
    write_bytecode(dest)
    manifest = {
        "vllm_minicpm_hotfix": __version__,
        "wrapt": wrapt_version,
        "made_with_python": sys.version.split()[0],
        "written_to": str(dest),
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-minicpm-hotfix bundle",
        description="Write a self-contained folder (sitecustomize.py, this package, a pure-Python wrapt) to mount "
        "into an existing vLLM container and name in PYTHONPATH.",
    )
    parser.add_argument("dir", help="folder to write (created; an earlier bundle there is replaced)")
    parser.add_argument("--no-wrapt", action="store_true", help="do not vendor wrapt (every target image has it)")
    parser.add_argument("--force", action="store_true", help="write into a non-empty folder that is not a bundle")
    args = parser.parse_args(argv)
    try:
        manifest = write_bundle(args.dir, wrapt=not args.no_wrapt, force=args.force)
    except (BundleError, OSError) as exc:
        print(f"vllm-minicpm-hotfix bundle: {exc}", file=sys.stderr)
        return 1
    dest = manifest["written_to"]
    wrapt_note = f"wrapt {manifest['wrapt']} (pure Python, used only where the image has none)" if (
        args.no_wrapt is False
    ) else "no wrapt (the image must have wrapt>=2)"
    print(f"wrote {dest}: vllm-minicpm-hotfix {manifest['vllm_minicpm_hotfix']}, {wrapt_note}")
    print("mount it and name it in PYTHONPATH, for example:")
    print(f"  docker run ... -v {dest}:{CONTAINER_DIR}:ro -e PYTHONPATH={CONTAINER_DIR} IMAGE ...")
    print(f"  (or here: PYTHONPATH={dest}${{PYTHONPATH:+:$PYTHONPATH}} vllm serve ...)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
