"""Address-stable device memory for named tensors: CUDA virtual memory management (VMM).

A CUDA graph captured at start reads its weights at fixed device addresses. gpusnap's offload frees the
weights at capture and allocates them again at reload, so without help they come back elsewhere and the
graph reads freed memory. An :class:`Arena` keeps the addresses: it reserves a virtual address range once
(``cuMemAddressReserve``) and backs it with physical memory (``cuMemCreate`` + ``cuMemMap`` +
``cuMemSetAccess``). At offload :meth:`Arena.release` unmaps and releases the physical memory
(``cuMemUnmap`` + ``cuMemRelease``) while the range stays reserved; at reload :meth:`Arena.remap` creates
and maps new physical memory at the same addresses. This is what vLLM's sleep mode (``CuMemAllocator``) and
SGLang's ``torch_memory_saver`` do; gpusnap's GPU test (``tests/gpu/test_vmm.py``) checks on the H200 that a
reserved, unmapped range survives ``gpusnap suspend``/``resume`` and ``dump --no-quiesce``/``restore``, and
that memory kept mapped comes back intact (``docs/performance.md``, "Address-stable weights").

Use :func:`stabilize` once the model is built and before any CUDA graph is captured::

    from gpusnap.adapters import vmm
    vmm.stabilize(dict(model.named_parameters()))   # same tensor objects, now in an arena
    # ... capture CUDA graphs, then name the same tensors as buffers (TorchAdapter(buffers=...))

The buffers path (:mod:`gpusnap.adapters.buffers`) recognises arena-backed storages: it copies them out
and back as usual, and releases/re-maps the arena instead of resizing the storages. With
``gpusnapd --gpu-prefill`` a restore skips that copy: the daemon creates and fills the arena's physical
memory while CRIU restores the worker and hands it over as shareable handles (POSIX file descriptors),
which :meth:`Arena.adopt` imports and maps at the same addresses (:meth:`Arena.layout` describes the
arena for it; ``agent.proto``, MapArenas).

In an engine's worker process (e.g. vLLM's ``Worker``, docs/engines.md): call :func:`stabilize` on the
model's parameters once they are loaded and post-processed (after ``Worker.load_model``) and before the
engine captures its graphs (``Worker.compile_or_warm_up_model``); then have the adapter's ``buffers()``
name those same tensors, and only tensors for which :func:`is_stable` holds, since a plain storage that a
graph reads would come back elsewhere.

Why not torch's own facilities (torch 2.11): expandable segments use VMM inside the caching allocator but
map and unmap at the allocator's will, with no API to release a tensor's memory and keep its address;
``torch.cuda.MemPool`` with ``CUDAPluggableAllocator`` needs a compiled allocator library (vLLM ships one
for sleep mode). An arena needs neither: tensors are made over its bytes through
``__cuda_array_interface__`` and given to the named tensors with ``Tensor.set_``.

Driver calls go through ``cuda.bindings.driver`` (cuda-bindings >= 13.3), imported when first used; every
result is checked and a failure raises :class:`VmmError` naming the call, the result and the fix. VMM calls
are synchronous driver calls with no timeout parameter. Requires torch for tensors (imported when used).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Iterable, Mapping
from typing import Any

ALIGN = 512
"""Byte alignment of each storage placed in an arena (torch's caching allocator aligns blocks to 512)."""
CHUNK_BYTES = 1 << 30
"""Largest physical allocation (one ``cuMemCreate``) behind an arena; bigger arenas use several."""

_REMEDIES = {
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU has too little free memory for the arena; free GPU memory (another "
    "process may hold it) and retry",
    "CUDA_ERROR_NOT_SUPPORTED": "the GPU or driver lacks CUDA virtual memory management (needs a CUDA 10.2+ "
    "driver and a GPU with UVA); leave stable addresses off",
    "CUDA_ERROR_INVALID_VALUE": "an address, size or handle was wrong (a range mapped twice, or a size that is "
    "not a multiple of the allocation granularity): a gpusnap bug, please report it",
    "CUDA_ERROR_NOT_INITIALIZED": "the CUDA driver is not initialised in this process",
}


class VmmError(RuntimeError):
    """A CUDA driver VMM call failed.

    Attributes:
        call: the driver function, e.g. ``"cuMemMap"``.
        result: the ``CUresult`` value as an int.
        result_name: e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``.
    """

    def __init__(self, call: str, result: int, result_name: str, detail: str = ""):
        self.call = call
        self.result = result
        self.result_name = result_name
        remedy = _REMEDIES.get(result_name, "")
        super().__init__(
            f"{call} failed with {result_name} ({result})"
            + (f" {detail}" if detail else "")
            + (f"; {remedy}" if remedy else "")
        )


_driver_lock = threading.Lock()
_driver_module: Any = None


def default_driver() -> Any:
    """``cuda.bindings.driver``, imported and ``cuInit``-ed on first use.

    Raises:
        VmmError: ``cuInit`` failed. ImportError: cuda-bindings is not installed.
    """
    global _driver_module
    with _driver_lock:
        if _driver_module is None:
            from cuda.bindings import driver

            _check(driver, "cuInit", driver.cuInit(0))
            _driver_module = driver
        return _driver_module


def set_default_driver(driver: Any) -> None:
    """Make ``driver`` what :func:`default_driver` hands out in this process: an object with the calls of
    ``cuda.bindings.driver`` that arenas use (a process whose "device" memory is host memory, such as the
    CPU tests' fake in ``tests/fakes/cuda_vmm.py``, installs its own this way)."""
    global _driver_module
    with _driver_lock:
        _driver_module = driver


def installed_driver() -> Any:
    """The driver :func:`default_driver` hands out, if one is set up already (``None`` before the first
    arena and without :func:`set_default_driver`); never initialises CUDA."""
    return _driver_module


def _check(drv: Any, call: str, out: Any, detail: str = "") -> Any:
    """The call's results after its ``CUresult`` (``None``, one value, or a tuple); raises on failure."""
    err, rest = out[0], tuple(out[1:])
    if int(err) != 0:
        name = getattr(err, "name", None) or f"CUresult({int(err)})"
        raise VmmError(call, int(err), str(name), detail)
    return None if not rest else rest[0] if len(rest) == 1 else rest


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


_arenas_lock = threading.Lock()
_arenas: list[tuple[int, int, Arena]] = []
"""Live arenas as (start, end, arena), sorted by start address: for :func:`arena_of`."""


def arena_of(address: int) -> Arena | None:
    """The live arena whose reserved range holds ``address`` (a device pointer), or ``None``."""
    with _arenas_lock:
        i = bisect.bisect_right(_arenas, address, key=lambda e: e[0]) - 1
        if i >= 0 and _arenas[i][0] <= address < _arenas[i][1]:
            return _arenas[i][2]
    return None


class Arena:
    """One reserved virtual address range on one GPU, with physical memory that can be released and
    re-created at the same addresses.

    Args:
        nbytes: bytes wanted; rounded up to the allocation granularity (2 MiB on Hopper).
        device: CUDA device ordinal.
        driver: the ``cuda.bindings.driver`` module (default), or a fake with the same calls.
        chunk_bytes: largest single physical allocation (default: ``CHUNK_BYTES`` when called).
        mapped: back the whole range with physical memory now (default); ``False`` only reserves it, and
            :meth:`map_span` backs it piece by piece (so a caller moving storages in can free the old ones
            as it goes, never holding both copies of everything).

    Raises:
        VmmError: a driver call failed; nothing stays reserved or allocated.
    """

    def __init__(
        self,
        nbytes: int,
        device: int = 0,
        *,
        driver: Any = None,
        chunk_bytes: int | None = None,
        mapped: bool = True,
    ):
        if nbytes <= 0:
            raise ValueError(f"an arena needs a positive size, not {nbytes}")
        self.drv = driver if driver is not None else default_driver()
        self.device = device
        drv = self.drv
        self._ensure_context()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self._prop = prop
        gran = int(
            _check(
                drv,
                "cuMemGetAllocationGranularity",
                drv.cuMemGetAllocationGranularity(
                    prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
            )
        )
        self.granularity = gran
        self.size = _round_up(nbytes, gran)
        chunk = max(gran, (chunk_bytes or CHUNK_BYTES) // gran * gran)
        self._chunks = [(off, min(chunk, self.size - off)) for off in range(0, self.size, chunk)]
        self._handles: list[Any] = [None] * len(self._chunks)
        self._mapped = [False] * len(self._chunks)
        self.ptr = int(
            _check(
                drv,
                "cuMemAddressReserve",
                drv.cuMemAddressReserve(self.size, gran, 0, 0),
                f"(reserving {self.size} bytes of address space on GPU {device})",
            )
        )
        self.closed = False
        self._used = 0
        self._spans: dict[int, int] = {}  # start address -> bytes, of storages placed here
        self._out: set[int] = set()  # start addresses of spans written out and waiting for release/remap
        try:
            if mapped:
                self.remap()
        except BaseException:
            _check(drv, "cuMemAddressFree", drv.cuMemAddressFree(self.ptr, self.size))
            raise
        with _arenas_lock:
            bisect.insort(_arenas, (self.ptr, self.ptr + self.size, self), key=lambda e: e[0])

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Sizes in bytes of the physical allocations behind the range, in address order."""
        return tuple(size for _, size in self._chunks)

    @property
    def mapped(self) -> bool:
        """True while physical memory backs the whole range."""
        return all(self._mapped)

    def _ensure_context(self) -> None:
        """Make the device's primary context current on this thread if no context is (driver calls need one;
        torch's runtime makes it current on threads that used CUDA)."""
        drv = self.drv
        ctx = _check(drv, "cuCtxGetCurrent", drv.cuCtxGetCurrent())
        if ctx is None or int(ctx) == 0:
            dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(self.device))
            ctx = _check(drv, "cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
            _check(drv, "cuCtxSetCurrent", drv.cuCtxSetCurrent(ctx))

    def remap(self) -> None:
        """Back the whole range with new physical memory, at the same addresses (contents undefined).

        A no-op when mapped. On failure every chunk this call mapped is unmapped and released again, so
        the arena is left reserved and unmapped.

        Raises:
            VmmError: e.g. ``CUDA_ERROR_OUT_OF_MEMORY`` when the GPU has no room.
        """
        if self.closed:
            raise RuntimeError("the arena is closed")
        if self.mapped:
            return
        drv = self.drv
        self._ensure_context()
        done: list[int] = []
        try:
            for i in range(len(self._chunks)):
                if not self._mapped[i]:
                    self._map_chunk(i)
                    done.append(i)
            _check(drv, "cuMemSetAccess", drv.cuMemSetAccess(self.ptr, self.size, [self._access()], 1))
        except BaseException:
            for i in reversed(done):
                self._drop(i)
            raise

    def map_span(self, address: int, nbytes: int) -> None:
        """Back the chunks covering ``[address, address + nbytes)`` with new physical memory, where they are
        not backed yet, and make them accessible (contents undefined). On failure the chunks this call
        mapped are given back.

        Raises:
            ValueError: the span is outside the arena.
            VmmError: e.g. ``CUDA_ERROR_OUT_OF_MEMORY``.
        """
        if self.closed:
            raise RuntimeError("the arena is closed")
        if not (self.ptr <= address and nbytes >= 0 and address + nbytes <= self.ptr + self.size):
            raise ValueError("span outside the arena")
        start, end = address - self.ptr, address - self.ptr + max(nbytes, 1)
        wanted = [i for i, (off, size) in enumerate(self._chunks) if off < end and start < off + size]
        todo = [i for i in wanted if not self._mapped[i]]
        if not todo:
            return
        self._ensure_context()
        done: list[int] = []
        try:
            for i in todo:
                self._map_chunk(i)
                done.append(i)
                off, size = self._chunks[i]
                _check(self.drv, "cuMemSetAccess", self.drv.cuMemSetAccess(self.ptr + off, size, [self._access()], 1))
        except BaseException:
            for i in reversed(done):
                self._drop(i)
            raise

    def _map_chunk(self, i: int) -> None:
        """Create chunk ``i``'s physical memory and map it at its address (not yet accessible); on a failed
        map the new handle is released again."""
        drv = self.drv
        off, size = self._chunks[i]
        handle = _check(
            drv, "cuMemCreate", drv.cuMemCreate(size, self._prop, 0), f"({size} bytes on GPU {self.device})"
        )
        self._handles[i] = handle
        try:
            _check(
                drv,
                "cuMemMap",
                drv.cuMemMap(self.ptr + off, size, 0, handle, 0),
                f"(at {self.ptr + off:#x}, {size} bytes)",
            )
        except BaseException:
            self._drop(i)
            raise
        self._mapped[i] = True

    def adopt(self, fds: list[int]) -> None:
        """Back the released range with physical memory another process created and filled: one shareable
        handle per chunk (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, in address order), imported
        (``cuMemImportFromShareableHandle``), mapped at the same addresses (``cuMemMap``) and made accessible
        (``cuMemSetAccess``). The descriptors stay the caller's to close. On failure everything this call
        imported or mapped is given back, leaving the arena reserved and unmapped.

        Raises:
            ValueError: the arena is mapped, or ``fds`` does not have one descriptor per chunk.
            VmmError: a driver call failed (e.g. a descriptor of the wrong size: ``CUDA_ERROR_INVALID_VALUE``).
        """
        if self.closed or any(self._mapped) or any(h is not None for h in self._handles):
            raise ValueError("only a released arena can adopt memory")
        if len(fds) != len(self._chunks):
            raise ValueError(f"{len(fds)} descriptors for an arena of {len(self._chunks)} chunks")
        drv = self.drv
        self._ensure_context()
        kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        try:
            for i, ((off, size), fd) in enumerate(zip(self._chunks, fds, strict=True)):
                self._handles[i] = _check(
                    drv, "cuMemImportFromShareableHandle", drv.cuMemImportFromShareableHandle(fd, kind)
                )
                _check(
                    drv,
                    "cuMemMap",
                    drv.cuMemMap(self.ptr + off, size, 0, self._handles[i], 0),
                    f"(an imported chunk at {self.ptr + off:#x}, {size} bytes)",
                )
                self._mapped[i] = True
            _check(drv, "cuMemSetAccess", drv.cuMemSetAccess(self.ptr, self.size, [self._access()], 1))
        except BaseException:
            for i in reversed(range(len(self._chunks))):
                self._drop(i)
            raise

    def _access(self) -> Any:
        access = self.drv.CUmemAccessDesc()
        access.location.type = self.drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = self.drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return access

    def layout(self) -> ArenaLayout:
        """What another process needs to create this arena's physical memory (:class:`ArenaLayout`).

        Raises:
            VmmError: ``cuDeviceGetUuid`` failed.
        """
        drv = self.drv
        dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(self.device))
        raw = _check(drv, "cuDeviceGetUuid", drv.cuDeviceGetUuid(dev)).bytes
        h = (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()
        return ArenaLayout(
            gpu_uuid=f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}",
            size=self.size,
            granularity=self.granularity,
            chunks=self.chunk_sizes,
            storages=len(self._spans),
        )

    def offset_of(self, address: int) -> int:
        """Byte offset from the arena's start of the storage placed at ``address``.

        Raises:
            KeyError: no storage starts there.
        """
        if address not in self._spans:
            raise KeyError(f"no storage starts at {address:#x} in this arena")
        return address - self.ptr

    def _drop(self, i: int) -> None:
        """Unmap chunk ``i`` (if mapped) and release its handle (if any)."""
        off, size = self._chunks[i]
        if self._mapped[i]:
            _check(self.drv, "cuMemUnmap", self.drv.cuMemUnmap(self.ptr + off, size))
            self._mapped[i] = False
        if self._handles[i] is not None:
            _check(self.drv, "cuMemRelease", self.drv.cuMemRelease(self._handles[i]))
            self._handles[i] = None

    def release(self) -> None:
        """Unmap and release the physical memory; the address range stays reserved (contents are lost).

        The caller makes sure no GPU work uses the range (e.g. ``torch.cuda.synchronize``). Retrying after
        a failure continues with the chunks still held.

        Raises:
            VmmError: ``cuMemUnmap`` or ``cuMemRelease`` failed.
        """
        self._ensure_context()
        for i in range(len(self._chunks)):
            self._drop(i)

    def close(self) -> None:
        """Release the memory and free the address range (tensors over it must be gone)."""
        if self.closed:
            return
        self.release()
        _check(self.drv, "cuMemAddressFree", self.drv.cuMemAddressFree(self.ptr, self.size))
        self.closed = True
        with _arenas_lock:
            _arenas[:] = [e for e in _arenas if e[2] is not self]

    # -- placing storages --------------------------------------------------------------------------

    def place(self, nbytes: int) -> int:
        """Reserve ``nbytes`` of the arena for one storage; returns its device address.

        Raises:
            MemoryError: the arena is full.
        """
        start = _round_up(self._used, ALIGN)
        if start + nbytes > self.size:
            raise MemoryError(f"arena of {self.size} bytes is full ({nbytes} more bytes asked)")
        self._used = start + nbytes
        self._spans[self.ptr + start] = nbytes
        return self.ptr + start

    @property
    def used(self) -> int:
        """Bytes from the arena's start to the end of the last storage placed."""
        return self._used

    def seal(self) -> int:
        """Count everything placed so far as one storage, at the arena's start, so that the arena is written
        out and read back (or prefilled) as one buffer instead of one per storage placed; returns its bytes
        (:attr:`used`). Storages placed later are storages of their own again.

        Raises:
            RuntimeError: a storage of the arena is written out (sealing would lose track of it).
        """
        if self._out:
            raise RuntimeError("an arena with storages written out cannot be sealed")
        if self._used:
            self._spans = {self.ptr: self._used}
        return self._used

    def mark_out(self, address: int) -> bool:
        """Note that the storage at ``address`` was written out; True once every storage placed in the
        arena is (then the arena may be released without losing data)."""
        if address not in self._spans:
            raise KeyError(f"no storage starts at {address:#x} in this arena")
        self._out.add(address)
        return len(self._out) == len(self._spans)

    def mark_in(self, address: int) -> None:
        """Note that the storage at ``address`` holds its data again."""
        self._out.discard(address)

    def bytes_tensor(self, address: int, nbytes: int) -> Any:
        """A 1-D ``torch.uint8`` tensor over ``nbytes`` at ``address`` (its storage keeps the arena alive)."""
        import torch

        if not (self.ptr <= address and address + nbytes <= self.ptr + self.size):
            raise ValueError("span outside the arena")
        maker = getattr(self.drv, "bytes_tensor", None)  # a fake driver's memory is host memory
        if maker is not None:
            return maker(self, address, nbytes)
        t = torch.as_tensor(_Span(self, address, nbytes))
        if t.data_ptr() != address or t.device != torch.device("cuda", self.device):
            raise RuntimeError(
                f"torch placed the arena span at {t.data_ptr():#x} on {t.device}, not at "
                f"{address:#x} on cuda:{self.device}"
            )
        return t


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """An arena as another process sees it: the GPU (``gpu_uuid``, NVML form), the reserved ``size`` and
    allocation ``granularity`` in bytes, the sizes of its physical ``chunks`` in address order, and how many
    ``storages`` are placed in it."""

    gpu_uuid: str
    size: int
    granularity: int
    chunks: tuple[int, ...]
    storages: int


@dataclasses.dataclass(frozen=True)
class _Span:
    """``__cuda_array_interface__`` (v3) over arena bytes; torch keeps this object alive with the tensor."""

    arena: Arena
    address: int
    nbytes: int

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def is_stable(tensor: Any) -> bool:
    """True if ``tensor``'s storage lives in an arena (its address survives offload and reload)."""
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and arena_of(storage.data_ptr()) is not None


def movable(tensor: Any, driver: Any = None) -> bool:
    """True if :func:`stabilize` would move ``tensor``: a non-empty CUDA tensor (or CPU tensor, with a
    driver whose memory is host memory) not in an arena yet."""
    drv = driver if driver is not None else _driver_module  # (None until cuInit: then CUDA tensors only)
    host = getattr(drv, "bytes_tensor", None) is not None
    storage = tensor.untyped_storage()
    return storage.nbytes() > 0 and (tensor.device.type == "cuda" or host) and arena_of(storage.data_ptr()) is None


@dataclasses.dataclass
class Stabilized:
    """What :func:`stabilize` did: ``arenas`` (one per GPU), ``moved`` (storages moved), ``nbytes`` (their
    bytes) and ``rebound`` (tensor objects moved with them, the named ones included)."""

    arenas: list[Arena]
    moved: int
    nbytes: int
    rebound: int = 0


def _storage_key(tensor: Any, skip: tuple[type, ...] = ()) -> tuple[str, int] | None:
    """``(device, address)`` of a tensor's storage, ``None`` for tensors without real memory (``skip``: fake
    tensors that torch.compile keeps; meta or functional tensors; empty storages)."""
    if isinstance(tensor, skip) or tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return None
        return (str(storage.device), int(storage.data_ptr()))
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None


def tensors_over(keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], list[Any]]:
    """Every live tensor object over the storages ``keys`` (``(device, address)``, as torch names them),
    found among the objects Python's garbage collector tracks: the named tensors, and every view, alias or
    ``.data`` that an engine made of them and keeps somewhere (attention layers' KV-cache views, a runner's
    lists). Tensors that only C++ code holds are not found.

    Returns:
        key → tensors (each list may be empty).
    """
    import gc

    import torch

    try:
        from torch._subclasses.fake_tensor import FakeTensor

        skip: tuple[type, ...] = (FakeTensor,)
    except ImportError:  # (a torch without it has none to skip)
        skip = ()
    wanted: dict[tuple[str, int], list[Any]] = {k: [] for k in keys}
    tensor = torch.Tensor
    for obj in gc.get_objects():
        if issubclass(type(obj), tensor):  # (not isinstance: that reads __class__, which some proxies compute)
            key = _storage_key(obj, skip)
            if key in wanted:
                wanted[key].append(obj)
    return wanted


def _rebind(tensor: Any, storage: Any) -> None:
    """Point ``tensor`` at ``storage`` with its own offset, sizes and strides (inference tensors inside
    inference mode, as torch requires)."""
    import torch

    ctx = torch.inference_mode() if tensor.is_inference() else torch.no_grad()
    with ctx:
        tensor.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def stabilize(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *, driver: Any = None) -> Stabilized:
    """Move the storages behind ``tensors`` (name → torch.Tensor) into one new arena per GPU, in place.

    Every tensor object over a moved storage moves with it (``Tensor.set_``; :func:`tensors_over` finds
    views and aliases beyond the named tensors), so the tensors stay the same Python objects and views and
    tied weights keep sharing one storage. The arena is backed chunk by chunk as storages move in, and each
    old storage is freed (resized to 0 bytes; torch's cache emptied every chunk) once it has moved, so the
    move needs about one chunk (``CHUNK_BYTES``) of free memory beyond what the storages hold, not twice
    their size. Storages already in an arena, and CPU tensors (unless ``driver`` provides host memory, as the
    test fake does), are left alone. Call it before capturing CUDA graphs that read these tensors, and
    before anything records their addresses.

    Returns:
        :class:`Stabilized`.

    Raises:
        VmmError: a driver call failed. The storages moved until then stay in the arena (their tensors
            valid); the rest stay where they were.
        TypeError: a value is not a torch.Tensor.
    """
    import torch

    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    groups: dict[Any, dict[int, Any]] = {}  # device -> storage address -> storage
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if not movable(t, driver):
            continue
        st = t.untyped_storage()
        groups.setdefault(t.device, {})[st.data_ptr()] = st
    if not groups:
        return Stabilized([], 0, 0)
    users = tensors_over((str(device), p) for device, by_ptr in groups.items() for p in by_ptr)
    out = Stabilized([], 0, 0)
    for device, by_ptr in groups.items():
        sizes = {p: st.nbytes() for p, st in by_ptr.items()}
        arena = Arena(sum(_round_up(n, ALIGN) for n in sizes.values()), device.index or 0, driver=driver, mapped=False)
        out.arenas.append(arena)
        _move_into(arena, device, by_ptr, users, out)
    return out


def _move_into(
    arena: Arena, device: Any, by_ptr: dict[int, Any], users: dict[tuple[str, int], list[Any]], out: Stabilized
) -> None:
    """Move each storage of ``by_ptr`` into ``arena``, rebinding its ``users``, freeing it once moved."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    since_empty = 0
    with torch.no_grad():
        for p, old in by_ptr.items():
            nbytes = old.nbytes()
            address = arena.place(nbytes)
            arena.map_span(address, nbytes)
            dst = arena.bytes_tensor(address, nbytes)
            dst.copy_(torch.empty(0, dtype=torch.uint8, device=old.device).set_(old))
            new = dst.untyped_storage()
            for t in users.get((str(device), p), []):
                _rebind(t, new)
                out.rebound += 1
            if old.resizable():
                old.resize_(0)
            out.moved += 1
            out.nbytes += nbytes
            since_empty += nbytes
            if cuda and since_empty >= CHUNK_BYTES:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                since_empty = 0
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
