"""What the CLI prints of other users' strings (names, labels, command lines) reaches a terminal as text."""

from __future__ import annotations

import io
import re

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
