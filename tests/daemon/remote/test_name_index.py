"""The remote store's name index, in process against the real gateway: names resolve per owner to the
newest snapshot reading one manifest, listing reads only the caller's entries and no manifest, and
garbage collection repairs what an interrupted publish or delete left."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.api.errors import NotFoundError
from gpusnap.daemon.api.types import ImageFile, Snapshot
from gpusnap.daemon.remote import layout
from gpusnap.daemon.remote.layout import Provenance, RemoteManifest
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.store import checksum
from gpusnap.daemon.store.store import new_snapshot_id
from tests.daemon.store.test_store import _snapshot

T0 = datetime(2026, 12, 1, tzinfo=UTC)


@pytest.fixture
def gets(remote: RemoteStore) -> Iterator[list[str]]:
    """The keys of the GET requests the store makes."""
    seen: list[str] = []

    def count(params: dict[str, Any], **_: Any) -> None:
        seen.append(params["Key"].split("/", 2)[2])  # the key under the prefix (gpusnap/test)

    remote.objects._s3.meta.events.register("provide-client-params.s3.GetObject", count)
    yield seen


def _doc(tmp: Path, uid: int, name: str, minutes: int) -> RemoteManifest:
    images = tmp / new_snapshot_id()
    images.mkdir()
    data = f"{uid}{name}{minutes}".encode()
    (images / "pages-1.img").write_bytes(data)
    snap: Snapshot = _snapshot(images.name, name, images)
    snap = dataclasses.replace(
        snap,
        owner_uid=uid,
        created=T0 + timedelta(minutes=minutes),
        source=dataclasses.replace(snap.source, uid=uid),
    )
    assert snap.files == (ImageFile("pages-1.img", len(data), checksum.combine([hashlib.sha256(data).digest()])),)
    return RemoteManifest(
        snap, Provenance("a", "now", "0", "x86_64", "k", "4.2.1", ()), ((hashlib.sha256(data).hexdigest(),),), {}
    )


def test_names_resolve_per_owner_from_the_index(remote: RemoteStore, gets: list[str], tmp_path: Path) -> None:
    old, new = _doc(tmp_path, 1000, "model", 1), _doc(tmp_path, 1000, "model", 2)
    theirs, unnamed = _doc(tmp_path, 2000, "model", 3), _doc(tmp_path, 1000, "", 4)
    for doc in (new, old, theirs, unnamed):
        assert remote.publish(doc)
    assert not remote.publish(new), "published already; its entry is put again"

    gets.clear()
    assert remote.find("model", 1000).snapshot.id == new.snapshot.id
    assert gets == [f"manifests/{new.snapshot.id}.json"], "one manifest read: the newest of that owner's name"
    assert remote.find("model", 2000).snapshot.id == theirs.snapshot.id
    assert remote.find("2000/model", 1000).snapshot.id == theirs.snapshot.id
    with pytest.raises(NotFoundError):
        remote.find("other", 1000)

    mine = remote.index.entries(1000)
    assert [e.snapshot_id for e in mine] == [old.snapshot.id, new.snapshot.id, unnamed.snapshot.id]
    assert len(remote.index.entries()) == 4
    gets.clear()
    listed = remote.index.read(mine)
    assert [s.id for s in listed] == [e.snapshot_id for e in mine] and listed[2].name == ""
    assert listed[1] == new.snapshot
    assert len(gets) == 3 and all(k.startswith("index/1000/") for k in gets), "only the owner's entries, no manifest"

    remote.delete(new.snapshot)
    assert remote.find("model", 1000).snapshot.id == old.snapshot.id, "the older one of the name remains"
    assert new.snapshot.id not in [e.snapshot_id for e in remote.index.entries(1000)]


def test_collection_repairs_an_interrupted_publish_and_delete(remote: RemoteStore, tmp_path: Path) -> None:
    halfway, forged = _doc(tmp_path, 1000, "half", 1), _doc(tmp_path, 1000, "gone", 2)
    remote.objects.put(layout.manifest_key(halfway.snapshot.id), halfway.to_bytes())  # died before its entry
    assert remote.index.entries(1000) == [] and remote.find(halfway.snapshot.id).snapshot.id == halfway.snapshot.id
    with pytest.raises(NotFoundError):
        remote.find("half", 1000)
    remote.index.put(forged.snapshot)  # an entry without a manifest
    assert [s.id for s in remote.index.read(remote.index.entries(1000))] == [forged.snapshot.id]
    with pytest.raises(NotFoundError):
        remote.find("gone", 1000)

    remote.collect_garbage(3600)
    assert remote.index.entries(1000) == [], "the entry without a manifest went; the young manifest waits"
    remote.collect_garbage(0)
    assert [e.snapshot_id for e in remote.index.entries(1000)] == [halfway.snapshot.id]
    assert remote.find("half", 1000).snapshot.id == halfway.snapshot.id
