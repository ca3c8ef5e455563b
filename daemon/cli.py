"""gpusnap: the command-line client of gpusnapd.

Exit codes (also in ``gpusnap --help`` and the README):

    0 success                       5 conflict (ABORTED, ALREADY_EXISTS: busy tree, name taken)
    1 internal or unknown error     6 permission denied
    2 usage or invalid argument     7 daemon unavailable
    3 not found                     8 deadline exceeded
    4 failed precondition or damaged snapshot (FAILED_PRECONDITION, DATA_LOSS)
    9 resources exhausted (RESOURCE_EXHAUSTED)
  130 cancelled (CANCELLED: Ctrl-C, the operation rolled back)
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC
from typing import TYPE_CHECKING, Any, TypeVar

import click

from gpusnap.daemon import version
from gpusnap.daemon.api.errors import Code, GpusnapError
from gpusnap.daemon.defaults import DEFAULT_SOCKET

# gRPC, protobuf and rich are imported where they are used, not here: every call pays for what it
# imports at start-up, and `gpusnap --help` or a usage error needs none of them (docs/performance.md).
if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from gpusnap.daemon._proto import operations_pb2
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


TABLE_WIDTH = 80
"""Width of tables when the output is not a terminal (pipes, files, CI logs); $COLUMNS overrides it."""


LS_WIDE = 120
"""Narrower than this, ``ls`` leaves out SOURCE and GPUS (``inspect`` and ``-o json`` keep them) so NAME has room."""


@functools.cache
def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS") or TABLE_WIDTH)
    return Console(stderr=stderr, width=width)


def _print_table(table: Table) -> None:
    for column in table.columns:  # narrow output wraps values onto more lines, never cuts them with "…"
        column.overflow = "fold"
    _console().print(table)


def _safe(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1, bidi overrides...) written as escapes.

    Names, labels, command lines and messages come from the daemon and, through it, from other users'
    processes: an inspecting root's terminal must not run their escape sequences.
    """
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in text)


def _row(table: Table, *cells: str) -> None:
    """Add a row of plain-text cells: no rich markup is read from them (``[bold]``, ``[link=...]``)."""
    from rich.text import Text

    table.add_row(*(Text(_safe(c)) for c in cells))


def _table(*headers: str, **kw: Any) -> Table:
    from rich.table import Table

    return Table(*headers, box=None, **kw)


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
        return self.output == "table" and _console(stderr=True).is_terminal


def version_option(prog_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--version``, printing :func:`gpusnap.daemon.version` (read only when asked for)."""

    def show(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(f"{prog_name}, version {version()}")
            ctx.exit()

    return click.option(
        "--version", is_flag=True, expose_value=False, is_eager=True, callback=show, help="Show the version and exit."
    )


def output_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``-o/--output`` accepted after the subcommand too (``gpusnap ls -o json``)."""

    def set_output(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:
            ctx.find_object(Ctx).output = value  # type: ignore[union-attr]  # set by main()

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


def _fail(err: GpusnapError) -> None:
    click.echo(f"gpusnap: error: {_safe(err.message)}", err=True)
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_object(Ctx) if ctx else None
    if obj is not None and obj.output == "json":  # scripts get the reason too
        from gpusnap.daemon import jsonout

        click.echo(json.dumps({"error": jsonout.error(err)}, indent=2))
    sys.exit(EXIT_CODES.get(err.code, 1))


def _run(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except GpusnapError as err:
        _fail(err)
        raise AssertionError("unreachable") from err


def _json(msg: Any, omit: frozenset[str] = frozenset()) -> str:
    """``-o json`` of a message or a list of them (daemon/jsonout.py, docs/schemas/v1/cli.schema.json)."""
    from gpusnap.daemon import jsonout

    if isinstance(msg, list):
        return json.dumps([jsonout.message(m, omit) for m in msg], indent=2)
    return json.dumps(jsonout.message(msg, omit), indent=2)


LS_OMIT = frozenset({"host.cpu_flags"})
"""About 100 flags per snapshot; `inspect` shows them."""


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)


def _pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, val = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=option)
        out[key] = val
    return out


def _labels(values: tuple[str, ...]) -> dict[str, str]:
    return _pairs(values, "--label")


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


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[operations_pb2.OperationEvent], None]]:
    """A live phase display on a terminal; a no-op elsewhere."""
    if not enabled:
        yield lambda event: None
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from gpusnap.daemon._proto import operations_pb2

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.fields[moved]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=_console(stderr=True), transient=False) as progress:
        tasks: dict[str, Any] = {}

        def show(event: operations_pb2.OperationEvent) -> None:
            E = operations_pb2.OperationEvent
            if event.type == E.TYPE_PHASE_STARTED:
                tasks[event.phase] = progress.add_task(event.phase, total=None, moved="")
            elif event.type == E.TYPE_PROGRESS and event.phase in tasks:
                progress.update(
                    tasks[event.phase],
                    completed=event.bytes,
                    total=event.total_bytes or None,
                    moved=moved(event.bytes, event.total_bytes),
                )
            elif event.type in (E.TYPE_PHASE_FINISHED, E.TYPE_PHASE_FAILED) and event.phase in tasks:
                mark = "" if event.type == E.TYPE_PHASE_FINISHED else " [red]failed[/red]"
                progress.update(
                    tasks[event.phase],
                    description=event.phase + mark,
                    completed=1,
                    total=1,
                    moved=moved(event.bytes, event.bytes),
                )
            elif event.type == E.TYPE_ROLLBACK:
                from rich.markup import escape

                progress.console.print(f"[yellow]rollback[/yellow] {escape(_safe(f'{event.phase}: {event.message}'))}")

        yield show


