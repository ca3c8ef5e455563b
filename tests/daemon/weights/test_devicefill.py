"""gpusnapd's device fill (gpusnap.daemon.weights.devicefill) over the fake VMM driver, whose physical
allocations are memfds (tests/fakes/cuda_vmm.py): the bytes a fill exports reach another process, which
imports and maps them at its own arena's reserved addresses (the worker's side, gpusnap.adapters.vmm);
every failure leaves no handle, mapping, address range, registration or descriptor behind."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import BufferRef
from gpusnap.daemon.store.buffers import BufferStore
from gpusnap.daemon.weights import devicefill
from gpusnap.daemon.weights.devicefill import DeviceFiller, PrefillError, Source
from tests.conftest import REPO
from tests.fakes.cuda_vmm import POSIX_FD_ATTRIBUTE, CUresult, FakeVmmDriver
from tests.lanes import LANES

G = 64 << 10
UUID = "GPU-00000000-1111-4222-8333-000000000000"
UUID1 = "GPU-00000001-1111-4222-8333-000000000001"

WORKER = """
import hashlib, os, sys, ctypes
sys.path.insert(0, {repo!r})
from gpusnap.adapters import vmm
from tests.fakes.cuda_vmm import FakeVmmDriver
drv = FakeVmmDriver(granularity={g})
arena = vmm.Arena({size}, 0, driver=drv, chunk_bytes={chunk})
arena.release()
fds = [int(x) for x in sys.argv[1:]]
arena.adopt(fds)
for fd in fds:
    os.close(fd)
