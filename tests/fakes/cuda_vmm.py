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

:meth:`FakeVmmDriver.fail` makes the Nth call of a function return an error; :attr:`FakeVmmDriver.calls`
records every call in order.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import types
from dataclasses import dataclass, field
from typing import Any


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
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


def _mmap(addr: int, size: int, prot: int, fixed: bool) -> int:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if fixed else 0)
    out = _libc.mmap(addr or None, size, prot, flags, -1, 0)
    if out in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return int(out)


class _Struct(types.SimpleNamespace):
    pass


def _location() -> _Struct:
    return _Struct(type=0, id=0)


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

    # enums and structs, under the names cuda.bindings uses
    CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)

    def __post_init__(self) -> None:
        self.reserved: dict[int, int] = {}  # start -> size
        self.handles: dict[int, int] = {}  # handle -> size (live)
        self.mappings: dict[int, tuple[int, int]] = {}  # start -> (size, handle)
        self.accessible: set[int] = set()  # mapping starts with access set
        self.context = 0
        self._next_handle = 1
        self._faults: dict[str, list[tuple[int, CUresult]]] = {}
        self._counts: dict[str, int] = {}

    @staticmethod
    def CUmemAllocationProp() -> _Struct:  # noqa: N802 (the binding's name)
        return _Struct(type=0, location=_location())

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

    # -- the calls ------------------------------------------------------------------------------------

    def cuInit(self, flags: int) -> tuple[CUresult]:  # noqa: N802
        return (self._enter("cuInit", flags) or OK,)

    def cuCtxGetCurrent(self) -> tuple[CUresult, int]:  # noqa: N802
        return (self._enter("cuCtxGetCurrent") or OK, self.context)

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
        handle = self._next_handle
        self._next_handle += 1
        self.handles[handle] = size
        return (OK, handle)

    def cuMemRelease(self, handle: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemRelease", handle)
        if err is not None:
            return (err,)
        if handle not in self.handles or any(h == handle for _, h in self.mappings.values()):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)  # (the real driver defers; gpusnap unmaps first)
        del self.handles[handle]
        return (OK,)

    def _reservation_of(self, ptr: int, size: int) -> bool:
        return any(s <= ptr and ptr + size <= s + n for s, n in self.reserved.items())

    def cuMemMap(self, ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[CUresult]:  # noqa: N802
        err = self._enter("cuMemMap", ptr, size, handle)
        if err is not None:
            return (err,)
        overlaps = any(m < ptr + size and ptr < m + n for m, (n, _) in self.mappings.items())
        if self.handles.get(handle) != size or offset or overlaps or not self._reservation_of(ptr, size):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        _mmap(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE, fixed=True)
        ctypes.memset(ptr, 0xA5, size)  # new physical memory: undefined contents
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

    # -- tensors over arena bytes (host memory here, so torch CPU tensors) ----------------------------

    def bytes_tensor(self, arena: Any, address: int, nbytes: int) -> Any:
        import torch

        raw = (ctypes.c_uint8 * nbytes).from_address(address)
        raw.arena = arena  # type: ignore[attr-defined]  # the tensor keeps the arena alive
        return torch.frombuffer(raw, dtype=torch.uint8)
