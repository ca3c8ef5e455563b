"""``wait``, ``cancel``, ``ops``: this daemon's operations."""

from __future__ import annotations

from datetime import UTC

import click

from gpusnap.daemon.api.errors import Code, GpusnapError
from gpusnap.daemon.cli.app import Ctx, checked, main, output_option
from gpusnap.daemon.cli.follow import follow
from gpusnap.daemon.cli.output import add_row, new_table, phase_summary, print_table, to_json


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def wait(obj: Ctx, operation: str) -> None:
    """Wait for an operation (from --detach) to end; exits with its outcome."""
    with obj.client() as client:
        op = checked(lambda: follow(client, client.get_operation(operation), obj.live))
    if obj.output == "json":
        click.echo(to_json(op))
        return
    outcome = {"snapshot": f"snapshot {op.snapshot.id}", "restore": f"restored as PID {op.restore.pid}"}
    what = outcome.get(op.WhichOneof("result") or "", "")
    click.echo(f"{op.id} succeeded{': ' + what if what else ''} ({phase_summary(op)})")


@main.command()
@output_option
@click.argument("operation")
@click.pass_obj
def cancel(obj: Ctx, operation: str) -> None:
    """Cancel a running operation: it rolls back and ends with CANCELLED."""
    from gpusnap.daemon._proto import operations_pb2

    with obj.client() as client:
        op = checked(lambda: client.cancel(operation))
        if op.state == operations_pb2.OPERATION_STATE_RUNNING:
            try:
                client.wait(op.id)
            except GpusnapError:
                pass  # the outcome is read below
            op = checked(lambda: client.get_operation(operation))
    if obj.output == "json":
        click.echo(to_json(op))
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
        ops = checked(client.list_operations)
    if obj.output == "json":
        click.echo(to_json(ops, frozenset({"snapshot.host.cpu_flags"})))
        return
    from gpusnap.daemon._proto import operations_pb2

    table = new_table("ID", "KIND", "STATE", "PHASE", "STARTED", "TARGET")
    for i in (0, 1, 2, 4):  # ID, KIND, STATE and STARTED stay on one line; phases and targets fold
        table.columns[i].no_wrap = True
    for op in ops:
        kind = operations_pb2.OperationKind.Name(op.kind).removeprefix("OPERATION_KIND_").lower()
        state = operations_pb2.OperationState.Name(op.state).removeprefix("OPERATION_STATE_").lower()
        started = op.started.ToDatetime(tzinfo=UTC).astimezone().strftime("%H:%M:%S")
        add_row(table, op.id, kind, state, op.phase, started, op.target_snapshot or str(op.target_pid))
    print_table(table)
