"""The restore's prefill orchestration (gpusnap.daemon.weights.prefill) over the fake VMM driver and a real
buffer store: which arenas a snapshot lets it fill (the layout comes from the worker and is checked like
any input), the GPU map it follows, and that every allocation is released however the restore ends
(a refused hand-over, a restore that fails before it, a fill cut short). The whole path, with real CRIU
and a real worker, is tests/adapters/test_prefill_cpu.py."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import (
    ArenaLayout,
    BufferRef,
    GpuProcess,
    HostFacts,
    ProcessFacts,
    Snapshot,
    WorkerInfo,
)
from gpusnap.daemon.store.buffers import BufferStore
from gpusnap.daemon.weights import prefill
from gpusnap.daemon.weights.devicefill import PrefillError
from tests.daemon.weights.test_devicefill import held
from tests.fakes.cuda_vmm import CUresult, FakeVmmDriver
from tests.lanes import LANES, drain

G = 64 << 10
GPU0 = "GPU-00000000-1111-4222-8333-000000000000"
GPU1 = "GPU-00000001-1111-4222-8333-000000000001"


def _snapshot(store: BufferStore, layouts: tuple[ArenaLayout, ...], sizes: list[tuple[int, int, int]]) -> Snapshot:
    """A snapshot whose one worker has ``layouts`` and buffers (arena, offset, bytes) with real blobs."""
    refs = []
    for i, (arena, offset, n) in enumerate(sizes):
        data = os.urandom(n)
        digest = hashlib.sha256(data).hexdigest()
        path = store.tiers[0].blobs / "0" / digest
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        refs.append(BufferRef(f"b{i}", n, digest, "agent", arena, offset))
    worker = WorkerInfo(engine="torch", instance_id="agent", pid=7, arenas=layouts)
    return Snapshot(
        id="snap-1",
        name="",
        created=datetime.datetime.now(datetime.UTC),
        labels={},
        owner_uid=0,
        source=ProcessFacts(pid=7, comm="w", cmdline=(), uid=0, gid=0, tree_pids=(7,), rss_bytes=0, cwd="/"),
        host=HostFacts("h", "k", "x86_64", "", "", "", ()),
        files=(),
        phases=(),
        worker=worker,
        buffers=tuple(refs),
        gpu_processes=(GpuProcess(pid=7, gpu_uuids=(GPU0,), gpu_memory_bytes=0),),
    )


@pytest.fixture
def store(tmp_path: Path) -> BufferStore:
    s = BufferStore(tmp_path / "buffers", executor=LANES)
    s.open()
    yield s  # type: ignore[misc]
    s.close()


def _support(drv: FakeVmmDriver) -> prefill.PrefillSupport:
    support = prefill.PrefillSupport.probe("auto", drv, jobs=LANES.prefill)
    assert support.enabled, support.reason
    return support


LAYOUT = ArenaLayout(GPU0, 4 * G, G, (2 * G, 2 * G), 2)


def test_layout_checks() -> None:
    refs = [BufferRef("a", 3 * G, "x", "", 1, 0), BufferRef("b", 512, "y", "", 1, 3 * G)]
    assert prefill.check_layout(LAYOUT, refs) == ""
    bad = {
        "granularity": dataclasses.replace(LAYOUT, granularity=3000),
        "chunks": dataclasses.replace(LAYOUT, chunk_bytes=(2 * G, G)),
        "storages": dataclasses.replace(LAYOUT, storages=3),
        "a size of": dataclasses.replace(LAYOUT, size_bytes=8 * G, chunk_bytes=(4 * G, 4 * G)),  # more than needed
    }
    for why, layout in bad.items():
        assert why in prefill.check_layout(layout, refs), why
    overlapping = [refs[0], dataclasses.replace(refs[1], arena_offset=G)]
    assert "overlapping" in prefill.check_layout(LAYOUT, overlapping)
    outside = [refs[0], dataclasses.replace(refs[1], arena_offset=4 * G)]
    assert "a size of" in prefill.check_layout(LAYOUT, outside)


def test_plan_follows_the_gpu_map_and_reports_what_it_skips(store: BufferStore) -> None:
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    plans, skipped = prefill.plan(snap, {GPU0.upper(): GPU1})
    assert [(p.index, p.target, [r.name for r in p.refs]) for p in plans] == [(1, GPU1, ["b0", "b1"])] and not skipped
    old = dataclasses.replace(snap, worker=dataclasses.replace(snap.worker, arenas=()))  # type: ignore[arg-type]
    plans, skipped = prefill.plan(old, None)
    assert not plans and "records no arena layout" in skipped["agent"][-1]
    plain = _snapshot(store, (), [(0, 0, 512)])
    plans, skipped = prefill.plan(plain, None)
    assert not plans and "1 buffers lie in no address-stable arena" in skipped["agent"][0]
    hostile = dataclasses.replace(
        snap, worker=dataclasses.replace(snap.worker, arenas=(dataclasses.replace(LAYOUT, storages=5),))
    )  # type: ignore[arg-type]
    plans, skipped = prefill.plan(hostile, None)
    assert not plans and "not stable" in skipped["agent"][0]


def test_a_worker_cannot_name_a_gpu_it_did_not_use(store: BufferStore) -> None:
    """The layout's GPU comes from the worker: an arena it says lies on a GPU its process held no memory on
    at capture (another tenant's GPU, outside the restore's GPU map) is not filled there, nor is one of a
    snapshot that records no GPU use at all (its worker had no CUDA context: the layout is made up)."""
    snap = _snapshot(store, (dataclasses.replace(LAYOUT, gpu_uuid=GPU1),), [(1, 0, 3 * G), (1, 3 * G, 512)])
    plans, skipped = prefill.plan(snap, {GPU0: GPU0})
    assert not plans and "a GPU its process did not use" in skipped["agent"][0], skipped
    drv = FakeVmmDriver(granularity=G, devices=2)
    run = prefill.start(_support(drv), store, snap, {GPU0: GPU0})
    assert run is not None and run.take("agent", 30) == [] and "cuMemCreate" not in drv.names()
    run.close()
    cpu_only = dataclasses.replace(_snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)]), gpu_processes=())
    plans, skipped = prefill.plan(cpu_only, None)
    assert not plans and "records no GPU use" in skipped["agent"][0], skipped


def test_a_made_up_granularity_does_not_inflate_the_arena(store: BufferStore) -> None:
    """The granularity is the worker's word too: claiming 16 times the GPU's own let a 512-byte buffer's
    arena pass the layout check at 16 granules (1 MiB here; up to all free device memory on a GPU), which
    root's daemon then allocated. The GPU's own granularity (cuMemGetAllocationGranularity) decides."""
    hostile = ArenaLayout(GPU0, 16 * G, 16 * G, (16 * G,), 1)
    snap = _snapshot(store, (hostile,), [(1, 0, 512)])
    assert prefill.check_layout(hostile, snap.buffers) == "", "the worker's own granularity admits it"
    drv = FakeVmmDriver(granularity=G)
    run = prefill.start(_support(drv), store, snap, None)
    assert run is not None and run.take("agent", 30) == []
    assert "a size of 1048576 bytes for 512 bytes of buffers" in run.why_not("agent"), run.why_not("agent")
    assert "cuMemCreate" not in drv.names() and drv.live() == 0
    run.close()


class _Client:
    """A restored worker's agent that maps whatever it is handed (records the arenas and descriptor sizes)."""

    def __init__(self) -> None:
        self.got: list[tuple[object, list[int]]] = []

    def map_arenas(self, arenas: object, fds: list[int], timeout_s: float) -> None:
        self.got.append((arenas, [os.fstat(fd).st_size for fd in fds]))


