"""A fake of the CUDA driver's virtual memory management calls (the part of ``cuda.bindings.driver`` that
:mod:`gpusnap.adapters.vmm` uses), backed by real host memory so that tensors over an arena hold data.

Semantics modelled on the CUDA Driver API ("Virtual Memory Management"):

* ``cuMemAddressReserve`` reserves address space: here an ``mmap(PROT_NONE)`` of host memory, so a touch of
  reserved-but-unmapped memory faults, as on the GPU.
* ``cuMemCreate`` makes a physical allocation (a handle) of a multiple of the granularity, counted against
  ``capacity`` (``CUDA_ERROR_OUT_OF_MEMORY`` past it); ``cuMemRelease`` frees it once it is unmapped.
* ``cuMemMap`` maps a whole handle into a reserved, unmapped range (``CUDA_ERROR_INVALID_VALUE`` otherwise);
  new memory is filled with 0xA5 (physical memory comes back with undefined contents). It is not
  accessible until ``cuMemSetAccess`` covers it (``PROT_NONE`` until then).
* ``cuMemUnmap`` must name exactly a mapped range; ``cuMemAddressFree`` needs the range fully unmapped.
* Shareable handles (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``): a physical allocation is a memfd, so
  the hand-off between processes is real. ``cuMemExportToShareableHandle`` returns a ``dup`` of it (only for
  an allocation created with ``requestedHandleTypes`` naming POSIX descriptors, else
  ``CUDA_ERROR_INVALID_VALUE``, as the driver does); ``cuMemImportFromShareableHandle`` in any process gives
  a handle over a ``dup`` of the descriptor it is given; ``cuMemMap`` maps the memfd ``MAP_SHARED |
  MAP_FIXED`` over the reserved ``PROT_NONE`` range, so both processes see the same bytes.
* The daemon's side of a fill: devices (``cuDeviceGetCount``, ``cuDeviceGetUuid``: ordinal ``i`` is
  ``uuid_of(i)``), ``cuDeviceGetAttribute`` (``attributes``), ``cuMemGetInfo`` (``capacity`` minus what live
  handles hold), streams (each of the context current at ``cuStreamCreate``), ``cuMemHostRegister``/
  ``cuMemHostUnregister`` (tracked in ``registered``) and ``cuMemcpyAsync`` (a ``memmove`` from host memory
  into mapped, accessible memory, on a stream of the current context: ``CUDA_ERROR_INVALID_CONTEXT`` else).
* Stream capture: ``cuThreadExchangeStreamCaptureMode`` swaps the calling thread's capture mode (tracked in
  ``capture_mode``; global by default); ``cuCtxSynchronize`` is recorded and returns at once (no work runs).

:meth:`FakeVmmDriver.fail` makes the Nth call of a function return an error; :attr:`FakeVmmDriver.calls`
records every call in order.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import resource
import types
from dataclasses import dataclass, field
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_NOT_SUPPORTED = 801


OK = CUresult.CUDA_SUCCESS
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FIXED = 0x10
PROT_NONE = 0
MAP_NORESERVE = 0x4000


def _mmap(addr: int, size: int, prot: int, fixed: bool, fd: int = -1) -> int:
    kind = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS if fd < 0 else mmap.MAP_SHARED
    flags = kind | MAP_NORESERVE | (MAP_FIXED if fixed else 0)
    out = _libc.mmap(addr or None, size, prot, flags, fd, 0)
    if out in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(out)


def _size_memfd(memfd: int, size: int) -> None:
    """``ftruncate`` the memfd behind a physical allocation, outside the process's file-size limit: device
    memory is no file, and a test that limits a worker's file sizes (to make its weight writes fail) must not
    make its "device" allocations fail too."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    try:
        os.ftruncate(memfd, size)
    finally:
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


class _Struct(types.SimpleNamespace):
    pass


def _location() -> _Struct:
    return _Struct(type=0, id=0)


POSIX_FD = 1
VMM_ATTRIBUTE = 102
POSIX_FD_ATTRIBUTE = 103


