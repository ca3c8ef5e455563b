"""``wait``, ``cancel``, ``ops``: this daemon's operations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.cli.app import Ctx, checked, command_options, main
from gpusnap.daemon.cli.follow import follow, print_event
from gpusnap.daemon.cli.output import add_row, emit, new_table, phase_summary, print_table, safe, wide

if TYPE_CHECKING:
    from rich.table import Table

    from gpusnap.daemon.client.values import Operation


@main.command()
@command_options
@click.argument("operation")
@click.option(
    "--events",
    is_flag=True,
    help="print each of its events as it comes (phases, progress in bytes with the rate, rollback), with -o json "
    "one JSON object a line, the last one carrying the operation",
)
@click.pass_obj
def wait(obj: Ctx, operation: str, events: bool) -> None:
    """Wait for an operation (from --detach) to end; exits with its outcome."""
    on_event = (lambda e: print_event(e, obj.output == "json")) if events else None
    with obj.client() as client:
        op = checked(lambda: follow(client, client.get_operation(operation).id, obj.live, on_event=on_event))
    if obj.output == "json":
        if not events:  # the last event carried it
            emit(op)
        return
    what = f"snapshot {op.snapshot.id}" if op.snapshot else f"restored as PID {op.restore.pid}" if op.restore else ""
    click.echo(f"{op.id} succeeded{': ' + what if what else ''} ({phase_summary(op)})")


@main.command()
@command_options
@click.argument("operation")
@click.pass_obj
def cancel(obj: Ctx, operation: str) -> None:
    """Cancel a running operation: it rolls back and ends with CANCELLED. Says at once what the cancel does (the
    running phase stops now, or runs to its end first, or it is too late), then waits for the operation's end."""
    from gpusnap.daemon.api.types import OperationState

    with obj.client() as client:
        op = checked(lambda: client.cancel(operation))
        if op.state is OperationState.RUNNING:
            if obj.output != "json":
                click.echo(safe(f"cancelling {op.id}: {op.cancel_note}"), err=True)
            try:
                client.wait(op.id)
            except GpusnapError:
                pass  # the outcome is read below
            op = checked(lambda: client.get_operation(operation))
    if obj.output == "json":
        emit(op)
    elif op.state is OperationState.CANCELLED:
        click.echo(safe(f"{op.id} cancelled: {op.error.message if op.error else 'rolled back'}"))
    elif op.state is OperationState.SUCCEEDED and op.cancel_note:
        click.echo(safe(f"{op.id} ran to its end and succeeded: {op.cancel_note}"))
    elif op.state is OperationState.FAILED:
        click.echo(safe(f"{op.id} failed before it could be cancelled: {op.error.message if op.error else ''}"))
    else:
        click.echo(f"{op.id} had ended ({op.state.value}) before it could be cancelled")


@main.command("ops")
@command_options
@click.pass_obj
def list_operations(obj: Ctx) -> None:
    """List this daemon's operations."""
    with obj.client() as client:
        ops = checked(client.list_operations)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import OPS_OMIT

        emit(ops, OPS_OMIT)
        return

    print_table(operations_table(ops, wide()))


def operations_table(ops: list[Operation], wide: bool) -> Table:
    """``ops``: one row per operation (a dry run's kind is ``dry-run``); narrower than ``WIDE``, each operation's
    target (a 31-character snapshot id) goes under its id and its phase under its state, so that every value
    stays whole within 80 columns."""
    headers = (
        ("ID", "KIND", "STATE", "PHASE", "STARTED", "TARGET")
        if wide
        else ("ID / TARGET", "KIND", "STATE / PHASE", "STARTED")
    )
    table = new_table(*headers)
    for column in table.columns:  # nothing is cut: ids, kinds, states, phases (resume-worker) stay whole
        column.no_wrap = True
    for op in ops:
        started = op.started.astimezone().strftime("%H:%M:%S")
        target = op.target_snapshot or str(op.target_pid or "-")
        kind = "dry-run" if op.dry_run else op.kind.value  # a checkpoint's preflight only: no snapshot
        if wide:
            add_row(table, op.id, kind, op.state.value, op.phase, started, target)
        else:
            add_row(table, (op.id, target), kind, (op.state.value, op.phase), started)
    return table