def moved(done: int, total: int) -> str:
    """The bytes column of the phase display: empty for phases that move no bytes (no "1/1 bytes")."""
    if not total:
        return _size(done) if done else ""
    return _size(done) if done == total else f"{_size(done)}/{_size(total)}"


class _HeldInterrupt:
    """Ctrl-C while an operation is being started is noted, not raised: its id is not known yet, so it could
    be neither cancelled nor followed. :func:`_follow` cancels it once the id is there."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None
        # Only where Ctrl-C raises: a shell starts a background job with SIGINT ignored, and it stays so.
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is (
            signal.default_int_handler
        ):
            self._previous = signal.signal(signal.SIGINT, self._note)

    def _note(self, _signum: int, _frame: object) -> None:
        self.pending = True

    def release(self) -> None:
        """Ctrl-C raises KeyboardInterrupt again (idempotent)."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _start(fn: Callable[[], operations_pb2.Operation]) -> tuple[operations_pb2.Operation, _HeldInterrupt]:
    """Start an operation with Ctrl-C held until :func:`_follow` (or the caller) releases it."""
    held = _HeldInterrupt()
    try:
        return _run(fn), held
    except BaseException:
        held.release()
        raise


def _follow(
    client: DaemonClient, op: operations_pb2.Operation, show_progress: bool, held: _HeldInterrupt | None = None
) -> operations_pb2.Operation:
    from gpusnap.daemon._proto import operations_pb2
    from gpusnap.daemon.client import raise_if_failed

    try:
        if held is not None:
            held.release()
            if held.pending:
                raise KeyboardInterrupt
        with _progress(show_progress) as show:
            for event in client.watch(op.id):
                show(event)
                if event.type == operations_pb2.OperationEvent.TYPE_OPERATION_FINISHED:
                    raise_if_failed(event.operation)
                    return event.operation
        return client.wait(op.id)
    except KeyboardInterrupt:
        return _cancel(client, op)


def _cancel(client: DaemonClient, op: operations_pb2.Operation) -> operations_pb2.Operation:
    """Ctrl-C: cancel the operation and wait for its rollback; a second Ctrl-C leaves it to gpusnapd."""
    try:
        client.cancel(op.id)
        click.echo(
            f"gpusnap: interrupted; cancelling {op.id} and rolling back (Ctrl-C again to stop waiting)", err=True
        )
        return client.wait(op.id)  # raises CancelledError once rolled back (exit 130)
    except KeyboardInterrupt:
        click.echo(f"gpusnap: operation {op.id} goes on in gpusnapd: follow it with `gpusnap wait {op.id}`", err=True)
        sys.exit(130)


def _run_operation(obj: Ctx, start: Callable[[DaemonClient], operations_pb2.Operation]) -> operations_pb2.Operation:
    """Start an operation and follow it to its end (live phases on a terminal); exits on failure."""
    with obj.client() as client:
        op, sigint = _start(lambda: start(client))
        return _run(lambda: _follow(client, op, obj.live, sigint))


def _phase_summary(op: operations_pb2.Operation) -> str:
    return ", ".join(f"{p.phase} {p.duration_seconds:.2f}s" for p in op.phases)


