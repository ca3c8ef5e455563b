"""``push`` and ``pull``: snapshots to and from the remote store."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from gpusnap.daemon.cli.app import Ctx, command_options, main
from gpusnap.daemon.cli.follow import run_operation
from gpusnap.daemon.cli.output import console, emit, human_size, outcome, phase_summary

if TYPE_CHECKING:
    from gpusnap.daemon.client.values import Operation


def _transfer_done(obj: Ctx, verb: str, done: Operation) -> None:
    t = outcome(done.transfer, done)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Transferred

        emit(
            Transferred(
                id=t.snapshot_id,
                remote=t.remote,
                operation=done.id,
                transferred_bytes=t.transferred_bytes,
                skipped_bytes=t.skipped_bytes,
                transferred_chunks=t.transferred_chunks,
                skipped_chunks=t.skipped_chunks,
                buffer_transferred_bytes=t.buffer_transferred_bytes,
                phases=done.phases,
            )
        )
        return
    click.echo(t.snapshot_id)
    console(stderr=True).print(
        f"{verb} {t.snapshot_id} ({t.remote}): {human_size(t.transferred_bytes)} in {t.transferred_chunks} chunks, "
        f"{human_size(t.skipped_bytes)} in {t.skipped_chunks} chunks already there: {phase_summary(done)}",
        highlight=False,
    )


@main.command()
@command_options
@click.argument("snapshot")
@click.pass_obj
def push(obj: Ctx, snapshot: str) -> None:
    """Upload SNAPSHOT (id or name) to gpusnapd's remote store; chunks already there are not sent again."""
    _transfer_done(obj, "pushed", run_operation(obj, lambda client: client.push(snapshot)))


@main.command()
@command_options
@click.argument("snapshot")
@click.pass_obj
def pull(obj: Ctx, snapshot: str) -> None:
    """Download SNAPSHOT (id or name) from gpusnapd's remote store, after the compatibility gate."""
    _transfer_done(obj, "pulled", run_operation(obj, lambda client: client.pull(snapshot)))