print(arena.ptr, hashlib.sha256(ctypes.string_at(arena.ptr, {nbytes})).hexdigest())
"""


def held(filler: DeviceFiller, fd: int) -> str:
    """How blob ``fd`` is registered: ``"ahead"`` (by ``register_ahead``, no fill used it yet), ``"kept"``
    (used by a fill) or ``""`` (not)."""
    st = os.fstat(fd)
    reg = filler._registered.get((st.st_dev, st.st_ino))
    return "" if reg is None else "ahead" if reg.ahead else "kept"


def _blob(tmp: Path, name: str, nbytes: int) -> tuple[int, bytes]:
    data = os.urandom(nbytes)
    path = tmp / name
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY), data


def _clean(drv: FakeVmmDriver, keep: int = 0) -> None:
    assert drv.live() == 0, "handles or memfds left"
    assert not drv.reserved and not drv.mappings, "address ranges or mappings left"
    assert len(drv.registered) == keep, "registrations left"


def _worker_digest(filled: devicefill.FilledArena, *, chunk: int, nbytes: int) -> str:
    """SHA-256 of the first ``nbytes`` of the arena another process (WORKER) adopts from ``filled``'s
    descriptors, its chunks ``chunk`` bytes each."""
    script = WORKER.format(repo=str(REPO), g=G, size=filled.nbytes, chunk=chunk, nbytes=nbytes)
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, filled.fds)],
        pass_fds=filled.fds,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[1]


def test_filled_memory_reaches_another_process_through_exported_descriptors(tmp_path: Path) -> None:
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv)
    a, da = _blob(tmp_path, "a", 3 * G + 100)  # crosses the first chunk boundary
    b, db = _blob(tmp_path, "b", G)
    off_b = 4 * G
    chunks = [2 * G, 2 * G, 2 * G]
    filled = filler.fill(UUID, chunks, [Source(a, len(da), 0), Source(b, len(db), off_b)])
    os.close(a)
    os.close(b)
    assert len(filled.fds) == 3 and not drv.reserved, "gpusnapd's own mapping is gone; the exported memory stays"
    expected = bytearray(b"\xa5" * (6 * G))  # new memory where nothing was copied
    expected[: len(da)] = da
    expected[off_b : off_b + len(db)] = db
    digest = _worker_digest(filled, chunk=2 * G, nbytes=6 * G)
    assert digest == hashlib.sha256(bytes(expected)).hexdigest(), "the worker maps the filled bytes"
    filled.release()
    _clean(drv)
    filled.release()  # idempotent


def test_pieces_never_cross_a_chunk_and_stay_small() -> None:
    bounds = [0, 4 * G, 8 * G]
    assert devicefill._pieces(G, 6 * G, bounds, 3 * G) == [(G, 3 * G), (4 * G, 3 * G)]
    assert devicefill._pieces(3 * G, 2 * G, bounds, 3 * G) == [(3 * G, G), (4 * G, G)]


@pytest.mark.parametrize(
    ("call", "nth"),
    [
        ("cuMemCreate", 2),
        ("cuMemAddressReserve", 1),
        ("cuMemMap", 2),
        ("cuMemSetAccess", 1),
        ("cuMemHostRegister", 1),
        ("cuMemcpyAsync", 2),
        ("cuStreamSynchronize", 2),
        ("cuMemUnmap", 1),
        ("cuMemExportToShareableHandle", 2),
    ],
)
def test_every_failure_releases_everything(tmp_path: Path, call: str, nth: int) -> None:
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv)
    fd, data = _blob(tmp_path, "a", 4 * G)
    before = set(os.listdir("/proc/self/fd"))
    drv.fail(call, on_call=nth, result=CUresult.CUDA_ERROR_INVALID_VALUE)
    if call == "cuMemHostRegister":  # the retry without CU_MEMHOSTREGISTER_PORTABLE fails too
        drv.fail(call, on_call=nth + 1, result=CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(PrefillError, match=call):
        filler.fill(UUID, [2 * G, 2 * G], [Source(fd, len(data), 0)])
    _clean(drv)
    assert set(os.listdir("/proc/self/fd")) == before, "no descriptor left open"
    os.close(fd)


def test_preconditions_are_checked_before_anything_is_allocated(tmp_path: Path) -> None:
    drv = FakeVmmDriver(granularity=G, capacity=4 * G)
    filler = DeviceFiller(drv)
    fd, data = _blob(tmp_path, "a", 2 * G)
    with pytest.raises(PrefillError, match="MiB free"):
        filler.fill(UUID, [2 * G, 2 * G], [Source(fd, len(data), 0)], reserve_bytes=G)
    with pytest.raises(PrefillError, match="where the snapshot records"):
        filler.fill(UUID, [4 * G], [Source(fd, len(data) + 1, 0)])
    with pytest.raises(PrefillError, match="outside the arena"):
        filler.fill(UUID, [2 * G], [Source(fd, len(data), G)])
    with pytest.raises(PrefillError, match="not visible"):
        filler.fill("GPU-00000009-1111-4222-8333-000000000009", [2 * G], [Source(fd, len(data), 0)])
    assert "cuMemCreate" not in drv.names()
    _clean(drv)
    os.close(fd)


def test_a_second_restore_on_the_gpu_does_not_count_memory_promised_to_the_first(tmp_path: Path) -> None:
    """Two restores onto one GPU both read the free memory before either worker's CUDA restore took its share:
    both fills passed, and one worker's restore then ran out of device memory instead of reading back."""
    drv = FakeVmmDriver(granularity=G, capacity=6 * G)
    filler = DeviceFiller(drv)
    fd, data = _blob(tmp_path, "a", 2 * G)
    first = filler.fill(UUID, [2 * G], [Source(fd, len(data), 0)], reserve_bytes=2 * G)
    with pytest.raises(PrefillError, match="not promised to other restores"):
        filler.fill(UUID, [2 * G], [Source(fd, len(data), 0)], reserve_bytes=2 * G)
    first.release()  # the first worker has imported its arena and its CUDA restore is done
    second = filler.fill(UUID, [2 * G], [Source(fd, len(data), 0)], reserve_bytes=2 * G)
    second.release()
    second.release()  # (idempotent: the promise ends once)
    assert filler._promised == {0: 0}
    _clean(drv)
    os.close(fd)


def test_cancelled_fill_releases_everything(tmp_path: Path) -> None:
    drv = FakeVmmDriver(granularity=G)
    fd, data = _blob(tmp_path, "a", 2 * G)
    with pytest.raises(PrefillError, match="ended before"):
        DeviceFiller(drv).fill(UUID, [2 * G], [Source(fd, len(data), 0)], cancelled=lambda: True)
    _clean(drv)
    os.close(fd)