@main.command()
@output_option
@click.argument("pid", type=PID)
@click.option("--name", default="", help="snapshot name, unique among your snapshots")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="label (repeatable)")
@click.option("--leave-running", is_flag=True, help="keep the source running after the dump")
@click.option(
    "--tcp",
    type=click.Choice(["refuse", "established", "close"]),
    default="refuse",
    show_default=True,
    help="established TCP connections: refuse the dump, capture them, or restore them closed",
)
@click.option("--timeout", type=SECONDS, help="seconds for the whole checkpoint [daemon default]")
@click.option("--gpu-lock-timeout", type=SECONDS, help="seconds to wait for CUDA work to drain [daemon default]")
@click.option(
    "--control-dir",
    default="",
    metavar="DIR",
    help="worker follows Dynamo Snapshot's control-directory contract: wait for DIR/ready-for-snapshot",
)
@click.option("--no-quiesce", is_flag=True, help="capture as is, without the worker agent's warm-up and quiesce")
@click.option(
    "--no-offload",
    is_flag=True,
    help="keep the buffers the worker's agent names (weights) in the images, not in the buffer store",
)
@click.option(
    "--push",
    "push_after",
    is_flag=True,
    help="once the snapshot is durable, push it to the remote store in the background (follow it with "
    "`gpusnap wait OP`)",
)
@click.option("--detach", is_flag=True, help="print the operation id and return at once")
@click.pass_obj
def dump(
    obj: Ctx,
    pid: int,
    name: str,
    labels: tuple[str, ...],
    leave_running: bool,
    tcp: str,
    timeout: float | None,
    gpu_lock_timeout: float | None,
    control_dir: str,
    no_quiesce: bool,
    no_offload: bool,
    push_after: bool,
    detach: bool,
) -> None:
    """Checkpoint the process tree rooted at PID into a new snapshot; prints its id.

    With a gpusnap worker agent attached, the worker is warmed up and quiesced first, and the buffers
    its adapter names (weights) go to the buffer store, once per content, instead of the images.
    """
    with obj.client() as client:
        op, sigint = _start(
            lambda: client.checkpoint(
                pid,
                name=name,
                labels=_labels(labels),
                leave_running=leave_running,
                tcp=tcp,
                timeout_s=timeout,
                gpu_lock_timeout_s=gpu_lock_timeout,
                control_dir=control_dir,
                quiesce=not no_quiesce,
                offload=not no_offload,
            )
        )
        if detach:
            sigint.release()
            if push_after:
                raise click.UsageError(
                    "--push needs the dump to finish first; drop --detach, or push later with `gpusnap push`"
                )
            click.echo(json.dumps({"operation": op.id}) if obj.output == "json" else op.id)
            return
        done = _run(lambda: _follow(client, op, obj.live, sigint))
        snap = done.snapshot
        pushing = _run(lambda: client.push(snap.id)).id if push_after else ""
    if obj.output == "json":
        click.echo(
            json.dumps(
                {
                    "id": snap.id,
                    "name": snap.name,
                    "operation": done.id,
                    "size_bytes": snap.size_bytes,
                    "buffer_bytes": snap.buffer_bytes,
                    "phases": {p.phase: p.duration_seconds for p in done.phases},
                    **({"push_operation": pushing} if pushing else {}),
                },
                indent=2,
            )
        )
    else:
        click.echo(snap.id)
        held = f" + {_size(snap.buffer_bytes)} of buffers" if snap.buffer_bytes else ""
        _console(stderr=True).print(
            f"snapshot {snap.id} ({_size(snap.size_bytes)}{held}): {_phase_summary(done)}", highlight=False
        )
        if pushing:
            _console(stderr=True).print(
                f"pushing in the background as {pushing}; follow it with `gpusnap wait {pushing}`", highlight=False
            )


def _gpu_map(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, value.split(",")):
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise click.BadParameter(f"{item!r} is not OLD=NEW (GPU UUIDs or indexes)", param_hint="--gpu-map")
        out[old.strip()] = new.strip()
    return out


GPU_MAP_HELP = "move GPU state: OLD=NEW[,OLD=NEW…] (UUIDs or indexes); every checkpointed GPU must be named"


