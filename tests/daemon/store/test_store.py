"""SnapshotStore: staging, atomic publish, names, listing and damage handling."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import (
    AbortedError,
    AlreadyExistsError,
    DataLossError,
    FailedPreconditionError,
    NotFoundError,
)
from gpusnap.daemon.api.types import ArenaLayout, BufferRef, HostFacts, ProcessFacts, Snapshot, WorkerInfo
from gpusnap.daemon.store import SnapshotStore, checksum, manifest
from tests.lanes import LANES


def _snapshot(snapshot_id: str, name: str, images: Path) -> Snapshot:
    return Snapshot(
        id=snapshot_id,
        name=name,
        created=datetime.now(UTC),
        labels={"k": "v"},
        source=ProcessFacts(pid=42, comm="x", cmdline=("x",), uid=0, gid=0, tree_pids=(42,), rss_bytes=1, cwd="/"),
        host=HostFacts(
            hostname="h",
            kernel="k",
            machine="x86_64",
            criu_version="4.2.1",
            gpusnap_version="0",
            cpu_model="cpu",
            cpu_flags=("sse",),
        ),
        files=checksum.image_files(images, LANES.digest),
        phases=(),
        owner_uid=0,
    )


def _publish(store: SnapshotStore, name: str = "", content: bytes = b"pages") -> Snapshot:
    with store.stage(name) as staging:
        (staging.images / "pages-1.img").write_bytes(content)
        return store.publish(staging, _snapshot(staging.snapshot_id, name, staging.images))


def test_publish_list_get_delete(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s", executor=LANES)
    store.open()
    snap = _publish(store, "alpha")
    assert [s.id for s in store.list()] == [snap.id]
    assert store.get("alpha") == store.get(snap.id) == snap
    assert store.list({"k": "v"}) and not store.list({"k": "other"})
    assert (tmp_path / "s").stat().st_mode & 0o777 == 0o700
    store.verify(snap)
    assert store.delete("alpha") == snap.id
    with pytest.raises(NotFoundError):
        store.get(snap.id)


def test_failed_staging_leaves_nothing(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s", executor=LANES)
    store.open()
    with pytest.raises(RuntimeError):
        with store.stage("beta") as staging:
            (staging.images / "pages-1.img").write_bytes(b"half")
            raise RuntimeError("dump failed")
    assert store.list() == [] and list(store.staging_dir.iterdir()) == []
    _publish(store, "beta")  # the name was released


def test_names_are_reserved_while_staging(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s", executor=LANES)
    store.open()
    with store.stage("gamma"):
        with pytest.raises(AlreadyExistsError):
            store.check_name_free("gamma")
        with pytest.raises(AlreadyExistsError):
            with store.stage("gamma"):
                pass


def test_store_lock_and_leftovers(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s", executor=LANES)
    store.open()
    other = SnapshotStore(tmp_path / "s", executor=LANES)
    with pytest.raises(FailedPreconditionError):
        other.open()
    store.close()
    (store.staging_dir / "snap-x").mkdir()
    other.open()
    assert list(other.staging_dir.iterdir()) == []


def test_manifest_round_trip_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    snap = _snapshot("snap-" + "a" * 26, "n", tmp_path / "img")
    assert manifest.from_json(manifest.to_json(snap)) == snap
    doc = manifest.to_json(snap)
    with pytest.raises(DataLossError):
        manifest.from_json({**doc, "manifest_version": 99})
    with pytest.raises(DataLossError):
        manifest.from_json({**doc, "digest_algorithm": "md5"})
    with pytest.raises(DataLossError):
        manifest.from_json({k: v for k, v in doc.items() if k != "source"})


def test_manifest_keeps_arena_layouts_and_reads_older_ones_without(tmp_path: Path) -> None:
    (tmp_path / "img").mkdir()
    base = _snapshot("snap-" + "b" * 26, "n", tmp_path / "img")
    layout = ArenaLayout("GPU-00000000-1111-4222-8333-000000000000", 4 << 20, 2 << 20, (2 << 20, 2 << 20), 1)
    snap = dataclasses.replace(
        base,
        worker=WorkerInfo(engine="torch", instance_id="i", arenas=(layout,)),
        buffers=(BufferRef("w", 3 << 20, "d" * 64, "", arena=1, arena_offset=512),),
    )
    assert manifest.from_json(json.loads(json.dumps(manifest.to_json(snap)))) == snap
    old = json.loads(json.dumps(manifest.to_json(snap)))
    del old["worker"]["arenas"]
    for b in old["buffers"]:
        del b["arena"], b["arena_offset"]
    back = manifest.from_json(old)
    assert back.worker is not None and back.worker.arenas == () and back.buffers[0].arena == 0


def test_unfinished_pulls_expire_after_their_grace_never_while_in_flight(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", pull_grace_s=3600, executor=LANES)
    store.open()
    old, young, fetch = "snap-" + "a" * 26, "snap-" + "b" * 26, "snap-" + "c" * 26 + ".fetch-0123abcd"
    for d in (store.pulls_dir / old / "images", store.pulls_dir / young / "images", store.buffers.pulling / old):
        d.mkdir(parents=True)
        (d / "part").write_bytes(b"x")
    (store.buffers.pulling / fetch).mkdir()
    for p in (store.pulls_dir / old, store.pulls_dir / old / "images", store.pulls_dir / old / "images" / "part"):
        os.utime(p, (1, 1))
    for p in (store.buffers.pulling / old, store.buffers.pulling / old / "part"):
        os.utime(p, (1, 1))
    store.close()

    store.open()  # at start: the old pull and the restore's fetch go, the young pull stays for its retry
    try:
        assert sorted(p.name for p in store.pulls_dir.iterdir()) == [young]
        assert list(store.buffers.pulling.iterdir()) == []
        assert store.list() == []
        os.utime(store.pulls_dir / young / "images" / "part", (1, 1))
        os.utime(store.pulls_dir / young / "images", (1, 1))
        os.utime(store.pulls_dir / young, (1, 1))
        with store.pulling(young):
            assert store.expire_pulls() == [], "in flight: kept whatever its age"
            with pytest.raises(AbortedError) as busy:
                with store.pulling(young):
                    pass
            assert busy.value.reason == "SNAPSHOT_BUSY"
        assert store.expire_pulls() == [young]
    finally:
        store.close()
