"""``standby``, ``activate``, ``standbys``, ``drop``, ``park``: standbys and the park ladder (docs/standby.md)."""

from __future__ import annotations

from datetime import UTC
from typing import TYPE_CHECKING, Any

import click

from gpusnap.daemon.cli.app import SECONDS, Ctx, checked, command_options, main, parse_labels, parse_pairs
from gpusnap.daemon.cli.capture import GPU_MAP_HELP, parse_gpu_map, print_restored
from gpusnap.daemon.cli.follow import run_operation
from gpusnap.daemon.cli.output import (
    add_row,
    console,
    emit,
    human_size,
    new_table,
    outcome,
    phase_summary,
    print_table,
    safe,
    wide,
)

if TYPE_CHECKING:
    from gpusnap.daemon.client.values import Ladder, Standby


@main.command()
@command_options
@click.argument("snapshot")
@click.option("--count", type=click.IntRange(1, 64), default=1, show_default=True, help="standbys to make")
@click.option("--private-net", is_flag=True, help="each in a fresh network namespace (implied by --count > 1)")
@click.option("--timeout", type=SECONDS, help="seconds for the whole operation [daemon default]")
@click.pass_obj
def standby(obj: Ctx, snapshot: str, count: int, private_net: bool, timeout: float | None) -> None:
    """Restore SNAPSHOT's CPU side now, ahead of demand: each standby waits stopped, CUDA-checkpointed (no GPU
    memory), its worker quiesced; prints the standby ids. `gpusnap activate` (or a restore of SNAPSHOT)
    brings one up on a GPU."""
    done = run_operation(
        obj, lambda client: client.standby(snapshot, count=count, private_network=private_net, timeout_s=timeout)
    )
    made = outcome(done.standby, done).standbys
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import StandbysMade

        emit(StandbysMade(standbys=made, operation=done.id, phases=done.phases))
        return
    click.echo("\n".join(s.id for s in made))
    held = human_size(sum(s.host_memory_bytes for s in made))
    click.echo(f"{len(made)} standby of {made[0].snapshot_id}, {held} of host memory: {phase_summary(done)}", err=True)


@main.command()
@command_options
@click.argument("standby_id", metavar="STANDBY")
@click.option("--gpu", default="", metavar="UUID|INDEX", help="the GPU to bring it up on (a one-GPU snapshot)")
@click.option("--gpu-map", default="", metavar="OLD=NEW,…", help=GPU_MAP_HELP)
@click.option("--env", multiple=True, metavar="NAME=VALUE", help="restore context: set in the worker (repeatable)")
@click.option("--unset-env", multiple=True, metavar="NAME", help="restore context: remove from the worker (repeatable)")
@click.option("--set", "values", multiple=True, metavar="KEY=VALUE", help="restore context: value for the adapter")
@click.option("--verify-buffers", is_flag=True, help="re-digest the weights first")
@click.pass_obj
def activate(
    obj: Ctx,
    standby_id: str,
    gpu: str,
    gpu_map: str,
    env: tuple[str, ...],
    unset_env: tuple[str, ...],
    values: tuple[str, ...],
    verify_buffers: bool,
) -> None:
    """Bring STANDBY up: CUDA restore on the GPU, weights, resume, canary; prints its root's PID. If another
    activation took STANDBY first, its snapshot is restored instead (from another standby when ready)."""
    mapping = parse_gpu_map(gpu_map)
    done = run_operation(
        obj,
        lambda client: client.activate(
            standby_id,
            gpu=gpu,
            gpu_map=mapping,
            env=parse_pairs(env, "--env"),
            unset_env=unset_env,
            values=parse_pairs(values, "--set"),
            verify_buffers=verify_buffers,
        ),
    )
    print_restored(obj, done)


@main.command("standbys")
@command_options
@click.argument("snapshot", required=False, default="")
@click.pass_obj
def list_standbys(obj: Ctx, snapshot: str) -> None:
    """List standbys (of SNAPSHOT), with the host memory each holds."""
    with obj.client() as client:
        found = checked(lambda: client.list_standbys(snapshot))
    if obj.output == "json":
        emit(found)
        return
    print_standbys(found)


def print_standbys(found: list[Standby]) -> None:
    """The standbys table (``standbys``, and under ``ls`` when there are any); narrower than ``WIDE``, each
    standby's snapshot goes under its id, so that no id is split over lines at 80 columns."""
    is_wide = wide()
    headers = ("STANDBY", "SNAPSHOT") if is_wide else ("STANDBY / SNAPSHOT",)
    table = new_table(*headers, "PID", "HOST MEMORY", "STATE")
    for column in table.columns:
        column.no_wrap = True
    for s in found:
        ids: tuple[str | tuple[str, ...], ...] = (s.id, s.snapshot_id) if is_wide else ((s.id, s.snapshot_id),)
        add_row(table, *ids, str(s.pid), human_size(s.host_memory_bytes), s.state)
    print_table(table)


@main.command()
@command_options
@click.argument("standbys", nargs=-1, required=True)
@click.pass_obj
def drop(obj: Ctx, standbys: tuple[str, ...]) -> None:
    """Drop standbys: their trees are killed, their snapshots stay."""
    with obj.client() as client:
        dropped = tuple(checked(lambda s=s: client.drop_standby(s)) for s in standbys)  # type: ignore[misc]
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import Dropped

        emit(Dropped(dropped=dropped))
    else:
        click.echo("\n".join(dropped))