def _started(store: BufferStore, snap: Snapshot) -> tuple[FakeVmmDriver, prefill.Prefill]:
    drv = FakeVmmDriver(granularity=G)
    run = prefill.start(_support(drv), store, snap, None)
    assert run is not None
    return drv, run


def test_fill_hand_over_and_release(store: BufferStore) -> None:
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    drv, run = _started(store, snap)
    client = _Client()
    assert prefill.hand_over(run, snap.worker, client, 30) == {"b0", "b1"}  # type: ignore[arg-type]
    assert client.got == [([(1, ["b0", "b1"])], [2 * G, 2 * G])]
    assert drv.live() == 0 and not drv.reserved, "gpusnapd's handles are released once handed over"
    run.close()


def test_a_failed_release_after_the_hand_over_neither_fails_the_restore_nor_leaks_the_rest(
    store: BufferStore,
) -> None:
    """gpusnapd's cuMemRelease of a handed-over arena failing (the worker holds the memory now) raised out of
    hand_over, failing a restore whose worker had mapped everything, and left the next arenas' handles and
    exported descriptors with gpusnapd for good. It is logged; every other arena is released."""
    second = ArenaLayout(GPU0, G, G, (G,), 1)
    snap = _snapshot(store, (LAYOUT, second), [(1, 0, 3 * G), (1, 3 * G, 512), (2, 0, G)])
    drv, run = _started(store, snap)
    run._thread.join()
    drv.fail("cuMemRelease", result=CUresult.CUDA_ERROR_INVALID_VALUE)
    assert prefill.hand_over(run, snap.worker, _Client(), 30) == {"b0", "b1", "b2"}  # type: ignore[arg-type]
    assert len(drv.handles) == 1, "only the handle whose release failed is left"
    run.close()


