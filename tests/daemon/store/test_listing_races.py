"""Issue 26, item 10: the store's directories are read while other lanes delete from them.

The garbage collector and eviction remove blobs and empty user directories, ``rm`` removes snapshots, a pull
removes its work; ``gpusnap store`` and ``node`` read the same directories meanwhile. A name listed and gone
before it was stat'ed failed the reader (``store/tiers.py`` ``used_bytes``: FileNotFoundError, a traceback in
a CI run); an eviction that made a user directory the collector removed before its rename failed too. Here
threads churn real directories as those lanes do while the readers run; before, each reader failed within
a few hundred rounds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from gpusnap.daemon.store import SnapshotStore, listing
from gpusnap.daemon.store.tiers import Tier, TierUsage, eviction_order, move
from tests.lanes import LANES

ROUNDS = 400


@contextlib.contextmanager
def _churning(step: Callable[[int], None]) -> Iterator[None]:
    """Run ``step(n)`` for n = 0, 1, … in a thread until the block ends."""
    done = threading.Event()
    failures: list[BaseException] = []

    def loop() -> None:
        n = 0
        while not done.is_set():
            try:
                step(n)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)
                return
            n += 1

    thread = threading.Thread(target=loop)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads between nearly every bytecode, as two cores would run them
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not failures, failures


def _collector(tier: Tier) -> Callable[[int], None]:
    """A blob written into a user directory, then removed with it, as the garbage collector does."""

    def step(n: int) -> None:
        user = tier.blobs / str(n % 3)
        user.mkdir(exist_ok=True)
        blob = user / f"{n:064x}"
        blob.write_bytes(b"x" * 64)
        blob.unlink()
        with contextlib.suppress(OSError):
            user.rmdir()

    return step


def test_tier_usage_and_eviction_order_while_blobs_and_user_directories_go(tmp_path: Path) -> None:
    tier = Tier("ram", tmp_path / "ram")
    tier.blobs.mkdir(parents=True)
    (tier.blobs / "7").mkdir()
    (tier.blobs / "7" / ("a" * 64)).write_bytes(b"kept")
    with _churning(_collector(tier)):
        for _ in range(ROUNDS):
            assert tier.used_bytes() >= 4
            assert TierUsage.of(tier).blobs >= 1
            assert ("7/" + "a" * 64) in [k for k, _, _ in eviction_order(tier, set())]


def test_store_use_while_snapshots_and_pulls_are_removed(tmp_path: Path) -> None:
    """``SnapshotStore.used_bytes`` and ``unfinished_pulls`` (``gpusnap node``, ``store``) sum what ``rm`` or a
    finishing pull removes meanwhile."""
    store = SnapshotStore(tmp_path / "s", executor=LANES)
    store.open()
    try:
        (store.snapshots_dir / "kept" / "images").mkdir(parents=True)
        (store.snapshots_dir / "kept" / "images" / "pages-1.img").write_bytes(b"p" * 100)

        def rm(n: int) -> None:
            for top in (store.snapshots_dir, store.pulls_dir):
                images = top / f"snap-{n % 4}" / "images"
                images.mkdir(parents=True, exist_ok=True)
                for i in range(20):
                    (images / f"pages-{i}.img").write_bytes(b"p" * 10)
                shutil.rmtree(images.parent)

        with _churning(rm):
            for _ in range(ROUNDS):
                assert store.used_bytes() >= 100
                store.unfinished_pulls()
    finally:
        store.close()


def test_an_eviction_moves_a_blob_while_the_collector_removes_empty_user_directories(tmp_path: Path) -> None:
    ram, disk = Tier("ram", tmp_path / "ram"), Tier("disk", tmp_path / "disk")
    for t in (ram, disk):
        t.blobs.mkdir(parents=True)
        t.incoming.mkdir()

    lock = threading.Lock()  # the buffer store's: its collector removes empty user directories under it

    def collect(_n: int) -> None:
        with lock:
            for user in listing.entries(disk.blobs):
                with contextlib.suppress(OSError):
                    user.rmdir()

    with _churning(collect):
        for n in range(ROUNDS):
            key = f"5/{n:064x}"
            src = ram.blobs / key
            src.parent.mkdir(exist_ok=True)
            src.write_bytes(b"blob")
            assert move(key, src, disk, guard=lock)
            assert (disk.blobs / key).read_bytes() == b"blob"
            os.unlink(disk.blobs / key)