@main.command()
@output_option
@click.argument("snapshot")
@click.option("--host-pidns", is_flag=True, help="restore with the original PIDs in gpusnapd's PID namespace")
@click.option(
    "--private-net",
    is_flag=True,
    help="restore into a fresh network namespace (loopback only), so copies never clash on ports",
)
@click.option("--gpu-map", default="", metavar="OLD=NEW,…", help=GPU_MAP_HELP)
@click.option("--timeout", type=SECONDS, help="seconds for the whole restore [daemon default]")
@click.option(
    "--env", "env", multiple=True, metavar="NAME=VALUE", help="restore context: set in the worker (repeatable)"
)
@click.option("--unset-env", multiple=True, metavar="NAME", help="restore context: remove from the worker (repeatable)")
@click.option(
    "--set",
    "values",
    multiple=True,
    metavar="KEY=VALUE",
    help="restore context: identity value for the worker's adapter",
)
@click.option(
    "--verify-buffers",
    is_flag=True,
    help="re-digest the snapshot's buffers (weights) first; by default only their sizes are checked",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="restore N copies, each in its own network namespace; {i} in --env/--set values is the copy's index",
)
@click.option("--detach", is_flag=True, help="print the operation id and return at once")
@click.pass_obj
def restore(
    obj: Ctx,
    snapshot: str,
    host_pidns: bool,
    private_net: bool,
    gpu_map: str,
    timeout: float | None,
    env: tuple[str, ...],
    unset_env: tuple[str, ...],
    values: tuple[str, ...],
    verify_buffers: bool,
    replicas: int,
    detach: bool,
) -> None:
    """Restore SNAPSHOT (id or name) as a new process tree; prints the restored root's PID (one per line
    with --replicas).

    Without --gpu-map, GPU state returns to the original GPUs, or to free GPUs of the same model when
    those are busy or absent.
    """
    mapping = _gpu_map(gpu_map)
    with obj.client() as client:
        op, sigint = _start(
            lambda: client.restore(
                snapshot,
                host_pid_namespace=host_pidns,
                gpu_map=mapping,
                timeout_s=timeout,
                env=_pairs(env, "--env"),
                unset_env=unset_env,
                values=_pairs(values, "--set"),
                private_network=private_net,
                verify_buffers=verify_buffers,
                replicas=replicas,
            )
        )
        if detach:
            sigint.release()
            click.echo(json.dumps({"operation": op.id}) if obj.output == "json" else op.id)
            return
        done = _run(lambda: _follow(client, op, obj.live, sigint))
    res = done.restore
    copies = [
        {"index": r.index, "pid": r.pid, "pids": list(r.pids), "namespace_pid": r.namespace_pid} for r in res.replicas
    ] or [{"index": 0, "pid": res.pid, "pids": list(res.pids), "namespace_pid": res.namespace_pid}]
    if obj.output == "json":
        click.echo(
            json.dumps(
                {
                    "pid": res.pid,
                    "pids": list(res.pids),
                    "namespace_pid": res.namespace_pid,
                    "snapshot_id": res.snapshot_id,
                    "operation": done.id,
                    "replicas": copies,
                    "phases": {p.phase: p.duration_seconds for p in done.phases},
                },
                indent=2,
            )
        )
    else:
        click.echo("\n".join(str(c["pid"]) for c in copies))
        pids = ", ".join(str(c["pid"]) for c in copies)
        _console(stderr=True).print(
            f"restored {res.snapshot_id} as PID {pids}: {_phase_summary(done)}", highlight=False
        )


@main.command()
@output_option
@click.argument("pid", type=PID)
@click.option("--gpu-lock-timeout", type=SECONDS, help="seconds to wait for CUDA work to drain [daemon default]")
@click.pass_obj
def suspend(obj: Ctx, pid: int, gpu_lock_timeout: float | None) -> None:
    """Checkpoint the GPU state of the tree rooted at PID in place: GPU memory is freed, the processes live on."""
    done = _run_operation(obj, lambda client: client.suspend(pid, gpu_lock_timeout_s=gpu_lock_timeout))
    if obj.output == "json":
        click.echo(_json(done))
    else:
        freed = sum(g.gpu_memory_bytes for g in done.suspend.gpu_processes)
        click.echo(
            f"suspended {len(done.suspend.gpu_processes)} CUDA process(es), {_size(freed)} of GPU memory freed: "
            f"{_phase_summary(done)}"
        )


