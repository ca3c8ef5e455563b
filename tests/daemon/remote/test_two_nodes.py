"""Two nodes, one remote store (a real Ceph RADOS Gateway): node A dumps and pushes a real process
tree, node B pulls and restores it, and the tree carries on with its memory intact."""

from __future__ import annotations

import pytest

from gpusnap.daemon.api.errors import GpusnapError, ResourceExhaustedError
from gpusnap.daemon.client.values import OperationKind
from tests.conftest import Workloads, phase_seconds, wait_for
from tests.daemon.remote.fleet import Fleet, cli_json
from tests.daemon.test_json_schema import check
from tests.daemon.test_roundtrip import _check_alive_and_intact


def test_a_pushes_b_pulls_and_restores(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "48")
    dumped = cli_json(a, "dump", str(w.pid), "--name", "tree", "--label", "app=fleet")
    frozen_at = w.last("parent.log")

    pushed = cli_json(a, "push", "tree")
    check("push", pushed)
    assert pushed["id"] == dumped["id"] and pushed["remote"] == fleet.url
    assert pushed["transferred_bytes"] + pushed["skipped_bytes"] == dumped["size_bytes"]
    assert pushed["transferred_bytes"] > 8 << 20, "the tree's memory went up"
    assert list(phase_seconds(pushed)) == ["preflight", "upload", "publish"]
    assert set(fleet.keys("manifests/")) == {f"{fleet.prefix}/manifests/{dumped['id']}.json"}
    chunks = fleet.keys("chunks/")
    assert sum(chunks.values()) == pushed["transferred_bytes"], "each chunk stored once"

    again = cli_json(a, "push", dumped["id"])
    assert again["transferred_bytes"] == 0 and again["skipped_bytes"] == dumped["size_bytes"]
    # Issue 19 item 7: push and pull took no request_id; a retry with one now gets the same operation.
    with a.client() as client:
        first = client.push("tree", request_id="key-1")
        assert client.push("tree", request_id="key-1").id == first.id
        first.wait()
        other = client.pull("tree", request_id="key-1")  # a key is per kind of operation
        assert other.id != first.id and other.operation.kind is OperationKind.PULL
        other.wait()

    assert cli_json(b, "ls") == []
    remote = cli_json(b, "ls", "--remote", "--label", "app=fleet")
    check("ls", remote)
    assert [s["id"] for s in remote] == [dumped["id"]] and remote[0]["name"] == "tree"

    pulled = cli_json(b, "pull", "tree")
    check("pull", pulled)
    assert pulled["transferred_bytes"] == dumped["size_bytes"]
    assert list(phase_seconds(pulled)) == ["preflight", "download", "publish"]
    assert [s["id"] for s in cli_json(b, "ls")] == [dumped["id"]]
    assert cli_json(b, "pull", "tree")["transferred_bytes"] == 0, "pulled already: nothing moves"
    with b.client() as client:
        first = client.pull("tree", request_id="key-2")
        assert client.pull("tree", request_id="key-2").id == first.id
        first.wait()

    restored = cli_json(b, "restore", "tree")
    workloads.adopt(restored["pid"])
    wait_for(lambda: w.last("parent.log") > frozen_at, 10, "the tree did not carry on on node B")
    _check_alive_and_intact(w, restored["pid"])


def test_restore_of_a_remote_only_snapshot_pulls_it_first(fleet: Fleet, workloads: Workloads) -> None:
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "8", "--no-listener")
    dumped = cli_json(a, "dump", str(w.pid), "--push")
    check("dump", dumped)
    op = dumped["push_operation"]
    assert op.startswith("op-")
    waited = a.cli("wait", op, check=True).stdout
    assert f"{op} succeeded" in waited
    restored = cli_json(b, "restore", dumped["id"])
    workloads.adopt(restored["pid"])
    assert list(phase_seconds(restored))[:3] == ["preflight", "download", "publish"], restored["phases"]
    assert "restore" in phase_seconds(restored)
    frozen = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > frozen, 10, "the tree did not carry on on node B")


def test_a_remote_only_restore_takes_the_park_gpu_budget(fleet: Fleet, workloads: Workloads) -> None:
    """Issue 28: a restore of a snapshot only the remote store holds started on a path of its own and skipped the
    park GPU budget. Now it starts as a local one does: a snapshot whose GPU use is over node B's budget is
    refused at once (PARK_BUDGET), before anything is downloaded. (The tree here is a CPU one; its remote
    manifest is given a CUDA process of 64 MiB, as a GPU worker's would have.)"""
    a, b = fleet.node("a"), fleet.node("b", GPUSNAP_PARK_GPU_BYTES=str(32 << 20))
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    dumped = cli_json(a, "dump", str(w.pid), "--push")
    a.cli("wait", dumped["push_operation"], check=True)
    doc = fleet.manifest(dumped["id"])
    doc["snapshot"]["gpu_processes"] = [{"pid": w.pid, "gpu_uuids": ["GPU-0"], "gpu_memory_bytes": 64 << 20}]
    fleet.put_manifest(dumped["id"], doc)
    with pytest.raises(ResourceExhaustedError) as refused:
        b.client().restore(dumped["id"])
    assert refused.value.reason == "PARK_BUDGET" and "gpu_bytes" in refused.value.message, refused.value
    assert not list((b.store / "snapshots").iterdir()) and not b.client().list_operations(), (
        "nothing pulled, nothing ran"
    )


def test_without_a_remote_push_says_how_to_configure_one(daemon, workloads: Workloads) -> None:  # type: ignore[no-untyped-def]
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    snap = cli_json(daemon, "dump", str(w.pid))["id"]
    res = daemon.cli("push", snap)
    assert res.returncode == 4 and "--remote s3://BUCKET/PREFIX" in res.stderr, res.stderr
    res = daemon.cli("ls", "--remote")
    assert res.returncode == 4 and "no remote store" in res.stderr, res.stderr


def test_two_restores_of_a_remote_only_snapshot_share_one_download(fleet: Fleet, workloads: Workloads) -> None:
    """Issue 26, item 8: the second of two concurrent restores of a snapshot only the remote store holds was
    refused at once ("is being pulled by another operation"). Now it waits for the first's download, as
    concurrent pulls of one container image do, and restores: both succeed and the snapshot is fetched once."""
    a, b = fleet.node("a"), fleet.node("b")
    w = workloads.start("--mem-mb", "64", "--no-listener", "--no-child")
    dumped = cli_json(a, "dump", str(w.pid), "--push")
    a.cli("wait", dumped["push_operation"], check=True)
    client = b.client()
    started = [client.restore(dumped["id"], private_network=True) for _ in range(2)]
    for op in started:
        try:
            op.wait(timeout_s=300)
        except GpusnapError:
            pass
    done = [op.get() for op in started]
    for op in done:
        if op.restore is not None:
            workloads.adopt(op.restore.pid)
    for op in done:
        assert op.error is None, op.error
    downloads = [sum(p.bytes for p in op.phases if p.phase == "download") for op in done]
    assert sorted(d > 0 for d in downloads) == [False, True], f"fetched {downloads} bytes: once, by one of them"
    assert sum(downloads) >= 64 << 20