def test_ram_tier_registrations_are_kept_until_the_blob_is_unlinked(tmp_path: Path) -> None:
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv)
    fd, data = _blob(tmp_path, "a", 2 * G)
    for _ in range(2):
        filler.fill(UUID, [2 * G], [Source(fd, len(data), 0, keep=True)]).release()
    assert drv.names().count("cuMemHostRegister") == 1, "registered once, reused"
    assert filler.registered_bytes() == 2 * G
    os.close(fd)
    filler.drop_unlinked()
    assert filler.registered_bytes() == 2 * G, "a blob still in the store stays registered"
    (tmp_path / "a").unlink()  # the store's garbage collection, which then calls drop_unlinked
    filler.drop_unlinked()
    assert filler.registered_bytes() == 0, "the unlinked blob's registration was dropped"
    _clean(drv)


def test_probe_reports_what_each_gpu_lacks() -> None:
    drv = FakeVmmDriver(devices=2)
    assert DeviceFiller(drv).probe() == {UUID: "", "GPU-00000001-1111-4222-8333-000000000001": ""}
    drv.attributes[POSIX_FD_ATTRIBUTE] = 0
    assert set(DeviceFiller(drv).probe().values()) == {"no POSIX file descriptor handles"}
    assert "cuDevicePrimaryCtxRetain" not in drv.names(), "the probe creates no context"


def test_registration_retries_without_portable(tmp_path: Path) -> None:
    drv = FakeVmmDriver(granularity=G)
    fd, data = _blob(tmp_path, "a", 2 * G)
    drv.fail("cuMemHostRegister", result=CUresult.CUDA_ERROR_NOT_SUPPORTED)
    DeviceFiller(drv).fill(UUID, [2 * G], [Source(fd, len(data), 0)]).release()
    flags = [args[2] for name, args in drv.calls if name == "cuMemHostRegister"]
    assert flags == [0x09, 0x08], "read-only and portable, then read-only alone"
    _clean(drv)
    os.close(fd)


def test_a_blob_the_ram_budget_moves_to_disk_is_unregistered(tmp_path: Path) -> None:
    """The RAM tier's budget moves least recently used blobs to the disk tier (unlinking them in RAM); a kept
    registration would keep the moved blob's tmpfs pages allocated and pinned, past the budget, until some
    later fill or garbage collection noticed. The store tells the filler after a budget pass too."""
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv)
    store = BufferStore(  # wired as build_daemon wires it
        tmp_path / "ram",
        disk=tmp_path / "disk",
        ram_budget_bytes=G,
        after_collect=filler.drop_unlinked,
        executor=LANES,
    )
    store.open()
    data = os.urandom(2 * G)
    digest = hashlib.sha256(data).hexdigest()
    path = store.tiers[0].blobs / "0" / digest
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    [fd] = store.open_for_read(0, [BufferRef("b", len(data), digest)])
    filler.fill(UUID, [2 * G], [Source(fd, len(data), 0, keep=True)]).release()
    os.close(fd)
    assert filler.registered_bytes() == 2 * G
    assert store.enforce_budgets() == 2 * G and not path.exists(), "moved to the disk tier"
    assert filler.registered_bytes() == 0, "the moved blob's RAM copy is no longer pinned"
    _clean(drv)
    store.close()


def test_dropping_another_gpus_registration_mid_fill_keeps_the_fills_context(tmp_path: Path) -> None:
    """A fill drops kept registrations whose blob was unlinked before it registers its own; unregistering
    one made on another GPU made that GPU's context current on the filling thread, whose next copies then
    went to streams of a context no longer current (the driver refuses them: the fill fell back)."""
    drv = FakeVmmDriver(granularity=G, devices=2)
    filler = DeviceFiller(drv)
    fd1, d1 = _blob(tmp_path, "one", G)
    filler.fill(UUID1, [G], [Source(fd1, len(d1), 0, keep=True)]).release()  # kept, made on GPU 1
    os.close(fd1)
    (tmp_path / "one").unlink()  # the store moved or removed it, not yet told
    fd0, d0 = _blob(tmp_path, "zero", 2 * G)
    filled = filler.fill(UUID, [2 * G], [Source(fd0, len(d0), 0)])
    os.close(fd0)
    assert filler.registered_bytes() == 0, "the unlinked blob's registration was dropped"
    filled.release()
    _clean(drv)


