"""``node`` and ``store``: facts about the node and its store."""

from __future__ import annotations

import click

from gpusnap.daemon.cli.app import Ctx, checked, main, output_option
from gpusnap.daemon.cli.output import add_row, emit, human_size, new_table, print_table


@main.command()
@output_option
@click.pass_obj
def node(obj: Ctx) -> None:
    """Show facts about the node: versions, store, GPUs."""
    with obj.client() as client:
        info = checked(client.node_info)
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
        ("store", f"{info.store_path}: {info.snapshot_count} snapshots, {human_size(info.store_used_bytes)}"),
        ("remote", info.remote or "-"),
        ("cpu", h.cpu_model),
        ("nvidia driver", h.nvidia_driver_version or "-"),
        ("cuda checkpoint", "supported" if info.cuda_checkpoint_supported else (info.cuda_unavailable_reason or "-")),
        ("gpu prefill", info.gpu_prefill or "off"),
    ):
        add_row(table, key, value)
    print_table(table)
    if info.gpus:
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


@main.command()
@output_option
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
            )
        )
        return
    click.echo(
        f"store {info.store_path}: {info.snapshot_count} snapshots, {human_size(info.store_used_bytes)}"
        f"; remote {info.remote or '-'}"
    )
    table = new_table("TIER", "PATH", "USED", "BUDGET", "FREE", "BLOBS")
    for t in info.tiers:
        table.add_row(
            t.name,
            t.path,
            human_size(t.used_bytes),
            human_size(t.budget_bytes) if t.budget_bytes else "-",
            human_size(t.free_bytes) if t.name != "remote" else "-",
            str(t.blobs),
        )
    print_table(table)
