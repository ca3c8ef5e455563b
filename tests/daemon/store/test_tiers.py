"""The buffer store's tiers on real directories: new blobs go to the RAM tier, the least recently used
unpinned ones move to the disk tier when the RAM tier is over its budget, reads find the fastest copy,
and buffers bigger than every budget are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.api.errors import ResourceExhaustedError
from gpusnap.daemon.store.buffers import BufferStore
from tests.lanes import SERIAL, drain

MIB = 1 << 20


def _store(tmp: Path, ram: int, disk: int = 0, **wiring: Any) -> BufferStore:
    s = BufferStore(tmp / "ram", tmp / "disk", ram, disk, executor=SERIAL, **wiring)
    s.open()
    return s


def _capture(s: BufferStore, fill: int, size: int = 4 * MIB) -> str:
    staged = s.stage(0, ["w"], [size])
    os.pwrite(staged.memfds([0])[0], bytes([fill]) * size, 0)
    (ref,) = staged.commit()
    staged.close()
    drain(s.jobs)  # the budget pass that close queued has run
    return ref.sha256


def _tier_of(s: BufferStore, digest: str) -> str:
    return next(t.name for t in s.tiers if (t.blobs / s.key(0, digest)).exists())


def test_lru_blobs_spill_to_disk_and_reads_find_them(tmp_path: Path) -> None:
    s = _store(tmp_path, ram=9 * MIB)
    try:
        a, b = _capture(s, 1), _capture(s, 2)
        assert [_tier_of(s, d) for d in (a, b)] == ["ram", "ram"]
        os.utime(s.path(0, a), (1, 1))  # a was used long ago
        c = _capture(s, 3)
        assert [_tier_of(s, d) for d in (a, b, c)] == ["disk", "ram", "ram"]
        assert s.tiers[0].used_bytes() <= 9 * MIB
        assert s.path(0, a) == s.tiers[1].blobs / s.key(0, a), "read from the tier that holds it"
        assert oct(s.path(0, a).stat().st_mode & 0o777) == "0o400"
        with open(s.path(0, a), "rb") as fh:
            assert fh.read() == bytes([1]) * 4 * MIB
        assert s.used_bytes() == 12 * MIB
    finally:
        s.close()


def test_pinned_blobs_stay_in_ram(tmp_path: Path) -> None:
    s = _store(tmp_path, ram=5 * MIB)
    try:
        a = _capture(s, 1)
        s.pin(0, [a])  # a restore reads it
        os.utime(s.path(0, a), (1, 1))
        b = _capture(s, 2)
        assert _tier_of(s, a) == "ram" and _tier_of(s, b) == "disk", "the unpinned, newer one had to go"
        s.unpin(0, [a])
        s.collect_garbage(lambda: {s.key(0, b)})
        assert not s.path(0, a).exists() and _tier_of(s, b) == "disk", "garbage collection covers every tier"
    finally:
        s.close()


def test_buffers_bigger_than_every_budget_are_refused(tmp_path: Path) -> None:
    s = _store(tmp_path, ram=2 * MIB, disk=3 * MIB)
    try:
        with pytest.raises(ResourceExhaustedError) as err:
            s.stage(0, ["w"], [4 * MIB])
        assert err.value.reason == "BUFFER_BUDGET" and "ram 2 MiB, disk 3 MiB" in err.value.message
        staged = s.stage(0, ["w"], [3 * MIB])  # fits the disk tier only: staged there
        assert staged.tier.name == "disk"
        staged.close()
    finally:
        s.close()


def test_the_park_priority_orders_eviction_before_recency(tmp_path: Path) -> None:
    """The park ladder ranks blobs by the priority of the snapshots using them (``BufferStore.rank``): over
    the RAM budget, the lowest priority leaves first, even when it was used last."""
    ranked: set[str] = set()  # digests of the higher priority
    s = _store(tmp_path, ram=9 * MIB, rank=lambda key: 10 if key.partition("/")[2] in ranked else 0)
    try:
        high, low = _capture(s, 1), _capture(s, 2)
        os.utime(s.path(0, high), (1, 1))  # least recently used, but of the higher priority
        ranked.add(high)
        _capture(s, 3)
        assert _tier_of(s, high) == "ram" and _tier_of(s, low) == "disk"
    finally:
        s.close()


def test_the_slowest_tier_never_drops_a_blob_the_remote_lacks(tmp_path: Path) -> None:
    """Over the disk budget a blob leaves only once the remote store holds it (``evictor``): the last copy
    stays, over budget, and the others go."""
    in_remote: set[str] = set()  # digests the remote store holds
    s = _store(tmp_path, ram=0, disk=5 * MIB, evictor=lambda key, size: key.partition("/")[2] in in_remote)
    s.tiers = s.tiers[1:]  # the disk tier alone
    try:
        only, pushed = _capture(s, 1), _capture(s, 2)
        in_remote.add(pushed)
        assert s.enforce_budgets() == 4 * MIB
        assert s.path(0, only).exists() and not s.path(0, pushed).exists()
        in_remote.clear()
        assert s.enforce_budgets() == 0 and s.path(0, only).exists(), "over budget, but its only copy stays"
    finally:
        s.close()
