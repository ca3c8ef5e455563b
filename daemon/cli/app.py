"""The ``gpusnap`` group, its options, exit codes and entry point; commands live beside it, one module per
area."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpusnap.daemon import version
from gpusnap.daemon.api.errors import Code, GpusnapError
from gpusnap.daemon.cli.output import console, safe
from gpusnap.daemon.defaults import DEFAULT_SOCKET

if TYPE_CHECKING:
    from gpusnap.daemon.client import DaemonClient


EXIT_CODES: dict[Code, int] = {
    Code.INVALID_ARGUMENT: 2,
    Code.OUT_OF_RANGE: 2,
    Code.NOT_FOUND: 3,
    Code.FAILED_PRECONDITION: 4,
    Code.DATA_LOSS: 4,
    Code.ABORTED: 5,
    Code.ALREADY_EXISTS: 5,
    Code.PERMISSION_DENIED: 6,
    Code.UNAUTHENTICATED: 6,
    Code.UNAVAILABLE: 7,
    Code.DEADLINE_EXCEEDED: 8,
    Code.RESOURCE_EXHAUSTED: 9,
    Code.CANCELLED: 130,
}

T = TypeVar("T")
PID = click.IntRange(-(2**31), 2**31 - 1)
"""What fits the API's int32; the daemon says which PIDs are valid."""


class _Seconds(click.ParamType[float]):
    """Positive, finite seconds (at most 10^7)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not 0 < seconds <= 10**7:  # also false for nan
            self.fail(f"{value!r} is not a positive number of seconds up to 10^7", param, ctx)
        return seconds


SECONDS = _Seconds()


class Ctx:
    def __init__(self, socket: str, output: str):
        self.socket = socket
        self.output = output

    def client(self) -> DaemonClient:
        from gpusnap.daemon.client import DaemonClient

        return DaemonClient(self.socket)

    @property
    def live(self) -> bool:
        """Show live phases: table output to a terminal."""
        return self.output == "table" and console(stderr=True).is_terminal


def version_option(prog_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--version``, printing :func:`gpusnap.daemon.version` (read only when asked for)."""

    def show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(f"{prog_name}, version {version()}")
            ctx.exit()

    return click.option(
        "--version", is_flag=True, expose_value=False, is_eager=True, callback=show, help="Show the version and exit."
    )


def command_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``-o/--output`` and ``--socket`` accepted after the subcommand too (``gpusnap ls -o json``,
    ``gpusnap ls --socket PATH``)."""

    def set_output(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:
            ctx.find_object(Ctx).output = value  # type: ignore[union-attr]  # set by main()

    def set_socket(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:
            ctx.find_object(Ctx).socket = value  # type: ignore[union-attr]  # set by main()

    fn = click.option(
        "--socket",
        "socket_override",
        default=None,
        metavar="PATH",
        expose_value=False,
        callback=set_socket,
        help="gpusnapd socket (as before the command)",
    )(fn)
    return click.option(
        "-o",
        "--output",
        "output_override",
        type=click.Choice(["table", "json"]),
        default=None,
        expose_value=False,
        callback=set_output,
        help="table or json (as before the command)",
    )(fn)


def fail(err: GpusnapError) -> None:
    click.echo(f"gpusnap: error: {safe(err.message)}", err=True)
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(Ctx) if ctx else None
    if obj is not None and obj.output == "json":  # scripts get the reason too
        from gpusnap.daemon.cli.documents import Failed
        from gpusnap.daemon.cli.output import emit

        emit(Failed(error=err))
    sys.exit(EXIT_CODES.get(err.code, 1))


def checked(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except GpusnapError as err:
        fail(err)
        raise AssertionError("unreachable") from err


def parse_pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, val = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        out[key] = val
    return out


def parse_labels(values: tuple[str, ...]) -> dict[str, str]:
    return parse_pairs(values, "--label")


@click.group(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Exit codes: 0 ok, 1 internal, 2 usage/invalid argument, 3 not found, 4 failed precondition or "
    "damaged snapshot, 5 conflict (busy tree, name taken), 6 permission denied, 7 daemon unavailable, "
    "8 deadline exceeded, 9 resources exhausted, 130 cancelled (Ctrl-C, rolled back).",
)
@click.option(
    "--socket",
    envvar="GPUSNAP_SOCKET",
    show_envvar=True,
    default=str(DEFAULT_SOCKET),
    show_default=True,
    help="gpusnapd socket",
)
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table", show_default=True)
@version_option("gpusnap")
@click.pass_context
def main(ctx: click.Context, socket: str, output: str) -> None:
    """Checkpoint and restore GPU inference workers through gpusnapd."""
    ctx.obj = Ctx(socket, output)


def _check_utf8(args: list[str]) -> None:
    """Exit with a usage error (2) for an argument that is not UTF-8: every string on the wire is.

    Python hands such bytes over as lone surrogates (PEP 383), which protobuf refuses with a traceback.
    """
    for i, arg in enumerate(args, 1):
        try:
            arg.encode()
        except UnicodeEncodeError:
            shown = arg.encode(errors="surrogateescape").decode("ascii", errors="backslashreplace")
            click.echo(
                f"gpusnap: error: argument {i} ({safe(shown[:100])}) is not valid UTF-8; pass UTF-8 text", err=True
            )
            sys.exit(EXIT_CODES[Code.INVALID_ARGUMENT])


def run() -> None:
    """The ``gpusnap`` command: :func:`main`, then the process ends without the interpreter's teardown.

    Finalizing the modules gRPC loads takes 0.2–0.3 s on a loaded 2-core host, longer than the call
    itself (``make bench-overhead``); by then the channel is closed and the output flushed, so there is
    nothing left to clean up.
    """
    try:
        _check_utf8(sys.argv[1:])
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            click.echo(exc.code, err=True)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
