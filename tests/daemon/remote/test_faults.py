"""Faults on the way between nodes, against the real gateway: a daemon killed mid-push and mid-pull, the
gateway stopped mid-transfer, a damaged remote chunk, an incompatible node, and garbage collection."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.client import OperationHandle
from gpusnap.daemon.client.values import EventType
from tests.conftest import DaemonProc, Workloads, stop_daemon, wait_for
from tests.daemon.remote.fleet import Fleet, cli_json

MEM_MB = 160


def _interrupt_after_progress(d: DaemonProc, op: OperationHandle, action: object) -> None:
    """Follow ``op`` until it has moved some but not all bytes, then run ``action``."""
    with d.client() as client:
        try:
            for event in client.watch(op.id):
                if event.type is EventType.PROGRESS and 0 < event.bytes < event.total_bytes:
                    action()  # type: ignore[operator]
                    break
                assert event.type is not EventType.OPERATION_FINISHED, "finished before the fault"
        except GpusnapError:
            pass


def _start(d: DaemonProc, verb: str, ref: str) -> OperationHandle:
    with d.client() as client:
        return client.push(ref) if verb == "push" else client.pull(ref)


def test_daemon_killed_mid_push_and_mid_pull_lists_nothing_and_a_retry_resumes(
    fleet: Fleet, workloads: Workloads
) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", str(MEM_MB), "--random", "--no-listener")
    snap = cli_json(a, "dump", str(w.pid))
    _interrupt_after_progress(a, _start(a, "push", snap["id"]), lambda: fleet.kill(a))
    assert fleet.keys("chunks/"), "some chunks went up before the kill"
    assert not fleet.keys("manifests/") and cli_json(b, "ls", "--remote") == [], "no partial snapshot is listed"

    a = fleet.node("a")  # same store: the local snapshot survived the kill
    assert [s["id"] for s in cli_json(a, "ls")] == [snap["id"]]
    pushed = cli_json(a, "push", snap["id"])
    assert pushed["skipped_bytes"] > 0 and pushed["transferred_bytes"] + pushed["skipped_bytes"] == snap["size_bytes"]

    _interrupt_after_progress(b, _start(b, "pull", snap["id"]), lambda: fleet.kill(b))
    b = fleet.node("b")
    assert cli_json(b, "ls") == [], "a half-pulled snapshot is not listed"
    store = cli_json(b, "store")  # issue 19 item 7: what it holds is shown
    assert store["unfinished_pulls"] == 1 and store["unfinished_pull_bytes"] > 0, store
    pulled = cli_json(b, "pull", snap["id"])
    assert pulled["skipped_bytes"] > 0, "the retry kept the chunks the first pull had written"
    assert pulled["transferred_bytes"] + pulled["skipped_bytes"] == snap["size_bytes"]
    assert not list((b.store / "pulls").iterdir()), "the pull's work directory went with its publish"
    assert cli_json(b, "store")["unfinished_pulls"] == 0

    c = fleet.node("c", GPUSNAP_PULL_GRACE="0")  # unfinished pulls expire at once
    _interrupt_after_progress(c, _start(c, "pull", snap["id"]), lambda: fleet.kill(c))
    assert list((c.store / "pulls").iterdir()), "the killed pull left its work directory"
    c = fleet.node("c", GPUSNAP_PULL_GRACE="0")
    assert not list((c.store / "pulls").iterdir()) and not list((c.store / "buffers" / "pulling").iterdir())
    assert cli_json(c, "ls") == [], "expired at start, never listed"

    frozen = w.last("parent.log")
    restored = cli_json(b, "restore", snap["id"])
    workloads.adopt(restored["pid"])
    wait_for(lambda: w.last("parent.log") > frozen, 10, "the restored tree did not carry on")
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_for(lambda: (w.workdir / "sha_now").exists(), 20, "memory was not re-hashed")
    assert w.read("sha_now") == w.read("expected_sha")


def test_a_pull_that_runs_out_of_room_gives_it_back(fleet: Fleet, workloads: Workloads) -> None:
    """Issue 19 item 7: a pull that filled the disk mid-download left its partial work for pull_grace (24 h),
    which `gpusnap store` did not show. Node B's store is a 40 MiB tmpfs; two pulls of 24 MiB snapshots
    start at once, each fitting the free space alone (files are sparse until written), so at least one runs
    out of room while it downloads."""
    a = fleet.node("a")
    ids = []
    for _ in range(2):
        w = workloads.start("--mem-mb", "24", "--random", "--no-listener", "--no-child")
        ids.append(cli_json(a, "dump", str(w.pid))["id"])
        cli_json(a, "push", ids[-1])
    store = fleet.tmp / "b" / "store"
    store.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(store)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    b = None
    try:
        b = fleet.node("b")
        with b.client() as client:
            ops = [client.pull(i) for i in ids]
            for op in ops:
                try:
                    op.wait()
                except GpusnapError:
                    pass
            failed = [client.get_operation(op.id) for op in ops]
        full = [op for op in failed if op.error is not None and op.error.reason == "STORE_FULL"]
        assert any(op.phase == "download" for op in full), [(op.phase, op.error) for op in failed]
        assert not list((store / "pulls").iterdir()) and not list((store / "buffers" / "pulling").iterdir())
        assert cli_json(b, "store")["unfinished_pulls"] == 0
    finally:
        if b is not None:  # before its store goes
            stop_daemon(b)
        subprocess.run(["umount", "-l", str(store)])


def test_gateway_stopped_mid_transfer_is_a_clear_error_and_nothing_is_lost(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", str(MEM_MB), "--random", "--no-listener", "--no-child")
    snap = cli_json(a, "dump", str(w.pid))
    op = _start(a, "push", snap["id"])
    try:
        _interrupt_after_progress(a, op, fleet.gw.stop_rgw)
        res = a.cli("wait", op.id)
    finally:
        fleet.gw.start_rgw()
    assert res.returncode == 7 and "cannot be reached" in res.stderr and "try again" in res.stderr, res.stderr
    assert [s["id"] for s in cli_json(a, "ls")] == [snap["id"]], "the local snapshot is intact"
    assert not fleet.keys("manifests/")
    cli_json(a, "push", snap["id"])

    op = _start(b, "pull", snap["id"])
    try:
        _interrupt_after_progress(b, op, fleet.gw.stop_rgw)
        res = b.cli("wait", op.id)
    finally:
        fleet.gw.start_rgw()
    assert res.returncode == 7 and "cannot be reached" in res.stderr, res.stderr
    assert cli_json(b, "ls") == []
    assert cli_json(b, "pull", snap["id"])["skipped_bytes"] > 0


def test_a_damaged_remote_chunk_is_refused_and_named(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "16", "--random", "--no-listener", "--no-child")
    snap = cli_json(a, "dump", str(w.pid))
    cli_json(a, "push", snap["id"])
    key, size = max(fleet.keys("chunks/").items(), key=lambda kv: kv[1])
    fleet.s3.put_object(Bucket=fleet.bucket, Key=key, Body=b"\0" * size)  # same size, other bytes
    res = b.cli("pull", snap["id"])
    digest = key.rsplit("/", 1)[1]
    assert res.returncode == 4 and digest in res.stderr and "damaged" in res.stderr, res.stderr
    assert cli_json(b, "ls") == []
    res = b.cli("restore", snap["id"])
    assert res.returncode == 4 and digest in res.stderr, "a restore that pulls first refuses it too"


def test_the_compatibility_gate_lists_every_difference(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    snap = cli_json(a, "dump", str(w.pid))
    cli_json(a, "push", snap["id"])
    doc = fleet.manifest(snap["id"])
    doc["provenance"].update(
        kernel="9.9.9-elsewhere",
        criu_version="99.0",
        gpu_model="NVIDIA H200",
        gpu_count=2,
        driver_major="999",
        cpu_flags=doc["provenance"]["cpu_flags"] + ["avx1024", "amx_fp4"],
    )
    fleet.put_manifest(snap["id"], doc)
    for cmd in (("pull", snap["id"]), ("restore", snap["id"])):
        res = b.cli(*cmd)
        assert res.returncode == 4, res.stderr
        for needle in (
            "kernel 9.9.9-elsewhere",
            "CRIU 99.0 or newer",
            "2 x NVIDIA H200",
            "NVIDIA driver 999.x",
            "CPU flags missing here: amx_fp4 avx1024",
        ):
            assert needle in res.stderr, (needle, res.stderr)
    assert cli_json(b, "ls") == []


def test_unsafe_remote_manifests_are_refused(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    snap = cli_json(a, "dump", str(w.pid))
    cli_json(a, "push", snap["id"])
    doc = fleet.manifest(snap["id"])
    doc["snapshot"]["files"][0]["path"] = "../../../etc/cron.d/evil"
    fleet.put_manifest(snap["id"], doc)
    res = b.cli("pull", snap["id"])
    assert res.returncode == 4 and "unsafe file path" in res.stderr, res.stderr
    assert not (b.store.parent / "etc").exists()
    # Issue 19 item 7: the error's advice could not be followed (rm --remote read the same manifest and
    # failed the same way); it now removes the unusable manifest and its index entry.
    advice = f"gpusnap rm --remote {snap['id']}"
    assert advice in res.stderr, res.stderr
    res = b.cli(*advice.split()[1:])
    assert res.returncode == 0, res.stderr
    assert cli_json(b, "ls", "--remote") == [] and not fleet.keys("manifests/") and not fleet.keys("index/")


def test_remote_rm_collects_only_unreferenced_chunks_past_the_grace_period(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    snaps = []
    for _ in range(3):
        w = workloads.start("--mem-mb", "20", "--random", "--no-listener", "--no-child")
        snaps.append(cli_json(a, "dump", str(w.pid))["id"])
        cli_json(a, "push", snaps[-1])
    x, y, z = snaps
    every = set(fleet.keys("chunks/"))
    cli_json(a, "rm", "--remote", x)  # default grace (an hour): nothing is old enough to go
    assert set(fleet.keys("chunks/")) == every
    assert {s["id"] for s in cli_json(b, "ls", "--remote")} == {y, z}

    eager = fleet.node("c", GPUSNAP_REMOTE_GC_GRACE="0")
    cli_json(eager, "rm", "--remote", z)
    live = {f"{fleet.prefix}/chunks/{d[:2]}/{d}" for c in fleet.manifest(y)["files"] for d in c}
    assert set(fleet.keys("chunks/")) == live, "x's and z's own chunks went, every chunk y needs stayed"
    pulled = cli_json(b, "pull", y)
    assert pulled["transferred_chunks"] > 0
    res = b.cli("pull", x)
    assert res.returncode == 3 and "gpusnap ls --remote" in res.stderr, res.stderr


@pytest.mark.parametrize("url", ["s3://A/x", "s3://ok-bucket/../x", "http://bucket/x"])
def test_bad_remote_urls_are_refused_at_start(tmp_path, url: str) -> None:  # type: ignore[no-untyped-def]
    from tests.conftest import start_daemon

    d = start_daemon(tmp_path, extra_env={"GPUSNAP_REMOTE": url})
    assert d.proc.wait(timeout=30) == 2
    assert "s3://BUCKET/PREFIX" in d.log.read_text()