def test_a_refused_hand_over_releases_and_reports(store: BufferStore) -> None:
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    drv, run = _started(store, snap)

    class Refusing:
        def map_arenas(self, arenas: object, fds: list[int], timeout_s: float) -> None:
            raise FailedPreconditionError("the worker's agent failed: VmmError", reason="AGENT_COMMAND_FAILED")

    assert prefill.hand_over(run, snap.worker, Refusing(), 30) == set()  # type: ignore[arg-type]
    assert "did not map them" in run.why_not("agent")
    assert drv.live() == 0
    run.close()


def test_a_restore_failing_before_the_hand_over_releases_the_filled_memory(store: BufferStore) -> None:
    drv = FakeVmmDriver(granularity=G)
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    run = prefill.start(_support(drv), store, snap, None)
    assert run is not None
    run._thread.join()
    assert len(drv.handles) == 2, "filled and exported, waiting for the worker"
    run.close()  # the rollback step
    assert drv.live() == 0 and not drv.reserved


def test_a_fill_past_the_timeout_is_cancelled_and_said_once(store: BufferStore) -> None:
    """Every worker's reload takes its arenas (in parallel): each one that waited out the timeout added the
    same reason again, unlocked, to every worker's message."""
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    drv = FakeVmmDriver(granularity=G)
    support = _support(drv)
    started = threading.Event()

    def slow_fill(*args: object, cancelled: Callable[[], bool], **kwargs: object) -> object:
        started.set()
        while not cancelled():
            time.sleep(0.01)
        time.sleep(0.5)  # a driver call in flight: the thread outlives the cancel
        raise PrefillError("the restore ended before the fill")

    support.filler.fill = slow_fill  # type: ignore[union-attr,method-assign,assignment]
    run = prefill.start(support, store, snap, None)
    assert run is not None and started.wait(10)
    assert run.take("agent", 0.05) == [] and run.take("other", 0.05) == []
    assert run.why_not("agent").count("the fill took longer than") == 1, run.why_not("agent")
    run.close()
    assert drv.live() == 0


