"""``ls``, ``inspect``, ``rm``: the store's snapshots; ``ls --running`` and ``stop``: the trees restored from them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.cli.app import EXIT_CODES, Ctx, checked, command_options, main, parse_labels
from gpusnap.daemon.cli.output import (
    add_row,
    count,
    emit,
    human_size,
    new_table,
    print_table,
    safe,
    terminal_lines,
)
from gpusnap.daemon.cli.output import wide as output_wide

if TYPE_CHECKING:
    from gpusnap.daemon.client.values import Snapshot


@main.command("ls")
@command_options
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="only snapshots with this label")
@click.option("--remote", is_flag=True, help="list the remote store's snapshots instead of this node's")
@click.option("--running", is_flag=True, help="list the restored trees running now instead (yours; root: all)")
@click.pass_obj
def list_snapshots(obj: Ctx, labels: tuple[str, ...], remote: bool, running: bool) -> None:
    """List snapshots, or with --running the trees restored from them that run now."""
    if running:
        list_trees(obj)
        return
    with obj.client() as client:
        snaps = checked(lambda: client.list_snapshots(parse_labels(labels), remote=remote))
        standbys = [] if remote or obj.output == "json" else checked(client.list_standbys)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import LS_OMIT

        emit(snaps, LS_OMIT)
        return
    wide = output_wide()
    headers = ("ID", "NAME", "CREATED", "SIZE") + (("SOURCE", "GPUS") if wide else ())
    table = new_table(*headers)
    for i in (0, 2, 3):  # ID, CREATED and SIZE stay on one line; names (and sources) fold
        table.columns[i].no_wrap = True
    for s in snaps:
        created = s.created.astimezone().strftime("%Y-%m-%d %H:%M")
        cells = [s.id, s.name or "-", created, human_size(s.size_bytes + s.buffer_bytes)]  # images and weights
        if wide:
            gpus = len({u for g in s.gpu_processes for u in g.gpu_uuids})
            cells += [f"{s.source.pid} {s.source.comm}", str(gpus)]
        add_row(table, *cells)
    print_table(table)
    if standbys:  # snapshots restored ahead, with the host memory each holds (docs/standby.md)
        from gpusnap.daemon.cli.park import print_standbys

        print_standbys(standbys)


def process_rows(snap: Snapshot) -> list[tuple[str, str]]:
    """One ``process`` row per process the snapshot says anything of: what stayed (the images' bytes of it,
    its GPU memory at capture, which the CUDA checkpoint carries), what left (its buffers, in the buffer
    store; what its quiesce released without saving), and where its weights went and why."""
    primary = snap.worker.instance_id if snap.worker else ""
    agents = {w.pid: w for w in ([snap.worker, *snap.agents] if snap.worker else []) if w.instance_id and w.pid}
    images = {i.pid: i.image_bytes for i in snap.process_images}
    gpus = {g.pid: g for g in snap.gpu_processes}
    rows = []
    for pid in sorted(set(agents) | set(images) | set(gpus)):
        w, g = agents.get(pid), gpus.get(pid)
        stayed = [f"{human_size(images[pid])} in the images"] if pid in images else []
        if g and g.gpu_memory_bytes:
            stayed.append(f"{human_size(g.gpu_memory_bytes)} of GPU memory on {', '.join(g.gpu_uuids)}")
        left = []
        if w:
            held = sum(b.size_bytes for b in snap.buffers if (b.agent or primary) == w.instance_id)
            left += [f"{human_size(held)} of buffers"] if held else []
            left += [f"{human_size(w.released_bytes)} released"] if w.released_bytes else []
        name = f"{w.role or 'worker'} {w.process or w.engine} " if w else ""
        text = f"{name}PID {pid}: " + ("; ".join(stayed) or "nothing in the images")
        text += f"; out: {', '.join(left)}" if left else ""
        text += f"; weights {w.weights}" if w and w.weights else ""
        rows.append(("process", text))
    return rows


def list_trees(obj: Ctx) -> None:
    """``ls --running``: one row per restored tree; narrower than ``WIDE``, each tree's operation goes under its
    snapshot, so that PIDs, times and counts stay whole within 80 columns."""
    with obj.client() as client:
        trees = checked(client.restored_trees)
    if obj.output == "json":
        emit(trees)
        return
    wide = output_wide()
    headers = (
        ("PID", "SNAPSHOT", "OPERATION", "STARTED", "UID", "PROCESSES")
        if wide
        else ("PID", "SNAPSHOT / OPERATION", "STARTED", "UID", "PROCESSES")
    )
    table = new_table(*headers)
    for i in range(len(headers)):
        table.columns[i].no_wrap = headers[i] != "SNAPSHOT"
    for t in trees:
        started = t.started.astimezone().strftime("%Y-%m-%d %H:%M")
        rest = (started, str(t.uid), str(t.process_count))
        if wide:
            add_row(table, str(t.pid), t.snapshot_name or t.snapshot_id, t.operation_id, *rest)
        else:
            add_row(table, str(t.pid), (t.snapshot_name or t.snapshot_id, t.operation_id), *rest)
    print_table(table)


@main.command()
@command_options
@click.argument("tree")
@click.pass_obj
def stop(obj: Ctx, tree: str) -> None:
    """Stop a restored tree: TREE is the PID `restore` printed (see `ls --running`), or a restore's operation id
    (every copy it made). Its processes get SIGTERM, SIGKILL after 10 s; returns once they are gone."""
    pid = int(tree) if tree.isdigit() else 0
    with obj.client() as client:
        stopped = checked(lambda: client.stop_restored_tree(pid=pid, operation_id="" if pid else tree))
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Stopped

        emit(Stopped(stopped=tuple(stopped)))
        return
    for t in stopped:
        click.echo(
            f"stopped PID {t.pid} ({count(t.process_count, 'process', 'processes')} of {t.snapshot_name or t.snapshot_id}, {t.operation_id})"
        )


@main.command()
@command_options
@click.argument("snapshot")
@click.pass_obj
def inspect(obj: Ctx, snapshot: str) -> None:
    """Show a snapshot's manifest."""
    with obj.client() as client:
        snap = checked(lambda: client.get_snapshot(snapshot))
    if obj.output == "json":
        emit(snap)
        return
    rows = [
        ("id", snap.id),
        ("name", snap.name or "-"),
        ("created", snap.created.astimezone().isoformat(timespec="seconds")),
        (
            "size",
            f"{human_size(snap.size_bytes)} in {count(len(snap.files), 'file')}"
            + (f" + {human_size(snap.buffer_bytes)} in {count(len(snap.buffers), 'buffer')}" if snap.buffers else ""),
        ),
        (
            "source",
            f"PID {snap.source.pid} ({snap.source.comm}), {count(len(snap.source.tree_pids), 'process', 'processes')}, "
            f"uid {snap.source.uid}, RSS {human_size(snap.source.rss_bytes)}",
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
    rows += process_rows(snap)
    rows += [("terminal", line.removeprefix("terminal ")) for line in terminal_lines(snap)]
    table = new_table(show_header=False)
    for key, value in rows:
        add_row(table, key, value)
    print_table(table)


@main.command()
@command_options
@click.argument("snapshots", nargs=-1, required=True)
@click.option(
    "--remote",
    is_flag=True,
    help="delete from the remote store (chunks no other snapshot needs go after the grace period)",
)
@click.pass_obj
def rm(obj: Ctx, snapshots: tuple[str, ...], remote: bool) -> None:
    """Delete snapshots (ids or names)."""
    from gpusnap.daemon.cli.documents import Removed, RemoveFailure

    deleted: list[str] = []
    failed: list[RemoveFailure] = []
    with obj.client() as client:
        for ref in snapshots:
            try:
                deleted.append(client.delete_snapshot(ref, remote=remote))
            except GpusnapError as err:
                click.echo(f"gpusnap: error: {safe(ref)}: {safe(err.message)}", err=True)
                failed.append(RemoveFailure(snapshot=ref, error=err))
    if obj.output == "json":
        emit(Removed(deleted=tuple(deleted), failed=tuple(failed)))
    elif deleted:
        click.echo("\n".join(deleted))
    if failed:
        sys.exit(EXIT_CODES.get(failed[0].error.code, 1))