@main.command()
@output_option
@click.argument("pid", type=PID)
@click.option("--gpu-map", default="", metavar="OLD=NEW,…", help=GPU_MAP_HELP)
@click.pass_obj
def resume(obj: Ctx, pid: int, gpu_map: str) -> None:
    """Bring back the GPU state of a suspended tree, optionally onto other GPUs."""
    mapping = _gpu_map(gpu_map)
    done = _run_operation(obj, lambda client: client.resume(pid, gpu_map=mapping))
    if obj.output == "json":
        click.echo(_json(done))
    else:
        moved = ", ".join(f"{k} -> {v}" for k, v in done.resume.gpu_map.items() if k != v) or "same GPUs"
        click.echo(f"resumed PID {pid} ({moved}): {_phase_summary(done)}")


def _transfer_done(obj: Ctx, verb: str, done: operations_pb2.Operation) -> None:
    t = done.transfer
    if obj.output == "json":
        click.echo(
            json.dumps(
                {
                    "id": t.snapshot_id,
                    "remote": t.remote,
                    "operation": done.id,
                    "transferred_bytes": t.transferred_bytes,
                    "skipped_bytes": t.skipped_bytes,
                    "transferred_chunks": t.transferred_chunks,
                    "skipped_chunks": t.skipped_chunks,
                    "buffer_transferred_bytes": t.buffer_transferred_bytes,
                    "phases": {p.phase: p.duration_seconds for p in done.phases},
                },
                indent=2,
            )
        )
        return
    click.echo(t.snapshot_id)
    _console(stderr=True).print(
        f"{verb} {t.snapshot_id} ({t.remote}): {_size(t.transferred_bytes)} in {t.transferred_chunks} chunks, "
        f"{_size(t.skipped_bytes)} in {t.skipped_chunks} chunks already there: {_phase_summary(done)}",
        highlight=False,
    )


@main.command()
@output_option
@click.argument("snapshot")
@click.pass_obj
def push(obj: Ctx, snapshot: str) -> None:
    """Upload SNAPSHOT (id or name) to gpusnapd's remote store; chunks already there are not sent again."""
    _transfer_done(obj, "pushed", _run_operation(obj, lambda client: client.push(snapshot)))


@main.command()
@output_option
@click.argument("snapshot")
@click.pass_obj
def pull(obj: Ctx, snapshot: str) -> None:
    """Download SNAPSHOT (id or name) from gpusnapd's remote store, after the compatibility gate."""
    _transfer_done(obj, "pulled", _run_operation(obj, lambda client: client.pull(snapshot)))


@main.command("ls")
@output_option
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="only snapshots with this label")
@click.option("--remote", is_flag=True, help="list the remote store's snapshots instead of this node's")
@click.pass_obj
def list_snapshots(obj: Ctx, labels: tuple[str, ...], remote: bool) -> None:
    """List snapshots."""
    with obj.client() as client:
        snaps = _run(lambda: client.list_snapshots(_labels(labels), remote=remote))
    if obj.output == "json":
        click.echo(_json(snaps, LS_OMIT))
        return
    wide = _console().width >= LS_WIDE
    headers = ("ID", "NAME", "CREATED", "SIZE") + (("SOURCE", "GPUS") if wide else ())
    table = _table(*headers)
    for i in (0, 2, 3):  # ID, CREATED and SIZE stay on one line; names (and sources) fold
        table.columns[i].no_wrap = True
    for s in snaps:
        created = s.created.ToDatetime(tzinfo=UTC).astimezone().strftime("%Y-%m-%d %H:%M")
        cells = [s.id, s.name or "-", created, _size(s.size_bytes)]
        if wide:
            gpus = len({u for g in s.gpu_processes for u in g.gpu_uuids})
            cells += [f"{s.source.pid} {s.source.comm}", str(gpus)]
        _row(table, *cells)
    _print_table(table)