def uuid_of(ordinal: int) -> bytes:
    """The 16 ``CUuuid`` bytes of fake device ``ordinal`` (NVML form: ``fakes_nvml.fake_uuid(ordinal)``)."""
    return bytes.fromhex(f"{ordinal:08x}111142228333{ordinal:012x}")


@dataclass
class FakeVmmDriver:
    """Host-memory stand-in for ``cuda.bindings.driver`` (VMM calls only).

    Args:
        granularity: allocation granularity in bytes (a multiple of the host page size).
        capacity: bytes of "device memory" that live handles may hold.
    """

    granularity: int = 64 << 10
    capacity: int = 1 << 30
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    devices: int = 1
    attributes: dict[int, int] = field(default_factory=lambda: {VMM_ATTRIBUTE: 1, POSIX_FD_ATTRIBUTE: 1})

    # enums and structs, under the names cuda.bindings uses
    CUresult = CUresult
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=POSIX_FD)
    CUstreamCaptureMode = types.SimpleNamespace(
        CU_STREAM_CAPTURE_MODE_GLOBAL=0, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1, CU_STREAM_CAPTURE_MODE_RELAXED=2
    )
    CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=VMM_ATTRIBUTE,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=POSIX_FD_ATTRIBUTE,
    )

    def __post_init__(self) -> None:
        self.reserved: dict[int, int] = {}  # start -> size
        self.handles: dict[int, int] = {}  # handle -> size (live, created here)
        self.imported: dict[int, int] = {}  # handle -> size (live, imported from a descriptor)
        self.memfds: dict[int, int] = {}  # handle -> the memfd behind it
        self.exportable: set[int] = set()  # handles created with POSIX descriptors requested
        self.fresh: set[int] = set()  # handles never mapped (their first map fills 0xA5)
        self.registered: dict[int, int] = {}  # host address -> bytes (cuMemHostRegister)
        self.streams: dict[int, int] = {}  # stream -> the context current at its creation
        self.mappings: dict[int, tuple[int, int]] = {}  # start -> (size, handle)
        self.accessible: set[int] = set()  # mapping starts with access set
        self.context = 0
        self.capture_mode = 0  # CU_STREAM_CAPTURE_MODE_GLOBAL (per thread on the GPU; one thread here)
        self._next_handle = 1
        self._faults: dict[str, list[tuple[int, CUresult]]] = {}
        self._counts: dict[str, int] = {}

    @staticmethod
    def CUmemAllocationProp() -> _Struct:  # noqa: N802 (the binding's name)
        return _Struct(type=0, location=_location(), requestedHandleTypes=0)

    @staticmethod
    def CUmemAccessDesc() -> _Struct:  # noqa: N802
        return _Struct(location=_location(), flags=0)

    # -- fault injection -----------------------------------------------------------------------------

    def fail(self, call: str, *, on_call: int = 1, result: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """Make the ``on_call``-th call of ``call`` (counted from now) return ``result``, changing nothing."""
        self._faults.setdefault(call, []).append((self._counts.get(call, 0) + on_call, result))

    def _enter(self, call: str, *args: Any) -> CUresult | None:
        self.calls.append((call, args))
        n = self._counts[call] = self._counts.get(call, 0) + 1
        for nth, result in self._faults.get(call, []):
            if nth == n:
                return result
        return None

    def names(self) -> list[str]:
        """The calls made so far, by name."""
        return [c for c, _ in self.calls]

    def used(self) -> int:
        return sum(self.handles.values())

    def live(self) -> int:
        """Handles and memfds still held (created or imported): 0 once everything was released."""
        return len(self.handles) + len(self.imported) + len(self.memfds)

    # -- the calls ------------------------------------------------------------------------------------

    def cuInit(self, flags: int) -> tuple[CUresult]:  # noqa: N802
        return (self._enter("cuInit", flags) or OK,)

    def cuCtxGetCurrent(self) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuCtxGetCurrent") or OK, self.context)

    def cuCtxSynchronize(self) -> tuple[CUresult]:  # noqa: N802
        return (self._enter("cuCtxSynchronize") or OK,)

    def cuThreadExchangeStreamCaptureMode(self, mode: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuThreadExchangeStreamCaptureMode", mode)
        if err is not None:
            return (err, mode)
        old, self.capture_mode = self.capture_mode, mode
        return (OK, old)

    def cuDeviceGet(self, ordinal: int) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuDeviceGet", ordinal) or OK, ordinal)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuDevicePrimaryCtxRetain", dev) or OK, 0x1000 + dev)

    def cuCtxSetCurrent(self, ctx: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuCtxSetCurrent", ctx)
        if err is None:
            self.context = ctx
        return (err or OK,)

    def cuMemGetAllocationGranularity(self, prop: Any, option: int) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuMemGetAllocationGranularity", option) or OK, self.granularity)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: int, flags: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuMemAddressReserve", size, alignment)
        if err is not None:
            return (err, 0)
        if size % self.granularity:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        start = _mmap(0, size, PROT_NONE, fixed=False)
        self.reserved[start] = size
        return (OK, start)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemAddressFree", ptr, size)
        if err is not None:
            return (err,)
        if self.reserved.get(ptr) != size or any(ptr <= m < ptr + size for m in self.mappings):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _libc.munmap(ptr, size)
        del self.reserved[ptr]
        return (OK,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuMemCreate", size, prop.location.id)
        if err is not None:
            return (err, 0)
        if size % self.granularity or size <= 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        if self.used() + size > self.capacity:
            return (CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0)
        if not 0 <= prop.location.id < self.devices:
            return (CUresult.CUDA_ERROR_INVALID_DEVICE, 0)
        handle = self._new_handle(os.memfd_create("fake-cuda-physical", os.MFD_CLOEXEC), size)
        self.handles[handle] = size
        self.fresh.add(handle)
        if getattr(prop, "requestedHandleTypes", 0) & POSIX_FD:
            self.exportable.add(handle)
        return (OK, handle)

    def _new_handle(self, memfd: int, size: int) -> int:
        _size_memfd(memfd, size)
        handle = self._next_handle
        self._next_handle += 1
        self.memfds[handle] = memfd
        return handle

    def cuMemExportToShareableHandle(self, handle: int, kind: int, flags: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuMemExportToShareableHandle", handle, kind)
        if err is not None:
            return (err, 0)
        if handle not in self.exportable or kind != POSIX_FD:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        return (OK, os.dup(self.memfds[handle]))

    def cuMemImportFromShareableHandle(self, fd: int, kind: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuMemImportFromShareableHandle", fd, kind)
        if err is not None:
            return (err, 0)
        try:
            size = os.fstat(fd).st_size
        except OSError:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        if kind != POSIX_FD or size <= 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        handle = self._new_handle(os.dup(fd), size)
        self.imported[handle] = size
        return (OK, handle)

    def _size_of(self, handle: int) -> int | None:
        return self.handles.get(handle, self.imported.get(handle))

    def cuMemRelease(self, handle: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemRelease", handle)
        if err is not None:
            return (err,)
        if self._size_of(handle) is None or any(h == handle for _, h in self.mappings.values()):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # (the real driver defers; gpusnap unmaps first)
        self.handles.pop(handle, None)
        self.imported.pop(handle, None)
        self.exportable.discard(handle)
        self.fresh.discard(handle)
        os.close(self.memfds.pop(handle))
        return (OK,)

    def _reservation_of(self, ptr: int, size: int) -> bool:
        return any(s <= ptr and ptr + size <= s + n for s, n in self.reserved.items())

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemMap", ptr, size, handle)
        if err is not None:
            return (err,)
        overlaps = any(m < ptr + size and ptr < m + n for m, (n, _) in self.mappings.items())
        if self._size_of(handle) != size or offset or overlaps or not self._reservation_of(ptr, size):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _mmap(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE, fixed=True, fd=self.memfds[handle])
        if handle in self.fresh:
            ctypes.memset(ptr, 0xA5, size)  # new physical memory: undefined contents
            self.fresh.discard(handle)
        _libc.mprotect(ptr, size, PROT_NONE)  # no access until cuMemSetAccess
        self.mappings[ptr] = (size, handle)
        return (OK,)

    def cuMemSetAccess(self, ptr: int, size: int, desc: list[Any], count: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemSetAccess", ptr, size, count)
        if err is not None:
            return (err,)
        inside = sorted((m, n) for m, (n, _) in self.mappings.items() if ptr <= m < ptr + size)
        covered = ptr
        for m, n in inside:
            if m != covered:
                break
            covered = m + n
        if covered < ptr + size or count != len(desc) or desc[0].flags != 3:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _libc.mprotect(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE)
        self.accessible.update(m for m, _ in inside)
        return (OK,)

    def cuMemUnmap(self, ptr: int, size: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemUnmap", ptr, size)
        if err is not None:
            return (err,)
        if ptr not in self.mappings or self.mappings[ptr][0] != size:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _mmap(ptr, size, PROT_NONE, fixed=True)  # back to reserved: the pages are gone
        del self.mappings[ptr]
        self.accessible.discard(ptr)
        return (OK,)

    # -- devices, streams, copies (the daemon's side of a fill) ----------------------------------------

    def cuDeviceGetCount(self) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuDeviceGetCount") or OK, self.devices)

    def cuDeviceGetUuid(self, dev: int) -> tuple[CUresult, Any]:  # noqa: N802
        err = self._enter("cuDeviceGetUuid", dev)
        if err is None and not 0 <= dev < self.devices:
            err = CUresult.CUDA_ERROR_INVALID_DEVICE
        return (err or OK, types.SimpleNamespace(bytes=uuid_of(dev)))

    def cuDeviceGetAttribute(self, attribute: int, dev: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuDeviceGetAttribute", attribute, dev)
        return (err or OK, self.attributes.get(attribute, 0))

    def cuMemGetInfo(self) -> tuple[CUresult, int, int]:  # noqa: N802
        err = self._enter("cuMemGetInfo")
        return (err or OK, self.capacity - self.used(), self.capacity)

    def cuStreamCreate(self, flags: int) -> tuple[CUresult, int]:  # noqa: N802
        err = self._enter("cuStreamCreate", flags)
        if err is not None:
            return (err, 0)
        stream = 0x5000 + len(self.streams)
        self.streams[stream] = self.context
        return (OK, stream)

    def cuStreamSynchronize(self, stream: int) -> tuple[CUresult]:  # noqa: N802
        return (self._enter("cuStreamSynchronize", stream) or OK,)

    def cuMemHostRegister(self, ptr: int, size: int, flags: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemHostRegister", ptr, size, flags)
        if err is not None:
            return (err,)
        if ptr in self.registered:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[ptr] = size
        return (OK,)

    def cuMemHostUnregister(self, ptr: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemHostUnregister", ptr)
        if err is not None:
            return (err,)
        if self.registered.pop(ptr, None) is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (OK,)

    def cuMemcpyAsync(self, dst: int, src: int, size: int, stream: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemcpyAsync", dst, src, size, stream)
        if err is not None:
            return (err,)
        if self.streams.get(stream) != self.context:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)  # a stream's work is issued in its own context
        inside = [m for m, (n, _) in self.mappings.items() if m <= dst and dst + size <= m + n]
        registered = any(p <= src and src + size <= p + n for p, n in self.registered.items())
        if not inside or inside[0] not in self.accessible or not registered:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # only mapped device memory, from registered host memory
        ctypes.memmove(dst, src, size)
        return (OK,)

    # -- tensors over arena bytes (host memory here, so torch CPU tensors) ----------------------------

    def bytes_tensor(self, arena: Any, address: int, nbytes: int) -> Any:
        import torch

        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        raw.arena = arena  # type: ignore[attr-defined]  # the tensor keeps the arena alive
        return torch.frombuffer(raw, dtype=torch.uint8)
