"""The CLI (``vllm_minicpm_hotfix.cli.main``) run from the package in the folder given as the first argument, with
the CLI's arguments after it (tests/cli/test_cli.py).

The folder is put on ``sys.path`` here, so no activation path sees the package. Run as a file, ``sys.path[0]`` is
this file's folder; ``doctor`` would see it, so it is first set back to what ``python -c`` puts there (``''``, the
working directory; nothing under ``-P``), then the folder goes in front of it -- before anything of the package is
imported."""

import sys

if not getattr(sys.flags, "safe_path", False):
    sys.path[0] = ""
sys.path.insert(0, sys.argv[1])

from vllm_minicpm_hotfix.cli import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
