"""``dump``, ``restore``, ``suspend``, ``resume``: the commands that start a capture or bring one back."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import click

from gpusnap.daemon.cli.app import PID, SECONDS, Ctx, checked, command_options, main, parse_labels, parse_pairs
from gpusnap.daemon.cli.follow import detached, follow, run_operation, start_held
from gpusnap.daemon.cli.output import console, count, emit, human_size, outcome, phase_summary, safe, terminal_lines

if TYPE_CHECKING:
    from gpusnap.daemon.client.values import Operation


@main.command()
@command_options
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
@click.option(
    "--no-quiesce",
    is_flag=True,
    help="capture as is, without the worker agents' warm-up, quiesce and offload (also when an agent is not "
    "attached to this gpusnapd, which is refused otherwise: the slow path)",
)
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
@click.option(
    "--dry-run",
    is_flag=True,
    help="run the preflight only: say whether the tree can be captured, and leave it as it is",
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
    dry_run: bool,
    detach: bool,
) -> None:
    """Checkpoint the process tree rooted at PID into a new snapshot; prints its id.

    With a gpusnap worker agent attached, the worker is warmed up and quiesced first, and the buffers
    its adapter names (weights) go to the buffer store, once per content, instead of the images.
    """
    with obj.client() as client:
        op, sigint = start_held(
            lambda: client.checkpoint(
                pid,
                name=name,
                labels=parse_labels(labels),
                leave_running=leave_running,
                tcp=tcp,
                timeout_s=timeout,
                gpu_lock_timeout_s=gpu_lock_timeout,
                control_dir=control_dir,
                quiesce=not no_quiesce,
                offload=not no_offload,
                dry_run=dry_run,
            )
        )
        if detach:
            sigint.release()
            if push_after:
                raise click.UsageError(
                    "--push needs the dump to finish first; drop --detach, or push later with `gpusnap push`"
                )
            detached(obj, op.id)
            return
        done = checked(lambda: follow(client, op.id, obj.live, sigint))
        if dry_run:
            if obj.output == "json":
                emit(done)
            else:
                click.echo(f"PID {pid} can be captured (preflight passed; the tree was left as it is)")
            return
        snap = outcome(done.snapshot, done)
        pushing = checked(lambda: client.push(snap.id)).id if push_after else ""
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Dumped

        emit(
            Dumped(
                id=snap.id,
                name=snap.name,
                operation=done.id,
                size_bytes=snap.size_bytes,
                buffer_bytes=snap.buffer_bytes,
                phases=done.phases,
                push_operation=pushing or None,
            )
        )
    else:
        click.echo(snap.id)
        held = f" + {human_size(snap.buffer_bytes)} of buffers" if snap.buffer_bytes else ""
        console(stderr=True).print(
            f"snapshot {snap.id} ({human_size(snap.size_bytes)}{held}): {phase_summary(done)}", highlight=False
        )
        for line in terminal_lines(snap):
            console(stderr=True).print(line, highlight=False, markup=False)
        if pushing:
            console(stderr=True).print(
                f"pushing in the background as {pushing}; follow it with `gpusnap wait {pushing}`", highlight=False
            )


def parse_gpu_map(value: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, value.split(",")):
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise click.BadParameter(f"{item!r} is not OLD=NEW (GPU UUIDs or indexes)", param_hint="--gpu-map")
        out[old.strip()] = new.strip()
    return out


GPU_MAP_HELP = "move GPU state: OLD=NEW[,OLD=NEW…] (UUIDs or indexes); every checkpointed GPU must be named"


@main.command()
@command_options
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
@click.option(
    "--terminal",
    type=click.Path(dir_okay=False),
    default="",
    metavar="FILE",
    help="for a job started from a terminal: the file its terminal descriptors get instead (appended to, "
    "created as the snapshot's owner) [default: /dev/null]",
)
@click.option("--no-standby", is_flag=True, help="restore from the images even when a standby of SNAPSHOT is ready")
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
    terminal: str,
    no_standby: bool,
    detach: bool,
) -> None:
    """Restore SNAPSHOT (id or name) as a new process tree; prints the restored root's PID (one per line
    with --replicas). A ready standby of SNAPSHOT (`gpusnap standby`) is activated instead, unless
    --no-standby.

    Without --gpu-map, GPU state returns to the original GPUs, or to free GPUs of the same model when
    those are busy or absent.
    """
    mapping = parse_gpu_map(gpu_map)
    with obj.client() as client:
        op, sigint = start_held(
            lambda: client.restore(
                snapshot,
                host_pid_namespace=host_pidns,
                gpu_map=mapping,
                timeout_s=timeout,
                env=parse_pairs(env, "--env"),
                unset_env=unset_env,
                values=parse_pairs(values, "--set"),
                private_network=private_net,
                verify_buffers=verify_buffers,
                replicas=replicas,
                terminal=os.path.abspath(terminal) if terminal else "",
                no_standby=no_standby,
            )
        )
        if detach:
            sigint.release()
            detached(obj, op.id)
            return
        done = checked(lambda: follow(client, op.id, obj.live, sigint))
    print_restored(obj, done)


def print_restored(obj: Ctx, done: Operation) -> None:
    """A finished restore (or activation): the restored roots' PIDs, one per line, or its JSON."""
    from gpusnap.daemon.client.values import Replica

    res = outcome(done.restore, done)
    copies = res.replicas or (
        Replica(index=0, pid=res.pid, pids=res.pids, namespace_pid=res.namespace_pid, file_copies=res.file_copies),
    )
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Restored

        emit(
            Restored(
                pid=res.pid,
                pids=res.pids,
                namespace_pid=res.namespace_pid,
                snapshot_id=res.snapshot_id,
                operation=done.id,
                replicas=copies,
                phases=done.phases,
                standby_id=res.standby_id,
                standbys_skipped=res.standbys_skipped,
            )
        )
    else:
        click.echo("\n".join(str(c.pid) for c in copies))
        pids = ", ".join(str(c.pid) for c in copies)
        err = console(stderr=True)
        how = f"from standby {res.standby_id}" if res.standby_id else "from its images"
        err.print(f"restored {res.snapshot_id} {how} as PID {pids}: {phase_summary(done)}", highlight=False)
        if res.standbys_skipped:
            err.print(safe(f"not from a standby: {res.standbys_skipped}"), highlight=False, markup=False)
        for c in copies:  # files an earlier copy (or the source) continues: this one writes its own copy
            for f in c.file_copies:
                err.print(
                    f"PID {c.pid} continues {f.path} in a copy of its first {f.size_bytes} bytes: {f.copy}",
                    highlight=False,
                    soft_wrap=True,  # a path whole, to be copied
                )