@main.command()
@output_option
@click.argument("snapshot")
@click.pass_obj
def inspect(obj: Ctx, snapshot: str) -> None:
    """Show a snapshot's manifest."""
    with obj.client() as client:
        snap = _run(lambda: client.get_snapshot(snapshot))
    if obj.output == "json":
        click.echo(_json(snap))
        return
    rows = [
        ("id", snap.id),
        ("name", snap.name or "-"),
        ("created", snap.created.ToDatetime(tzinfo=UTC).astimezone().isoformat(timespec="seconds")),
        (
            "size",
            f"{_size(snap.size_bytes)} in {len(snap.files)} files"
            + (f" + {_size(snap.buffer_bytes)} in {len(snap.buffers)} buffers" if snap.buffers else ""),
        ),
        (
            "source",
            f"PID {snap.source.pid} ({snap.source.comm}), {len(snap.source.tree_pids)} processes, "
            f"uid {snap.source.uid}, RSS {_size(snap.source.rss_bytes)}",
        ),
        ("command", " ".join(snap.source.cmdline)),
        (
            "host",
            f"{snap.host.hostname}, kernel {snap.host.kernel} {snap.host.machine}, CRIU {snap.host.criu_version}, "
            f"gpusnap {snap.host.gpusnap_version}",
        ),
        ("cpu", snap.host.cpu_model),
        ("labels", ", ".join(f"{k}={v}" for k, v in sorted(snap.labels.items())) or "-"),
        ("phases", ", ".join(f"{p.phase} {p.duration_seconds:.3f}s" for p in snap.phases)),
    ]
    if snap.host.nvidia_driver_version:
        rows.append(("driver", f"NVIDIA {snap.host.nvidia_driver_version}, CUDA {snap.host.cuda_driver_version}"))
    for g in snap.gpu_processes:
        rows.append(("gpu", f"PID {g.pid}: {', '.join(g.gpu_uuids)} ({_size(g.gpu_memory_bytes)})"))
    for w in [snap.worker, *snap.agents] if snap.HasField("worker") else []:
        if w.instance_id:  # one row per agent: its role, process, and where its weights went
            held = sum(b.size_bytes for b in snap.buffers if (b.agent or snap.worker.instance_id) == w.instance_id)
            rows.append(
                (
                    "agent",
                    f"{w.role or 'worker'} {w.process or w.engine} PID {w.pid}"
                    + (f", {_size(held)} of buffers" if held else "")
                    + (f"; weights {w.weights}" if w.weights else ""),
                )
            )
    table = _table(show_header=False)
    for key, value in rows:
        _row(table, key, value)
    _print_table(table)


@main.command()
@output_option
@click.argument("snapshots", nargs=-1, required=True)
@click.option(
    "--remote",
    is_flag=True,
    help="delete from the remote store (chunks no other snapshot needs go after the grace period)",
)
@click.pass_obj
def rm(obj: Ctx, snapshots: tuple[str, ...], remote: bool) -> None:
    """Delete snapshots (ids or names)."""
    deleted: list[str] = []
    failed: list[tuple[str, GpusnapError]] = []
    with obj.client() as client:
        for ref in snapshots:
            try:
                deleted.append(client.delete_snapshot(ref, remote=remote))
            except GpusnapError as err:
                click.echo(f"gpusnap: error: {_safe(ref)}: {_safe(err.message)}", err=True)
                failed.append((ref, err))
    if obj.output == "json":
        from gpusnap.daemon import jsonout

        click.echo(
            json.dumps(
                {"deleted": deleted, "failed": [{"snapshot": ref, "error": jsonout.error(err)} for ref, err in failed]}
            )
        )
    elif deleted:
        click.echo("\n".join(deleted))
    if failed:
        sys.exit(EXIT_CODES.get(failed[0][1].code, 1))


@main.command()
@output_option
@click.pass_obj
def node(obj: Ctx) -> None:
    """Show facts about the node: versions, store, GPUs."""
    with obj.client() as client:
        info = _run(client.node_info)
    if obj.output == "json":
        click.echo(_json(info))
        return
    h = info.host
    table = _table(show_header=False)
    for key, value in (
        ("host", f"{h.hostname} ({h.machine})"),
        ("kernel", h.kernel),
        ("gpusnap", h.gpusnap_version),
        ("criu", f"{h.criu_version} ({info.criu_path})"),
        ("store", f"{info.store_path}: {info.snapshot_count} snapshots, {_size(info.store_used_bytes)}"),
        ("remote", info.remote or "-"),
        ("cpu", h.cpu_model),
        ("nvidia driver", h.nvidia_driver_version or "-"),
        ("cuda checkpoint", "supported" if info.cuda_checkpoint_supported else (info.cuda_unavailable_reason or "-")),
        ("gpu prefill", info.gpu_prefill or "off"),
    ):
        _row(table, key, value)
    _print_table(table)
    if info.gpus:
        gpus = _table("IDX", "UUID", "NAME", "MEMORY FREE/TOTAL", "PERSISTENCE", "MIG", "PROCESSES")
        for g in info.gpus:
            _row(
                gpus,
                str(g.index),
                g.uuid,
                g.name,
                f"{_size(g.memory_free_bytes)} / {_size(g.memory_total_bytes)}",
                "on" if g.persistence_mode else "off",
                "on" if g.mig_mode else "off",
                ", ".join(str(p.pid) for p in g.processes) or "-",
            )
        _print_table(gpus)


