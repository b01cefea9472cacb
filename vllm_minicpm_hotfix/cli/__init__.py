"""Command line: ``vllm-minicpm-hotfix COMMAND`` (also ``python -m vllm_minicpm_hotfix``).

Each command lives in its own module and is imported only when run, so ``--help`` stays instant:

* ``bundle DIR``  -- write a self-contained folder for PYTHONPATH injection into an existing container
  (:mod:`.bundle`)
* ``doctor``      -- will the fix be active inside vLLM's processes here? (:mod:`.doctor`)
* ``verify``      -- does this checkpoint load bit-exact through this vLLM? (:mod:`.verify`)
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "bundle": ("vllm_minicpm_hotfix.cli.bundle", "write a self-contained folder to mount and name in PYTHONPATH"),
    "doctor": ("vllm_minicpm_hotfix.cli.doctor", "check that the hotfix will be active in vLLM's processes here"),
    "verify": ("vllm_minicpm_hotfix.cli.verify",
               "load a checkpoint through this vLLM and compare vit_merger bit for bit"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-minicpm-hotfix", description=__doc__.split("\n\n")[0])
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"vllm-minicpm-hotfix {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(module_name=module_name)
    args, rest = parser.parse_known_args(argv)
    module = importlib.import_module(args.module_name)
    # Each command module defines main(argv) -> exit code and parses its own options (so its --help is its own).
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
