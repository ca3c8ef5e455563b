"""How the CLI prints: tables sized for the terminal (80 columns off one), safe cells, sizes, JSON."""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpusnap.daemon.api import sizes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from gpusnap.daemon.client.values import Operation, Snapshot


TABLE_WIDTH = 80
"""Width of tables when the output is not a terminal (pipes, files, CI logs); $COLUMNS overrides it."""


WIDE = 120
"""Narrower than this (e.g. 80 columns off a terminal), tables take their narrow layout: ``ls`` leaves out
SOURCE and GPUS (``inspect`` and ``-o json`` keep them), ``ops`` puts each target under its operation,
``store`` lists the tiers' paths apart, ``node`` gives each GPU one folded row."""


def wide() -> bool:
    """Whether stdout has ``WIDE`` columns or more."""
    return console().width >= WIDE


@functools.cache
def console(stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS") or TABLE_WIDTH)
    return Console(stderr=stderr, width=width)


def print_table(table: Table) -> None:
    for column in table.columns:  # narrow output wraps values onto more lines, never cuts them with "…"
        column.overflow = "fold"
    console().print(table)


def safe(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1, bidi overrides...) written as escapes.

    Names, labels, command lines and messages come from the daemon and, through it, from other users'
    processes: an inspecting root's terminal must not run their escape sequences.
    """
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in text)


def add_row(table: Table, *cells: str | tuple[str, ...]) -> None:
    """Add a row of plain-text cells: no rich markup is read from them (``[bold]``, ``[link=...]``); a tuple
    is a cell of several lines (a newline inside a string is shown as ``\\n``, as any control character)."""
    from rich.text import Text

    table.add_row(*(Text("\n".join(safe(line) for line in ((c,) if isinstance(c, str) else c))) for c in cells))


def new_table(*headers: str, **kw: Any) -> Table:
    from rich.table import Table

    return Table(*headers, box=None, **kw)


human_size = sizes.human_size  # the daemon's messages say sizes the same way


def terminal_lines(snap: Snapshot) -> list[str]:
    """What ``dump`` and ``inspect`` say of the terminals a shell's job was started from (left behind)."""
    out = []
    for t in snap.terminals:
        held = f"fds {', '.join(t.fds)} (PID/fd)" if t.fds else ""
        what = ", ".join(filter(None, ["controlling terminal" if t.controlling else "", held]))
        then = (
            "a restore gives them /dev/null, or `--terminal FILE`, in a session of its own"
            if t.fds
            else "a restore runs the tree in a session of its own, without one"
        )
        out.append(safe(f"terminal {t.path} ({what}) left behind: {then}"))
    return out


def count(n: int, noun: str, plural: str = "") -> str:
    """``1 snapshot``, ``2 snapshots`` (``plural`` where adding an s is wrong: ``processes``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def moved(done: int, total: int, rate: float = 0.0) -> str:
    """The bytes column of the phase display: ``1.2 GiB``, ``1.2 GiB of 4.0 GiB``, then ``at 410.3 MiB/s`` while
    the phase runs; empty for phases that move no bytes (no "1/1 bytes")."""
    if not total or done == total:
        text = human_size(done) if done else ""
    else:
        text = f"{human_size(done)} of {human_size(total)}"
    return f"{text} at {human_size(int(rate))}/s" if text and rate > 0 else text


def phase_summary(op: Operation) -> str:
    return ", ".join(f"{p.phase} {p.duration_seconds:.2f}s" for p in op.phases)


T = TypeVar("T")


def emit(doc: Any, omit: frozenset[str] = frozenset()) -> None:
    """Print ``-o json``: every command's JSON goes through here (``gpusnap.daemon.cli.render``)."""
    from gpusnap.daemon.cli.render import render

    click.echo(render(doc, omit))


def outcome(result: T | None, op: Operation) -> T:
    """The result of a succeeded operation (``op.snapshot``, ``op.restore``…), which the daemon always sets.

    Raises:
        InternalError: it is not set (a daemon out of step with this client).
    """
    if result is None:
        from gpusnap.daemon.api.errors import InternalError

        raise InternalError(f"operation {op.id} succeeded without its result; is gpusnapd a different version?")
    return result