def test_a_registration_the_driver_cannot_drop_now_is_kept_for_later_and_nothing_raises(tmp_path: Path) -> None:
    """The store's garbage collection calls drop_unlinked after a snapshot's deletion: a driver error there
    raised out of ``gpusnap delete`` (the snapshot gone, the command failed) and lost the registration for
    good (forgotten before it was unregistered: its pages stayed pinned until gpusnapd exited)."""
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv)
    fd, data = _blob(tmp_path, "a", 2 * G)
    filler.fill(UUID, [2 * G], [Source(fd, len(data), 0, keep=True)]).release()
    os.close(fd)
    (tmp_path / "a").unlink()
    drv.fail("cuCtxSetCurrent", result=CUresult.CUDA_ERROR_INVALID_VALUE)
    filler.drop_unlinked()
    assert filler.registered_bytes() == 2 * G, "kept, to be dropped later"
    filler.drop_unlinked()
    assert filler.registered_bytes() == 0
    _clean(drv)


def test_a_blob_outside_the_ram_tier_is_pinned_a_window_at_a_time(tmp_path: Path) -> None:
    """Registering pins every page of the range. A disk-tier blob was registered whole for the whole fill:
    a user's snapshot with buffers larger than the node's free memory had root's daemon lock that much page
    cache at once (the reload streams it through the page cache instead). It is registered, copied and
    unregistered ``WINDOW_BYTES`` at a time; a RAM-tier blob (already resident in tmpfs) stays whole and kept."""
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv, window_bytes=2 * G)
    fd, data = _blob(tmp_path, "a", 5 * G + 100)
    filled = filler.fill(UUID, [3 * G, 3 * G], [Source(fd, len(data), 0)])
    os.close(fd)
    pins = [
        (n, a[1] if n == "cuMemHostRegister" else None)
        for n, a in drv.calls
        if "HostRegister" in n or "HostUnregister" in n
    ]
    assert [size for n, size in pins if size is not None] == [2 * G, 2 * G, G + 100], pins
    assert [n for n, _ in pins] == ["cuMemHostRegister", "cuMemHostUnregister"] * 3, "one window pinned at a time"
    assert _worker_digest(filled, chunk=3 * G, nbytes=len(data)) == hashlib.sha256(data).hexdigest(), "every window"
    filled.release()
    _clean(drv)


def test_warm_creates_the_context_before_any_fill() -> None:
    drv = FakeVmmDriver(granularity=G)
    DeviceFiller(drv).warm(UUID)
    assert drv.names().count("cuDevicePrimaryCtxRetain") == 1 and "cuStreamCreate" in drv.names()
    assert "cuMemCreate" not in drv.names()


def test_a_registration_made_ahead_serves_the_next_fill_within_the_budget(tmp_path: Path) -> None:
    """Registering a RAM-tier blob ahead of its restore (after the checkpoint) makes the first fill use it, as
    a second restore's fill uses the first one's; registrations made ahead stop at the budget and are the
    first dropped when a fill's own kept registration needs the room, while a fill's own stay."""
    drv = FakeVmmDriver(granularity=G)
    filler = DeviceFiller(drv, keep_budget_bytes=3 * G)
    a, da = _blob(tmp_path, "a", 2 * G)
    b, db = _blob(tmp_path, "b", 2 * G)
    assert filler.register_ahead(a, len(da), UUID) and held(filler, a) == "ahead"
    assert not filler.register_ahead(a, len(da), UUID), "registered once"
    assert not filler.register_ahead(b, len(db), UUID) and held(filler, b) == "", "past the budget"
    with pytest.raises(PrefillError, match="where the snapshot records"):
        filler.register_ahead(b, len(db) + 1, UUID)
    registers = drv.names().count("cuMemHostRegister")
    filled = filler.fill(UUID, [2 * G], [Source(a, len(da), 0, keep=True)])
    assert drv.names().count("cuMemHostRegister") == registers, "the fill used the registration made ahead"
    assert held(filler, a) == "kept"
    assert _worker_digest(filled, chunk=2 * G, nbytes=len(da)) == hashlib.sha256(da).hexdigest()
    filled.release()
    filler.keep_budget_bytes = 5 * G
    c, dc = _blob(tmp_path, "c", 2 * G)
    assert filler.register_ahead(c, len(dc), UUID)
    filler.fill(UUID, [2 * G], [Source(b, len(db), 0, keep=True)]).release()  # 6 G kept: past 5 G
    assert (held(filler, a), held(filler, b), held(filler, c)) == ("kept", "kept", ""), "the one made ahead went"
    assert filler.registered_bytes() == 4 * G == sum(drv.registered.values())
    for fd in (a, b, c):
        os.close(fd)
    filler.close()
    _clean(drv)