@main.command()
@command_options
@click.argument("pid", type=PID)
@click.option("--gpu-lock-timeout", type=SECONDS, help="seconds to wait for CUDA work to drain [daemon default]")
@click.pass_obj
def suspend(obj: Ctx, pid: int, gpu_lock_timeout: float | None) -> None:
    """Checkpoint the GPU state of the tree rooted at PID in place: GPU memory is freed, the processes live on."""
    done = run_operation(obj, lambda client: client.suspend(pid, gpu_lock_timeout_s=gpu_lock_timeout))
    if obj.output == "json":
        emit(done)
    else:
        gpu_processes = outcome(done.suspend, done).gpu_processes
        freed = sum(g.gpu_memory_bytes for g in gpu_processes)
        click.echo(
            f"suspended {count(len(gpu_processes), 'CUDA process', 'CUDA processes')}, {human_size(freed)} of GPU memory freed: "
            f"{phase_summary(done)}"
        )


@main.command()
@command_options
@click.argument("pid", type=PID)
@click.option("--gpu-map", default="", metavar="OLD=NEW,…", help=GPU_MAP_HELP)
@click.pass_obj
def resume(obj: Ctx, pid: int, gpu_map: str) -> None:
    """Bring back the GPU state of a suspended tree, optionally onto other GPUs."""
    mapping = parse_gpu_map(gpu_map)
    done = run_operation(obj, lambda client: client.resume(pid, gpu_map=mapping))
    if obj.output == "json":
        emit(done)
    else:
        moved = ", ".join(f"{k} -> {v}" for k, v in outcome(done.resume, done).gpu_map.items() if k != v) or "same GPUs"
        click.echo(f"resumed PID {pid} ({moved}): {phase_summary(done)}")
