"""``node`` and ``store``: facts about the node and its store."""

from __future__ import annotations

import click

from gpusnap.daemon.cli.app import Ctx, checked, command_options, main
from gpusnap.daemon.cli.output import add_row, count, emit, human_size, new_table, print_table, wide


@main.command()
@command_options
@click.pass_obj
def node(obj: Ctx) -> None:
    """Show facts about the node: versions, store, GPUs."""
    with obj.client() as client:
        info = checked(client.node_info)
        ladder = None if obj.output == "json" else checked(client.ladder)
    if obj.output == "json":
        emit(info)
        return
    h = info.host
    table = new_table(show_header=False)
    for key, value in (
        ("host", f"{h.hostname} ({h.machine})"),
        ("kernel", h.kernel),
        ("gpusnap", h.gpusnap_version),
        ("criu", f"{h.criu_version} ({info.criu_path})"),
        ("store", f"{info.store_path}: {count(info.snapshot_count, 'snapshot')}, {human_size(info.store_used_bytes)}"),
        ("remote", info.remote or "-"),
        ("cpu", h.cpu_model),
        ("nvidia driver", h.nvidia_driver_version or "-"),
        ("cuda checkpoint", "supported" if info.cuda_checkpoint_supported else (info.cuda_unavailable_reason or "-")),
        ("page fill", info.page_fill or "-"),
        ("gpu prefill", info.gpu_prefill.summary()),
        ("standbys", f"{info.standbys}, {human_size(info.standby_host_memory_bytes)} of host memory"),
    ):
        add_row(table, key, value)
    if not wide():  # one folded row per GPU: a UUID alone is 40 columns
        for g in info.gpus:
            add_row(
                table,
                f"gpu {g.index}",
                f"{g.name}, {g.uuid}, {human_size(g.memory_free_bytes)} free of {human_size(g.memory_total_bytes)}, "
                f"persistence {'on' if g.persistence_mode else 'off'}, MIG {'on' if g.mig_mode else 'off'}, "
                f"processes {', '.join(str(p.pid) for p in g.processes) or '-'}",
            )
    print_table(table)
    if info.gpus and wide():
        gpus = new_table("IDX", "UUID", "NAME", "MEMORY FREE/TOTAL", "PERSISTENCE", "MIG", "PROCESSES")
        for g in info.gpus:
            add_row(
                gpus,
                str(g.index),
                g.uuid,
                g.name,
                f"{human_size(g.memory_free_bytes)} / {human_size(g.memory_total_bytes)}",
                "on" if g.persistence_mode else "off",
                "on" if g.mig_mode else "off",
                ", ".join(str(p.pid) for p in g.processes) or "-",
            )
        print_table(gpus)
    if ladder is not None and ladder.workloads:  # the park ladder (`gpusnap park`)
        from gpusnap.daemon.cli.park import print_ladder

        print_ladder(ladder, events=False)


@main.command()
@command_options
@click.pass_obj
def store(obj: Ctx) -> None:
    """Show the store: snapshots, the buffer tiers' use and budgets, the remote store."""
    with obj.client() as client:
        info = checked(client.node_info)
    if obj.output == "json":
        from gpusnap.daemon.cli.documents import StoreReport

        emit(
            StoreReport(
                store_path=info.store_path,
                snapshot_count=info.snapshot_count,
                store_used_bytes=info.store_used_bytes,
                remote=info.remote,
                tiers=info.tiers,
                unfinished_pulls=info.unfinished_pulls,
                unfinished_pull_bytes=info.unfinished_pull_bytes,
            )
        )
        return
    summary = new_table(show_header=False)
    add_row(summary, "store", info.store_path)
    add_row(summary, "", f"{count(info.snapshot_count, 'snapshot')}, {human_size(info.store_used_bytes)}")
    add_row(summary, "remote", info.remote or "-")
    if info.unfinished_pulls:
        add_row(
            summary,
            "pulling",
            f"{count(info.unfinished_pulls, 'unfinished pull')}, {human_size(info.unfinished_pull_bytes)} "
            "(pull again to resume)",
        )
    print_table(summary)
    roomy = wide()  # narrower, the paths get a table of their own: a folded path beside the sizes is unreadable
    table = new_table("TIER", *(("PATH",) if roomy else ()), "USED", "BUDGET", "FREE", "BLOBS")
    for t in info.tiers:
        add_row(
            table,
            t.name,
            *((t.path,) if roomy else ()),
            human_size(t.used_bytes),
            human_size(t.budget_bytes) if t.budget_bytes else "-",
            human_size(t.free_bytes) if t.name != "remote" else "-",
            str(t.blobs),
        )
    print_table(table)
    if not roomy:
        paths = new_table("TIER", "PATH")
        for t in info.tiers:
            add_row(paths, t.name, t.path)
        click.echo()
        print_table(paths)
