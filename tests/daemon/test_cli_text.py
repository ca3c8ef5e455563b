"""What the CLI prints of other users' strings (names, labels, command lines) reaches a terminal as text."""

from __future__ import annotations

import io
import re

import click
from rich.console import Console

from gpusnap.daemon import cli
from gpusnap.daemon.cli import output

HOSTILE = "[/]\x1b[31mred\x1b]0;title\x07 [link=http://x]y[/link] \x9b31m \u202eevil"


def test_table_cells_are_neither_markup_nor_escape_sequences() -> None:
    table = output.new_table(show_header=False)
    output.add_row(table, "command", HOSTILE)  # a crash here: rich read "[/]" as a closing tag
    out = io.StringIO()
    Console(file=out, force_terminal=True, width=200).print(table)
    text = out.getvalue()
    assert "\x1b]" not in text, "no OSC (window title, OSC 8 hyperlink) from the cell"
    assert "\x07" not in text and "\x9b" not in text and "\u202e" not in text
    assert "[link=http://x]y[/link]" in text and "[/]" in text, "markup shown literally"
    assert "\\x1b[31mred\\x1b]0;title\\x07" in text and "\\x9b31m" in text and "\\u202eevil" in text


def test_safe_keeps_printable_text() -> None:
    assert output.safe("python3 -c 'x = [1, 2]' é 日本") == "python3 -c 'x = [1, 2]' é 日本"


def test_every_exit_code_is_in_the_help_and_the_readme() -> None:
    """``gpusnap --help`` and the README's table name every exit code the CLI uses (130: cancelled too)."""
    from click.testing import CliRunner

    from tests.conftest import REPO

    helptext = " ".join(CliRunner().invoke(cli.main, ["--help"]).output.split())
    readme = (REPO / "README.md").read_text()
    for code in {1, *cli.EXIT_CODES.values()}:
        assert re.search(rf"\b{code} [a-z]", helptext), f"exit code {code} is not in gpusnap --help:\n{helptext}"
        assert re.search(rf"^\| {code} \|", readme, re.M), f"exit code {code} is not in the README's table"


def _commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
    """Every command of ``group`` by its full name (``park set``), subcommands after their group."""
    out: list[tuple[str, click.Command]] = []
    for name, command in sorted(group.commands.items()):
        out.append((prefix + name, command))
        if isinstance(command, click.Group):
            out.extend(_commands(command, f"{prefix}{name} "))
    return out


def test_the_readme_cli_table_names_every_command_and_option() -> None:
    """The README's CLI table and `gpusnap --help` agree: every command a row of the table, with every option its
    --help lists (bar the -o/--socket every command takes)."""
    from tests.conftest import REPO

    section = (REPO / "README.md").read_text().split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    for name, command in _commands(cli.main):
        cells = " ".join(cell for cell in rows if re.search(rf"`{re.escape(name)}( |`)", cell))
        assert cells, f"`gpusnap {name}` has no row in the README's CLI table"
        options = [o for p in command.params if isinstance(p, click.Option) for o in p.opts if o.startswith("--")]
        missing = [o for o in options if o not in ("--output", "--socket", "--help") and o not in cells]
        assert not missing, f"the README's row of `gpusnap {name}` leaves out {missing}"