@main.group(invoke_without_command=True)
@command_options
@click.pass_context
def park(ctx: click.Context) -> None:
    """Show the park ladder: each workload's rung (active, suspended, standby, ram, disk, remote), its policy,
    the budgets and the latest moves. `gpusnap park set` sets a policy."""
    if ctx.invoked_subcommand is not None:
        return
    obj: Ctx = ctx.obj
    with obj.client() as client:
        ladder = checked(client.ladder)
        rules = checked(client.list_policies)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import ParkReport

        emit(ParkReport(ladder.workloads, ladder.budgets, ladder.events, tuple(rules)))
        return
    print_ladder(ladder)
    if rules:
        table = new_table("POLICY FOR", "KEEP WARM", "PRIORITY", "STANDBY IDLE", "OWNER")
        for r in rules:
            what = r.snapshot_id or ",".join(f"{k}={v}" for k, v in sorted(r.selector.labels.items())) or "all"
            p = r.policy
            idle = f"{p.standby_idle_seconds:.0f}s" if p.standby_idle_seconds is not None else "-"
            add_row(table, what, _knob(p.keep_warm), _knob(p.priority), idle, str(r.owner_uid))
        print_table(table)


def _knob(value: int | None) -> str:
    return "-" if value is None else str(value)


def print_ladder(ladder: Ladder, events: bool = True) -> None:
    """Workloads by rung, the budgets and (``events``) the latest moves, one a line (``park``; ``node`` without
    moves). A workload is named by its snapshot's name, else its id; no id is split over lines at 80 columns."""
    table = new_table("RUNG", "WORKLOAD", "ACT/SUSP/SB", "WARM", "PRIO", "HOST MEM")
    for column in table.columns:
        column.no_wrap = True
    for w in ladder.workloads:
        add_row(
            table,
            w.rung.value,
            w.name or w.snapshot_id,
            f"{w.active}/{w.suspended}/{w.standbys}",
            _knob(w.policy.keep_warm) if w.policy.keep_warm is not None else "0",
            _knob(w.policy.priority) if w.policy.priority is not None else "0",
            human_size(w.host_memory_bytes),
        )
    print_table(table)
    for w in ladder.workloads:  # a policy the ladder cannot meet now says why, here and not only in the log
        if w.note:
            console().print(safe(f"{w.name or w.snapshot_id}: {w.note}"), highlight=False, markup=False)
    budgets = new_table("BUDGET", "USED", "OF")
    for b in ladder.budgets:
        add_row(budgets, b.name, human_size(b.used_bytes), human_size(b.budget_bytes) if b.budget_bytes else "-")
    print_table(budgets)
    if events and ladder.events:
        names = {w.snapshot_id: w.name for w in ladder.workloads if w.name}
        out = console()
        out.print("MOVES (latest last)", highlight=False)
        for e in ladder.events[-10:]:
            when = e.time.astimezone(UTC).astimezone().strftime("%H:%M:%S")
            src = e.from_rung.value if e.from_rung else "new"
            dst = e.to_rung.value if e.to_rung else "deleted"
            line = f"{when} {names.get(e.snapshot_id, e.snapshot_id)} {src} -> {dst}: {e.reason}"
            out.print(safe(line), highlight=False, markup=False)


def _selector(snapshot: str, labels: tuple[str, ...]) -> dict[str, Any]:
    if bool(snapshot) == bool(labels):
        raise click.UsageError("name one SNAPSHOT or give --label KEY=VALUE (repeatable), not both")
    return {"snapshot": snapshot, "labels": parse_labels(labels)}


@park.command("set")
@command_options
@click.argument("snapshot", required=False, default="")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="every snapshot of yours with this label")
@click.option("--keep-warm", type=click.IntRange(0, 64), help="standbys kept ready")
@click.option("--priority", type=click.IntRange(-1000, 1000), help="budgets take from the lowest first")
@click.option("--standby-idle", type=click.FloatRange(0), help="seconds before a standby beyond keep-warm goes")
@click.pass_obj
def park_set(
    obj: Ctx,
    snapshot: str,
    labels: tuple[str, ...],
    keep_warm: int | None,
    priority: int | None,
    standby_idle: float | None,
) -> None:
    """Set the park policy of SNAPSHOT, or of your snapshots with --label (unset knobs inherit)."""
    selector = _selector(snapshot, labels)
    with obj.client() as client:
        rule = checked(
            lambda: client.set_policy(**selector, keep_warm=keep_warm, priority=priority, standby_idle_s=standby_idle)
        )
    if obj.output == "json":
        emit(rule)
    else:
        click.echo(f"policy set for {rule.snapshot_id or 'label ' + ','.join(labels)}")


@park.command("unset")
@click.argument("snapshot", required=False, default="")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="the label policy to remove")
@click.pass_obj
def park_unset(obj: Ctx, snapshot: str, labels: tuple[str, ...]) -> None:
    """Remove the park policy of SNAPSHOT (or of --label)."""
    selector = _selector(snapshot, labels)
    with obj.client() as client:
        checked(lambda: client.delete_policy(**selector))
    click.echo("policy removed")
