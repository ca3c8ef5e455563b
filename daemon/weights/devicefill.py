"""Device memory that gpusnapd creates and fills for a restored worker (``--gpu-prefill``), through
``cuda.bindings.driver``'s virtual memory management (VMM) calls.

A worker's address-stable arena (``gpusnap.adapters.vmm``) is a reserved device address range whose
physical memory the worker releases at capture. Instead of the worker creating it again and copying its
buffers in after a restore, :meth:`DeviceFiller.fill` creates it in gpusnapd's own context on the target
GPU, one allocation per chunk of the arena (``cuMemCreate`` with ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``
requested), maps it into a range of its own, copies the blobs in by DMA (each blob ``mmap``ed read-only
and ``cuMemHostRegister``-ed read-only and portable: :data:`REGISTER_FLAGS`; ``cuMemcpyAsync`` on a few streams),
unmaps it again and exports one file descriptor per chunk (``cuMemExportToShareableHandle``). The worker
imports and maps those at the arena's own addresses (:meth:`gpusnap.adapters.vmm.Arena.adopt`); then
:meth:`FilledArena.release` drops gpusnapd's handles, and the memory belongs to the worker alone (the CUDA
Driver API, "Virtual Memory Management": physical memory is freed once every handle is released and every
mapping unmapped). bench/arena_probe.py measured this recipe on an H200 (bench/results/arena-probe-*.json):
55.4 GB/s fill from a registered tmpfs blob, 0.0008 s import and map of 16 GiB in the worker.

Registrations of blobs in the RAM tier are kept across restores (registering 16 GiB took 0.86 s on the
H200) and dropped once their file is unlinked (after the store's garbage collection or a budget pass:
:meth:`DeviceFiller.drop_unlinked`, and at every fill's start) or when :meth:`DeviceFiller.close` runs.
gpusnapd may also make them ahead of any restore (:meth:`DeviceFiller.register_ahead`, after a checkpoint
and at start) and create its contexts early (:meth:`DeviceFiller.warm`), so that the first restore of a
snapshot is as fast as the next ones. Registrations made ahead fit a budget (``keep_budget_bytes``) and are
the first to go when a fill's own kept registration needs the room; a fill's own are never dropped for it.
Other blobs are registered for one fill only, :data:`WINDOW_BYTES` at a time (copied, then unregistered),
so no disk page stays pinned and a fill pins at most that much page cache, whatever the snapshot's size.

What this module checks of the blob bytes: every blob descriptor's size (``fstat``) equals the size the
snapshot records before anything is mapped, so the DMA reads exactly the recorded bytes of the file. It
computes no digests: the caller (``gpusnap.daemon.weights.prefill``) keeps today's reload rules (sizes at
preflight, digests with ``--verify-buffers`` before the memory reaches the worker).

Every failure raises :class:`PrefillError` and gives back everything the call created (handles, mappings,
address ranges, exported descriptors); nothing here raises gRPC errors. Calls are synchronous driver calls
without timeouts; the caller runs them on a thread of its own. Thread-safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpusnap.daemon.drivers.cuda import format_gpu_uuid

REGISTER_FLAGS = 0x08 | 0x01
"""``CU_MEMHOSTREGISTER_READ_ONLY`` (the device only reads the registered pages: a 0400 blob) and
``CU_MEMHOSTREGISTER_PORTABLE`` (pinned for every context, so a kept registration serves fills on any GPU
and can be dropped from any thread that makes one current)."""
PIECE_BYTES = 256 << 20
"""Bytes per ``cuMemcpyAsync`` (the probe's chunk)."""
WINDOW_BYTES = 1 << 30
"""Bytes of a blob outside the RAM tier registered (so pinned in memory) at a time: a whole disk-tier blob
of a user's snapshot could be larger than the node's free memory (a multiple of ``PIECE_BYTES`` and of the
page size)."""
STREAMS = 4
KEEP_SHARE = 0.5
"""Share of the host's physical memory that kept registrations may pin once registrations made ahead of a
restore are counted (:meth:`DeviceFiller.register_ahead`): RAM-tier pages are resident anyway, but pinned
pages cannot be reclaimed or swapped."""

log = structlog.get_logger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class PrefillError(RuntimeError):
    """A fill could not be done; the message names the cause (a driver call and its ``CUresult``, or a
    precondition such as free device memory). Everything the fill created was given back."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One blob's bytes for one arena: ``fd`` (read-only, the caller's; kept open by a cached
    registration), ``nbytes`` (the size the snapshot records), ``offset`` in the arena, and ``keep``
    (keep its registration for later fills: a RAM-tier blob)."""

    fd: int
    nbytes: int
    offset: int
    keep: bool = False


@dataclasses.dataclass
class FilledArena:
    """An arena's physical memory, filled: ``fds`` (one exported descriptor per chunk, in address order)
    and gpusnapd's own handles. :meth:`release` closes and releases both; call it once the worker has
    imported the descriptors, or to give the memory back when it never will."""

    filler: DeviceFiller
    ordinal: int
    handles: list[Any]
    fds: list[int]
    nbytes: int
    seconds: float = 0.0
    promised: int = 0
    """Device memory this arena's fill promised the worker's CUDA restore on its GPU (bytes), which other
    fills on that GPU do not count as free until :meth:`release`."""

    def release(self) -> None:
        """Close the exported descriptors and release gpusnapd's handles (idempotent; the promise to the
        worker's CUDA restore ends with it). Memory a worker imported stays with the worker."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        promised, self.promised = self.promised, 0
        if promised:
            self.filler._keep_promise(self.ordinal, -promised)
        handles, self.handles = self.handles, []
        if handles:
            self.filler._release(self.ordinal, handles)


@dataclasses.dataclass
class _Registered:
    fd: int
    address: int
    nbytes: int
    ordinal: int
    """The GPU whose context was current at registration (made current again to unregister)."""
    ahead: bool = False
    """Made by :meth:`DeviceFiller.register_ahead` and not yet used by a fill (dropped first for room)."""


def _call(drv: Any, name: str, *args: Any) -> Any:
    """The call's results after its ``CUresult``; raises :class:`PrefillError` naming the call."""
    out = getattr(drv, name)(*args)
    err, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
    if int(err) != 0:
        raise PrefillError(f"{name} failed with {getattr(err, 'name', None) or f'CUresult({int(err)})'}")
    return None if not rest else rest[0] if len(rest) == 1 else rest


def _uuid_text(raw: Any) -> str:
    """``CUuuid.bytes`` (``bytes``; ``str`` in some cuda-bindings releases) in NVML form."""
    return format_gpu_uuid(raw.encode("latin-1") if isinstance(raw, str) else bytes(raw))


class DeviceFiller:
    """gpusnapd's contexts (one primary context per GPU, retained on first use and kept) and its fills.

    Args:
        driver: ``cuda.bindings.driver`` (default, imported on first use) or a fake with the same calls
            (tests/fakes/cuda_vmm.py).
        keep_budget_bytes: bytes of blob that registrations made ahead may bring the kept registrations to
            (default: :data:`KEEP_SHARE` of the host's physical memory).
        window_bytes: see :data:`WINDOW_BYTES` (tests make it small).
    """

    def __init__(self, driver: Any = None, keep_budget_bytes: int | None = None, window_bytes: int = WINDOW_BYTES):
        self._drv = driver
        self.window_bytes = window_bytes
        """Bytes of a blob outside the RAM tier registered at a time (:data:`WINDOW_BYTES`)."""
        self.keep_budget_bytes = (
            keep_budget_bytes
            if keep_budget_bytes is not None
            else int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * KEEP_SHARE)
        )
        self._lock = threading.RLock()
        self._contexts: dict[int, Any] = {}
        self._streams: dict[int, list[Any]] = {}
        self._registered: dict[tuple[int, int], _Registered] = {}
        self._promised: dict[int, int] = {}
        """GPU ordinal → device memory (bytes) promised to CUDA restores of workers whose arenas are
        filled and not yet released: two restores onto one GPU must not both count the same free bytes."""

    @property
    def drv(self) -> Any:
        """The driver module; ``cuda.bindings.driver`` is imported and ``cuInit`` run on first use.

        Raises:
            ImportError: cuda-bindings is not installed.
            PrefillError: ``cuInit`` failed.
        """
        if self._drv is None:
            from cuda.bindings import driver

            _call(driver, "cuInit", 0)
            self._drv = driver
        return self._drv

    def probe(self) -> dict[str, str]:
        """Which GPUs can be filled: GPU UUID (NVML form) → ``""`` where VMM and POSIX-descriptor handles
        are supported (``CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED``,
        ``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``), else why not. Creates no context.

        Raises:
            PrefillError: cuda-bindings is missing, ``cuInit`` or a device query failed.
        """
        try:
            drv = self.drv
        except ImportError as exc:
            raise PrefillError(f"cuda-bindings is not importable ({exc})") from exc
        attr = drv.CUdevice_attribute
        out: dict[str, str] = {}
        for ordinal in range(int(_call(drv, "cuDeviceGetCount"))):
            dev = _call(drv, "cuDeviceGet", ordinal)
            uuid = _uuid_text(_call(drv, "cuDeviceGetUuid", dev).bytes)
            vmm = _call(drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev)
            fd = _call(
                drv, "cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev
            )
            out[uuid] = (
                "" if vmm and fd else "no virtual memory management" if not vmm else "no POSIX file descriptor handles"
            )
        return out

    def ordinal_of(self, gpu_uuid: str) -> int:
        """This process's device ordinal of the GPU ``gpu_uuid`` (NVML form, any case).

        Raises:
            PrefillError: no such GPU.
        """
        drv = self.drv
        for ordinal in range(int(_call(drv, "cuDeviceGetCount"))):
            if (
                _uuid_text(_call(drv, "cuDeviceGetUuid", _call(drv, "cuDeviceGet", ordinal)).bytes).lower()
                == gpu_uuid.lower()
            ):
                return ordinal
        raise PrefillError(f"GPU {gpu_uuid} is not visible to gpusnapd")

    def granularity(self, gpu_uuid: str) -> int:
        """The minimum allocation granularity in bytes of device memory on GPU ``gpu_uuid``
        (``cuMemGetAllocationGranularity``, ``CU_MEM_ALLOC_GRANULARITY_MINIMUM``, for the allocations
        :meth:`fill` makes).

        Raises:
            PrefillError: no such GPU, or the query failed.
        """
        return int(
            _call(
                self.drv,
                "cuMemGetAllocationGranularity",
                self._prop(self.ordinal_of(gpu_uuid)),
                self.drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        )

    def _prop(self, ordinal: int) -> Any:
        """``CUmemAllocationProp`` of a fill's allocations: pinned device memory on GPU ``ordinal``,
        exportable as POSIX file descriptors."""
        drv = self.drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _enter(self, ordinal: int) -> list[Any]:
        """Make GPU ``ordinal``'s primary context current on this thread (retained once); its streams."""
        drv = self.drv
        with self._lock:
            if ordinal not in self._contexts:
                ctx = _call(drv, "cuDevicePrimaryCtxRetain", _call(drv, "cuDeviceGet", ordinal))
                _call(drv, "cuCtxSetCurrent", ctx)
                self._streams[ordinal] = [_call(drv, "cuStreamCreate", 0) for _ in range(STREAMS)]
                self._contexts[ordinal] = ctx
        _call(drv, "cuCtxSetCurrent", self._contexts[ordinal])
        return self._streams[ordinal]

    def warm(self, gpu_uuid: str) -> None:
        """Retain GPU ``gpu_uuid``'s primary context and create its streams now, not at the first fill.

        Raises:
            PrefillError: no such GPU, or a driver call failed (a later fill tries again).
        """
        self._enter(self.ordinal_of(gpu_uuid))

    def register_ahead(self, fd: int, nbytes: int, gpu_uuid: str) -> bool:
        """Register the whole blob ``fd`` (``nbytes``, a RAM-tier blob of a snapshot's arena) now and keep
        it, as a fill's :class:`Source` with ``keep`` would, so a later fill finds it registered. False,
        registering nothing, when it is registered already or would bring the kept registrations past
        ``keep_budget_bytes``. Holds the filler's lock while it registers: a fill started meanwhile waits
        for it and then uses it, rather than pinning the same pages twice.

        Raises:
            PrefillError: the size is not ``nbytes``, or a driver call failed (nothing stays registered).
        """
        st = os.fstat(fd)
        if st.st_size != nbytes:
            raise PrefillError(f"a blob holds {st.st_size} bytes where the snapshot records {nbytes}")
        ordinal = self.ordinal_of(gpu_uuid)
        with self._lock:
            if (st.st_dev, st.st_ino) in self._registered:
                return False
            if self.registered_bytes() + nbytes > self.keep_budget_bytes:
                return False
            self._enter(ordinal)
            reg = self._register(fd, nbytes, ordinal)
            reg.ahead = True
            self._registered[(st.st_dev, st.st_ino)] = reg
            self._drop_unlinked()  # (unlinked while it registered: the store's after_collect ran before)
        return True

    def fill(
        self,
        gpu_uuid: str,
        chunks: Sequence[int],
        sources: Sequence[Source],
        *,
        reserve_bytes: int = 0,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> FilledArena:
        """Create an arena's physical memory on GPU ``gpu_uuid`` (``chunks``: allocation sizes in bytes, in
        address order, each a multiple of the granularity), copy every source in, and export it.

        Args:
            reserve_bytes: device memory to leave free beyond the arena (what the worker's own CUDA restore
                needs on this GPU); less free than the arena plus this is a :class:`PrefillError`.
            cancelled: polled between copies; True stops the fill (a :class:`PrefillError`).

        Raises:
            PrefillError: see the module docstring; nothing stays allocated or registered for the call.
        """
        start = time.monotonic()
        drv = self.drv
        size = sum(chunks)
        if not chunks or any(c <= 0 for c in chunks):
            raise PrefillError(f"bad chunk sizes {list(chunks)[:4]}")
        for s in sources:
            if s.offset < 0 or s.nbytes <= 0 or s.offset + s.nbytes > size:
                raise PrefillError(
                    f"a buffer of {s.nbytes} bytes at offset {s.offset} lies outside the arena of {size}"
                )
            actual = os.fstat(s.fd).st_size
            if actual != s.nbytes:
                raise PrefillError(f"a blob holds {actual} bytes where the snapshot records {s.nbytes}")
        ordinal = self.ordinal_of(gpu_uuid)
        streams = self._enter(ordinal)
        self.drop_unlinked()  # (unpinned before this fill pins more)
        prop = self._prop(ordinal)
        filled = FilledArena(self, ordinal, [], [], size)
        base = 0
        mapped: list[tuple[int, int]] = []
        once: list[_Registered] = []
        try:
            with self._lock:  # check, allocate and promise as one step against other restores' fills
                free, _total = _call(drv, "cuMemGetInfo")
                promised = self._promised.get(ordinal, 0)
                if int(free) - promised < size + reserve_bytes:
                    raise PrefillError(
                        f"GPU {gpu_uuid} has {max(0, int(free) - promised) >> 20} MiB free (not promised to other "
                        f"restores), the arena needs {size >> 20} MiB and the worker's restore {reserve_bytes >> 20} "
                        "MiB more"
                    )
                for c in chunks:
                    filled.handles.append(_call(drv, "cuMemCreate", c, prop, 0))
                self._keep_promise(ordinal, reserve_bytes)
                filled.promised = reserve_bytes
            base = int(_call(drv, "cuMemAddressReserve", size, 0, 0, 0))
            off = 0
            for handle, c in zip(filled.handles, chunks, strict=True):
                _call(drv, "cuMemMap", base + off, c, 0, handle, 0)
                mapped.append((base + off, c))
                off += c
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = ordinal
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _call(drv, "cuMemSetAccess", base, size, [access], 1)
            bounds = [sum(chunks[:i]) for i in range(len(chunks) + 1)]
            n = 0
            for s in sources:
                windows = [(0, s.nbytes)] if s.keep else _windows(s.nbytes, self.window_bytes)
                for start_at, nbytes in windows:
                    if s.keep:
                        reg = self._registration(s, ordinal)
                    else:
                        reg = self._register(s.fd, nbytes, ordinal, start_at)
                        once.append(reg)
                    for dst, length in _pieces(s.offset + start_at, nbytes, bounds):
                        if cancelled():
                            raise PrefillError("the restore ended before the fill")
                        src = reg.address + dst - s.offset - start_at
                        _call(drv, "cuMemcpyAsync", base + dst, src, length, streams[n % len(streams)])
                        n += 1
                    for stream in streams:  # the window's pages are copied before they are unpinned
                        _call(drv, "cuStreamSynchronize", stream)
                    if not s.keep:
                        once.remove(reg)
                        self._unregister(reg)
            self._unmap(base, size, mapped)
            base = 0
            for handle in filled.handles:
                kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                filled.fds.append(int(_call(drv, "cuMemExportToShareableHandle", handle, kind, 0)))
        except BaseException:
            for stream in streams:  # no copy may still target memory released below
                drv.cuStreamSynchronize(stream)
            with contextlib.suppress(PrefillError):  # the first failure is the one to report
                if base:
                    self._unmap(base, size, mapped, strict=False)
                filled.release()
            raise
        finally:
            for reg in once:  # (a failed fill's last window)
                with contextlib.suppress(PrefillError):
                    self._unregister(reg)
        filled.seconds = time.monotonic() - start
        return filled

    def _keep_promise(self, ordinal: int, delta: int) -> None:
        with self._lock:
            self._promised[ordinal] = self._promised.get(ordinal, 0) + delta

    def _unmap(self, base: int, size: int, mapped: list[tuple[int, int]], strict: bool = True) -> None:
        drv = self.drv
        for ptr, c in reversed(mapped):
            out = drv.cuMemUnmap(ptr, c)
            if strict and int(out[0]) != 0:
                raise PrefillError(f"cuMemUnmap failed with {out[0]}")
        mapped.clear()
        out = drv.cuMemAddressFree(base, size)
        if strict and int(out[0]) != 0:
            raise PrefillError(f"cuMemAddressFree failed with {out[0]}")

    def _release(self, ordinal: int, handles: list[Any]) -> None:
        """Release gpusnapd's handles (every one is tried; the first failure raised)."""
        drv = self.drv
        self._enter(ordinal)
        failed = [h for h in handles if int(drv.cuMemRelease(h)[0]) != 0]
        if failed:
            raise PrefillError(f"cuMemRelease failed for {len(failed)} of {len(handles)} handles")

    def _registration(self, source: Source, ordinal: int) -> _Registered:
        """The whole blob's read-only registered mapping, kept for later fills (``source.keep``: a RAM-tier
        blob, whose pages are resident in tmpfs anyway)."""
        st = os.fstat(source.fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            reg = self._registered.get(key)
            if reg is not None and reg.nbytes == source.nbytes:
                reg.ahead = False
                return reg
            if reg is not None:  # (a blob's size never changes: sizes are checked before)
                del self._registered[key]
                self._unregister(reg)
            reg = self._registered[key] = self._register(source.fd, source.nbytes, ordinal)
            self._trim()
            return reg

    def _trim(self) -> None:
        """Drop registrations made ahead (oldest first) while the kept ones exceed ``keep_budget_bytes``; a
        fill's own stay (no fill is using one made ahead: a fill's use turns it into its own). Never raises."""
        for key, reg in list(self._registered.items()):
            if self.registered_bytes() <= self.keep_budget_bytes:
                return
            if reg.ahead:
                self._forget(key, reg)

    def _forget(self, key: tuple[int, int], reg: _Registered) -> None:
        """Unregister a kept registration and forget it; one the driver cannot unregister now is logged and
        kept, to be tried again at a later call. Never raises."""
        try:
            self._unregister(reg)
        except PrefillError as exc:
            log.warning("devicefill.unregister_failed", bytes=reg.nbytes, error=str(exc))
            return
        del self._registered[key]

    def _register(self, fd: int, nbytes: int, ordinal: int, offset: int = 0) -> _Registered:
        """``nbytes`` of ``fd`` from ``offset`` (page-aligned) mapped read-only and registered.

        Raises:
            PrefillError: ``mmap`` or ``cuMemHostRegister`` failed (nothing is left mapped).
        """
        address = _libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if address in (None, ctypes.c_void_p(-1).value):
            raise PrefillError(f"mmap of a blob failed: {os.strerror(ctypes.get_errno())}")
        mine = os.dup(fd)
        try:
            try:
                _call(self.drv, "cuMemHostRegister", address, nbytes, REGISTER_FLAGS)
            except PrefillError:  # a driver without portable read-only registration: this context's only
                _call(self.drv, "cuMemHostRegister", address, nbytes, REGISTER_FLAGS & ~0x01)
        except BaseException:
            _libc.munmap(address, nbytes)
            os.close(mine)
            raise
        return _Registered(mine, int(address), nbytes, ordinal)

    def _unregister(self, reg: _Registered) -> None:
        """Unregister, unmap and close ``reg`` in the context it was made in, then make the caller's context
        current again: a fill that drops another GPU's registration goes on issuing copies to its own
        context's streams (a garbage collection's thread has none current)."""
        previous = _call(self.drv, "cuCtxGetCurrent")
        self._enter(reg.ordinal)
        try:
            self.drv.cuMemHostUnregister(reg.address)
        finally:
            if int(previous or 0):
                _call(self.drv, "cuCtxSetCurrent", previous)
        _libc.munmap(reg.address, reg.nbytes)
        os.close(reg.fd)

    def _drop_unlinked(self) -> None:
        """Forget cached registrations of blobs the store removed (their pages would stay pinned). One the
        driver cannot unregister now is logged and kept, to be tried again at the next call; never raises."""
        for key, reg in list(self._registered.items()):
            if os.fstat(reg.fd).st_nlink == 0:
                self._forget(key, reg)

    def drop_unlinked(self) -> None:
        """Unregister blobs the store has removed (its garbage collection and budget passes call this, so it
        never raises: a snapshot's deletion must not fail after the fact)."""
        with self._lock:
            self._drop_unlinked()

    def registered_bytes(self) -> int:
        """Bytes of blobs whose registration is kept."""
        with self._lock:
            return sum(r.nbytes for r in self._registered.values())

    def close(self) -> None:
        """Drop every kept registration (the contexts stay until the process exits)."""
        with self._lock:
            for reg in self._registered.values():
                self._unregister(reg)
            self._registered.clear()


def _windows(nbytes: int, window_bytes: int = WINDOW_BYTES) -> list[tuple[int, int]]:
    """``(offset, bytes)`` windows of a blob of ``nbytes``, ``window_bytes`` each but the last."""
    return [(w, min(window_bytes, nbytes - w)) for w in range(0, nbytes, window_bytes)]


def _pieces(offset: int, nbytes: int, bounds: Sequence[int], piece_bytes: int = PIECE_BYTES) -> list[tuple[int, int]]:
    """``(arena offset, bytes)`` pieces of the span, at most ``piece_bytes`` each, none across a chunk
    boundary (``bounds``: chunk start offsets, then the arena's size)."""
    out = []
    pos, end = offset, offset + nbytes
    i = 0
    while pos < end:
        while bounds[i + 1] <= pos:
            i += 1
        stop = min(end, bounds[i + 1], pos + piece_bytes)
        out.append((pos, stop - pos))
        pos = stop
    return out