@main.command()
@output_option
@click.pass_obj
def store(obj: Ctx) -> None:
    """Show the store: snapshots, the buffer tiers' use and budgets, the remote store."""
    with obj.client() as client:
        info = _run(client.node_info)
    if obj.output == "json":
        from gpusnap.daemon import jsonout

        click.echo(
            json.dumps(
                {
                    "store_path": info.store_path,
                    "snapshot_count": info.snapshot_count,
                    "store_used_bytes": info.store_used_bytes,
                    "remote": info.remote,
                    "tiers": [jsonout.message(t) for t in info.tiers],
                },
                indent=2,
            )
        )
        return
    click.echo(
        f"store {info.store_path}: {info.snapshot_count} snapshots, {_size(info.store_used_bytes)}"
        f"; remote {info.remote or '-'}"
    )
    table = _table("TIER", "PATH", "USED", "BUDGET", "FREE", "BLOBS")
    for t in info.tiers:
        table.add_row(
            t.name,
            t.path,
            _size(t.used_bytes),
            _size(t.budget_bytes) if t.budget_bytes else "-",
            _size(t.free_bytes) if t.name != "remote" else "-",
            str(t.blobs),
        )
    _print_table(table)


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def wait(obj: Ctx, operation: str) -> None:
    """Wait for an operation (from --detach) to end; exits with its outcome."""
    with obj.client() as client:
        op = _run(lambda: _follow(client, client.get_operation(operation), obj.live))
    if obj.output == "json":
        click.echo(_json(op))
        return
    outcome = {"snapshot": f"snapshot {op.snapshot.id}", "restore": f"restored as PID {op.restore.pid}"}
    what = outcome.get(op.WhichOneof("result") or "", "")
    click.echo(f"{op.id} succeeded{': ' + what if what else ''} ({_phase_summary(op)})")


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def cancel(obj: Ctx, operation: str) -> None:
    """Cancel a running operation: it rolls back and ends with CANCELLED."""
    from gpusnap.daemon._proto import operations_pb2

    with obj.client() as client:
        op = _run(lambda: client.cancel(operation))
        if op.state == operations_pb2.OPERATION_STATE_RUNNING:
            try:
                client.wait(op.id)
            except GpusnapError:
                pass  # the outcome is read below
            op = _run(lambda: client.get_operation(operation))
    if obj.output == "json":
        click.echo(_json(op))
    elif op.state == operations_pb2.OPERATION_STATE_FAILED and op.error.code == Code.CANCELLED:
        click.echo(f"{op.id} cancelled; what it had done was rolled back")
    else:
        state = operations_pb2.OperationState.Name(op.state).removeprefix("OPERATION_STATE_").lower()
        click.echo(f"{op.id} had ended ({state}) before it could be cancelled")


@main.command("ops")
@output_option
@click.pass_obj
def list_operations(obj: Ctx) -> None:
    """List this daemon's operations."""
    with obj.client() as client:
        ops = _run(client.list_operations)
    if obj.output == "json":
        click.echo(_json(ops, frozenset({"snapshot.host.cpu_flags"})))
        return
    from gpusnap.daemon._proto import operations_pb2

    table = _table("ID", "KIND", "STATE", "PHASE", "STARTED", "TARGET")
    for i in (0, 1, 2, 4):  # ID, KIND, STATE and STARTED stay on one line; phases and targets fold
        table.columns[i].no_wrap = True
    for op in ops:
        kind = operations_pb2.OperationKind.Name(op.kind).removeprefix("OPERATION_KIND_").lower()
        state = operations_pb2.OperationState.Name(op.state).removeprefix("OPERATION_STATE_").lower()
        started = op.started.ToDatetime(tzinfo=UTC).astimezone().strftime("%H:%M:%S")
        _row(table, op.id, kind, state, op.phase, started, op.target_snapshot or str(op.target_pid))
    _print_table(table)


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
                f"gpusnap: error: argument {i} ({_safe(shown[:100])}) is not valid UTF-8; pass UTF-8 text", err=True
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


if __name__ == "__main__":
    run()