def test_a_gpu_the_probe_refused_is_not_filled(store: BufferStore) -> None:
    drv = FakeVmmDriver(granularity=G)
    support = _support(drv)
    support.gpus[GPU0] = "no POSIX file descriptor handles"
    snap = _snapshot(store, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    run = prefill.start(support, store, snap, None)
    assert run is not None
    assert run.take("agent", 30) == [] and "no POSIX file descriptor handles" in run.why_not("agent")
    assert "cuMemCreate" not in drv.names()
    run.close()


def test_off_and_a_failed_probe_say_why() -> None:
    assert prefill.PrefillSupport.probe("off", jobs=LANES.prefill).state == "off (gpu_prefill = off)"
    drv = FakeVmmDriver(attributes={})
    state = prefill.PrefillSupport.probe("auto", drv, jobs=LANES.prefill).state
    assert state.startswith("off: no GPU supports it") and "no virtual memory management" in state


def _tiered(tmp_path: Path, after_collect: Callable[[], None] | None = None) -> BufferStore:
    """A buffer store with a RAM tier (blobs whose registrations are kept) over a disk tier."""
    s = BufferStore(
        tmp_path / "ram", disk=tmp_path / "disk", ram_budget_bytes=8 * G, after_collect=after_collect, executor=LANES
    )
    s.open()
    return s


@pytest.fixture
def tiered(tmp_path: Path) -> BufferStore:
    s = _tiered(tmp_path)
    yield s  # type: ignore[misc]
    s.close()


def _blob_fd(store: BufferStore, snap: Snapshot, i: int = 0) -> int:
    return os.open(store.path(snap.buffer_uid, snap.buffers[i].sha256), os.O_RDONLY)


def test_off_creates_no_context() -> None:
    drv = FakeVmmDriver(granularity=G)
    support = prefill.PrefillSupport.probe("off", drv, jobs=LANES.prefill)
    support.warm(BufferStore(Path("/nonexistent"), executor=LANES), lambda: [])
    support.after_publish(None)  # type: ignore[arg-type]
    drain(LANES.prefill)
    assert drv.calls == [], "off: gpusnapd makes no driver call at all"


def test_warm_creates_contexts_and_registers_the_store_s_snapshots_ahead(tiered: BufferStore) -> None:
    """At start (auto) gpusnapd creates its context and registers the RAM-tier blobs of existing snapshots,
    in the background; the first restore's fill then registers nothing and is handed over as before."""
    snap = _snapshot(tiered, (LAYOUT,), [(1, 0, 3 * G), (1, 3 * G, 512)])
    drv = FakeVmmDriver(granularity=G)
    support = _support(drv)
    assert "cuDevicePrimaryCtxRetain" not in drv.names(), "the probe creates no context"
    support.warm(tiered, lambda: [snap])
    drain(LANES.prefill)
    assert drv.names().count("cuDevicePrimaryCtxRetain") == 1 and support.contexts == "ready"
    fds = [_blob_fd(tiered, snap, i) for i in range(2)]
    assert [held(support.filler, fd) for fd in fds] == ["ahead", "ahead"]  # type: ignore[union-attr]
    assert "contexts ready" in support.state and "GiB of blobs registered" in support.state, support.state
    registers = drv.names().count("cuMemHostRegister")
    run = prefill.start(support, tiered, snap, None)
    assert run is not None
    assert prefill.hand_over(run, snap.worker, _Client(), 30) == {"b0", "b1"}  # type: ignore[arg-type]
    assert drv.names().count("cuMemHostRegister") == registers, "the first restore's fill registered nothing"
    assert [held(support.filler, fd) for fd in fds] == ["kept", "kept"]  # type: ignore[union-attr]
    run.close()
    for fd in fds:
        os.close(fd)
    support.close()


def test_a_published_snapshot_is_registered_ahead_most_recent_first_within_the_budget(tiered: BufferStore) -> None:
    drv = FakeVmmDriver(granularity=G)
    support = _support(drv)
    support.filler.keep_budget_bytes = 3 * G  # type: ignore[union-attr]
    old = _snapshot(tiered, (ArenaLayout(GPU0, 2 * G, G, (2 * G,), 1),), [(1, 0, 2 * G)])
    new = _snapshot(tiered, (ArenaLayout(GPU0, 2 * G, G, (2 * G,), 1),), [(1, 0, 2 * G)])
    os.utime(tiered.path(0, old.buffers[0].sha256), (1, 1))  # used long ago
    support.warm(tiered, lambda: [])
    support.after_publish(old)  # two checkpoints published; only one fits the budget
    drain(LANES.prefill)
    first = _blob_fd(tiered, old)
    assert held(support.filler, first) == "ahead"  # type: ignore[union-attr]
    support.after_publish(new)
    drain(LANES.prefill)
    second = _blob_fd(tiered, new)
    assert held(support.filler, second) == "" and support.filler.registered_bytes() == 2 * G  # type: ignore[union-attr]
    support.close()
    fresh = _support(FakeVmmDriver(granularity=G))  # a daemon's start: most recently used first
    fresh.filler.keep_budget_bytes = 3 * G  # type: ignore[union-attr]
    fresh.warm(tiered, lambda: [old, new])
    drain(LANES.prefill)
    assert (held(fresh.filler, first), held(fresh.filler, second)) == ("", "ahead")  # type: ignore[union-attr]
    for fd in (first, second):
        os.close(fd)
    fresh.close()


@pytest.mark.parametrize("how", ["delete", "evict"])
def test_a_blob_registered_ahead_can_still_be_deleted_or_evicted(tmp_path: Path, how: str) -> None:
    """A registration made ahead pins nothing in the store: the snapshot's deletion (garbage collection)
    or the RAM budget's move to disk goes on, and the store's after_collect unregisters the blob (its tmpfs
    pages are freed) as for a fill's own kept registration."""
    drv = FakeVmmDriver(granularity=G)
    support = _support(drv)
    tiered = _tiered(tmp_path, after_collect=support.filler.drop_unlinked)  # type: ignore[union-attr]  # as build_daemon
    snap = _snapshot(tiered, (ArenaLayout(GPU0, 4 * G, G, (4 * G,), 1),), [(1, 0, 4 * G)])
    support.warm(tiered, lambda: [snap])
    drain(LANES.prefill)
    assert support.filler.registered_bytes() == 4 * G  # type: ignore[union-attr]
    path = tiered.path(0, snap.buffers[0].sha256)
    if how == "delete":
        assert tiered.collect_garbage(set) == 4 * G
    else:  # a newer capture's blob puts the RAM tier past its budget of 8 G
        _snapshot(tiered, (), [(0, 0, 6 * G)])
        os.utime(path, (1, 1))
        assert tiered.enforce_budgets() == 4 * G
        assert tiered.path(0, snap.buffers[0].sha256).is_relative_to(tiered.tiers[1].blobs), "moved to disk"
    assert not path.exists()
    assert support.filler.registered_bytes() == 0 and drv.registered == {}  # type: ignore[union-attr]
    support.close()
    tiered.close()
