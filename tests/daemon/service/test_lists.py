"""Lists: paged (AIP-158), never past gRPC's 4 MiB message limit, filtered by owner from an in-memory index.

Reproduces "140 label-heavy snapshots broke `gpusnap ls`": one real snapshot is cloned (images hard-linked,
manifest rewritten with a new id, 64 long labels and, for some, another owner) while the daemon is down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import grpc
import pytest

from gpusnap.daemon._proto import snapshots_pb2, snapshots_pb2_grpc
from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.store import manifest
from gpusnap.daemon.store.store import new_snapshot_id
from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon

NOBODY = 65534
COPIES = 170  # 64 labels of ~380 bytes each: ~25 KiB a snapshot, ~4.3 MiB in all
LABELS = {f"team.example.com/key-{i:03d}-{'k' * 100}": "v" * 256 for i in range(64)}


def _clone(store: Path, snap_id: str, copies: int, owner_every: int) -> list[str]:
    """Copies of a published snapshot with heavy labels; every ``owner_every``-th belongs to NOBODY."""
    src = store / "snapshots" / snap_id
    original = manifest.read(src)
    ids = []
    for n in range(copies):
        new_id = new_snapshot_id()
        dst = store / "snapshots" / new_id
        shutil.copytree(src / "images", dst / "images", copy_function=os.link)
        owner = NOBODY if owner_every and n % owner_every == 0 else original.owner_uid
        clone = dataclasses.replace(
            original,
            id=new_id,
            name="",
            labels={**LABELS, "n": str(n)},
            owner_uid=owner,
            created=original.created + timedelta(milliseconds=n + 1),
            source=dataclasses.replace(original.source, uid=owner),
        )
        manifest.write(dst, clone)
        ids.append(new_id)
    return ids


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One daemon over the clones, shared by this module's tests (the last one deletes a snapshot)."""
    tmp = tmp_path_factory.mktemp("lists")
    os.chmod(tmp, 0o755)
    workloads = Workloads(tmp)
    d = start_daemon(tmp, extra_env={"GPUSNAP_SOCKET_GROUP": "nogroup"})
    try:
        w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        first = json.loads(d.cli("-o", "json", "dump", str(w.pid), check=True).stdout)["id"]
    finally:
        stop_daemon(d)
        workloads.cleanup()
    ids = [first, *_clone(d.store, first, COPIES, owner_every=10)]
    d = start_daemon(tmp, extra_env={"GPUSNAP_SOCKET_GROUP": "nogroup"})
    assert d.alive(), d.log.read_text()
    yield d, ids
    stop_daemon(d)


def test_label_heavy_list_pages_under_the_message_limit(many: tuple[DaemonProc, list[str]]) -> None:
    d, ids = many
    res = d.cli("-o", "json", "ls", check=True)
    assert [s["id"] for s in json.loads(res.stdout)] == ids, "every snapshot, oldest first, across pages"
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        stub = snapshots_pb2_grpc.SnapshotServiceStub(ch)
        first = stub.ListSnapshots(snapshots_pb2.ListSnapshotsRequest(page_size=1000), timeout=30)
        assert first.next_page_token, "a full page past 2 MiB is cut short"
        assert first.ByteSize() < 4 * 2**20 and len(first.snapshots) < len(ids)
        small = stub.ListSnapshots(snapshots_pb2.ListSnapshotsRequest(page_size=7), timeout=30)
        assert [s.id for s in small.snapshots] == ids[:7]
    paged = [s.id for s in d.client().list_snapshots(page_size=7)]
    assert paged == ids
    assert [s.id for s in d.client().list_snapshots({"n": "50"})] == [ids[51]]


def test_users_list_only_their_own(many: tuple[DaemonProc, list[str]]) -> None:
    d, ids = many
    theirs = [i for n, i in enumerate(ids[1:]) if n % 10 == 0]
    listed = json.loads(d.cli("-o", "json", "ls", user=NOBODY, check=True).stdout)
    assert [s["id"] for s in listed] == theirs
    assert all(s["owner_uid"] == NOBODY for s in listed)


def test_page_boundary_survives_a_delete(  # last: it deletes a snapshot of the shared daemon
    many: tuple[DaemonProc, list[str]],
) -> None:
    d, ids = many
    with grpc.insecure_channel(f"unix:{d.socket}") as ch:
        stub = snapshots_pb2_grpc.SnapshotServiceStub(ch)
        page = stub.ListSnapshots(snapshots_pb2.ListSnapshotsRequest(page_size=5), timeout=30)
        d.client().delete_snapshot(ids[4])  # the item the token names
        rest = stub.ListSnapshots(
            snapshots_pb2.ListSnapshotsRequest(page_size=5, page_token=page.next_page_token), timeout=30
        )
    assert [s.id for s in rest.snapshots] == ids[5:10]


@pytest.mark.parametrize("token", ["garbage", "x" * 500, "MTIzLnNuYXAtLi4vZXRj", "\u00e9"])
def test_forged_page_tokens_are_refused(daemon: DaemonProc, token: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        daemon.client()._call(
            daemon.client()._snaps.ListSnapshots, snapshots_pb2.ListSnapshotsRequest(page_token=token)
        )
    assert err.value.reason == "INVALID_PAGE_TOKEN" and token not in err.value.message
    with pytest.raises(InvalidArgumentError) as err:
        daemon.client()._call(daemon.client()._snaps.ListSnapshots, snapshots_pb2.ListSnapshotsRequest(page_size=-1))
    assert err.value.reason == "INVALID_PAGE_SIZE"
