"""``wait``, ``cancel``, ``ops``: this daemon's operations."""

from __future__ import annotations

import click

from gpusnap.daemon.api.errors import Code, GpusnapError
from gpusnap.daemon.cli.app import Ctx, checked, main, output_option
from gpusnap.daemon.cli.follow import follow
from gpusnap.daemon.cli.output import add_row, emit, new_table, phase_summary, print_table


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def wait(obj: Ctx, operation: str) -> None:
    """Wait for an operation (from --detach) to end; exits with its outcome."""
    with obj.client() as client:
        op = checked(lambda: follow(client, client.get_operation(operation).id, obj.live))
    if obj.output == "json":
        emit(op)
        return
    what = f"snapshot {op.snapshot.id}" if op.snapshot else f"restored as PID {op.restore.pid}" if op.restore else ""
    click.echo(f"{op.id} succeeded{': ' + what if what else ''} ({phase_summary(op)})")


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def cancel(obj: Ctx, operation: str) -> None:
    """Cancel a running operation: it rolls back and ends with CANCELLED."""
    from gpusnap.daemon.api.types import OperationState

    with obj.client() as client:
        op = checked(lambda: client.cancel(operation))
        if op.state is OperationState.RUNNING:
            try:
                client.wait(op.id)
            except GpusnapError:
                pass  # the outcome is read below
            op = checked(lambda: client.get_operation(operation))
    if obj.output == "json":
        emit(op)
    elif op.state is OperationState.FAILED and op.error is not None and op.error.code == Code.CANCELLED:
        click.echo(f"{op.id} cancelled; what it had done was rolled back")
    else:
        click.echo(f"{op.id} had ended ({op.state.value}) before it could be cancelled")


@main.command("ops")
@output_option
@click.pass_obj
def list_operations(obj: Ctx) -> None:
    """List this daemon's operations."""
    with obj.client() as client:
        ops = checked(client.list_operations)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import OPS_OMIT

        emit(ops, OPS_OMIT)
        return

    table = new_table("ID", "KIND", "STATE", "PHASE", "STARTED", "TARGET")
    for i in (0, 1, 2, 4):  # ID, KIND, STATE and STARTED stay on one line; phases and targets fold
        table.columns[i].no_wrap = True
    for op in ops:
        started = op.started.astimezone().strftime("%H:%M:%S")
        add_row(
            table, op.id, op.kind.value, op.state.value, op.phase, started, op.target_snapshot or str(op.target_pid)
        )
    print_table(table)
