"""The disk tier's budget with a remote store below it, in process against the real gateway: only blobs
that are pushed, unpinned and whole in the bucket leave the node; a restore's fetch brings an evicted
blob back, refusing a damaged chunk by name. (The daemon end to end: test_disk_tier_restore.py.)"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import DataLossError, FailedPreconditionError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.remote import evict, layout
from gpusnap.daemon.remote.layout import Provenance, RemoteManifest
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.remote.transfer import Item, push_chunks
from gpusnap.daemon.store import SnapshotStore
from tests.daemon.remote.fleet import Fleet
from tests.daemon.store.test_store import _snapshot
from tests.lanes import SERIAL, drain

MIB = 1 << 20
BLOB = 20 * MIB  # two chunks: 16 MiB and 4 MiB


@pytest.fixture
def store(tmp_path: Path, remote: RemoteStore) -> Iterator[SnapshotStore]:
    s = SnapshotStore(  # room for one blob; wired as build_daemon wires it
        tmp_path / "store",
        disk_tier_bytes=BLOB + BLOB // 2,
        evictor=lambda store: evict.RemoteEvictor(store, remote),
        executor=SERIAL,
    )
    s.open()
    yield s
    s.close()


def _with_blob(store: SnapshotStore, fill: int) -> Snapshot:
    staged = store.buffers.stage(0, ["w"], [BLOB])
    os.pwrite(staged.memfds([0])[0], bytes([fill]) * (BLOB - 1) + b"\x00", 0)
    refs = staged.commit()
    try:
        with store.stage() as staging:
            (staging.images / "pages-1.img").write_bytes(bytes([fill]) * 4096)
            snap = dataclasses.replace(_snapshot(staging.snapshot_id, "", staging.images), buffers=tuple(refs))
            return store.publish(staging, snap)
    finally:
        staged.close()
        drain(store.buffers.jobs)


def _push(store: SnapshotStore, remote: RemoteStore, snap: Snapshot) -> None:
    """What a push does (operations.remote.run_push), without a daemon around it."""
    images = store.images_dir(snap.id)
    items = [Item(f.path, images / f.path, f.size_bytes) for f in snap.files]
    items += [Item("w", store.buffers.path(0, b.sha256), b.size_bytes, True) for b in snap.buffers]
    digests = [f.sha256 for f in snap.files] + [b.sha256 for b in snap.buffers]
    chunks, _ = push_chunks(remote.objects, remote.limits, items, digests, lambda done, total: None)
    n = len(snap.files)
    buffers = {b.sha256: c for b, c in zip(snap.buffers, chunks[n:], strict=True)}
    prov = Provenance("a", "now", "0", "x86_64", "k", "4.2.1", ())
    remote.publish(RemoteManifest(snap, prov, tuple(chunks[:n]), buffers))
    evict.write_record(store.snapshots_dir / snap.id, str(remote), buffers)


def _here(store: SnapshotStore, snap: Snapshot) -> bool:
    return not store.buffers.missing(0, snap.buffers)


def test_only_pushed_unpinned_whole_blobs_leave_and_a_fetch_brings_them_back(
    store: SnapshotStore, remote: RemoteStore, fleet: Fleet
) -> None:
    a, b = _with_blob(store, 1), _with_blob(store, 2)
    shared = _with_blob(store, 1)  # the same weights as a: the same blob, never pushed itself
    assert shared.buffers == a.buffers
    os.utime(store.buffers.path(0, a.buffers[0].sha256), (1, 1))  # a is the least recently used
    assert store.buffers.enforce_budgets() == 0 and _here(store, a) and _here(store, b), "nothing pushed: all stay"

    _push(store, remote, a)
    store.buffers.pin(0, [a.buffers[0].sha256])  # a restore reads it
    assert store.buffers.enforce_budgets() == 0 and _here(store, a), "pinned: stays"
    store.buffers.unpin(0, [a.buffers[0].sha256])

    chunk_keys = [f"{fleet.prefix}/{layout.chunk_key(c)}" for c in fleet.manifest(a.id)["buffers"][a.buffers[0].sha256]]
    tail = fleet.s3.get_object(Bucket=fleet.bucket, Key=chunk_keys[1])["Body"].read()
    fleet.s3.delete_object(Bucket=fleet.bucket, Key=chunk_keys[1])
    assert store.buffers.enforce_budgets() == 0 and _here(store, a), "a chunk missing in the bucket: stays"

    fleet.s3.put_object(Bucket=fleet.bucket, Key=chunk_keys[1], Body=tail)
    assert store.buffers.enforce_budgets() == BLOB
    assert not _here(store, a) and _here(store, b), "the pushed one went, the unpushed one stayed"
    assert store.buffers.tiers[-1].used_bytes() <= store.buffers.tiers[-1].budget_bytes
    assert evict.remote_only(store, remote) == (BLOB, 1)

    with pytest.raises(FailedPreconditionError) as no_remote:
        evict.plan(store, None, a)
    assert no_remote.value.reason == "REMOTE_NOT_CONFIGURED" and str(remote) in no_remote.value.message
    todo = evict.plan(store, remote, a)
    assert todo is not None and [r.sha256 for r in todo.refs] == [a.buffers[0].sha256]
    assert evict.plan(store, remote, b) is None, "nothing missing"
    via_a = evict.plan(store, remote, shared)
    assert via_a is not None and via_a.chunks == todo.chunks, "a shared blob comes back through a's record"

    fleet.s3.put_object(Bucket=fleet.bucket, Key=chunk_keys[1], Body=b"\x07" * len(tail))
    with pytest.raises(DataLossError) as damaged:
        evict.fetch(store, remote, todo, lambda done, total: None)
    assert damaged.value.reason == "REMOTE_CHUNK_CORRUPT" and chunk_keys[1].rsplit("/", 1)[1] in damaged.value.message
    assert not _here(store, a) and not any(store.buffers.pulling.iterdir()), "nothing half-fetched is kept"

    fleet.s3.put_object(Bucket=fleet.bucket, Key=chunk_keys[1], Body=tail)
    tally = evict.fetch(store, remote, todo, lambda done, total: None)
    assert tally.transferred_bytes == BLOB and _here(store, a)
    with open(store.buffers.path(0, a.buffers[0].sha256), "rb") as fh:
        assert fh.read() == bytes([1]) * (BLOB - 1) + b"\x00"
    assert evict.remote_only(store, remote) == (0, 0)
