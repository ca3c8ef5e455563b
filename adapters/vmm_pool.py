"""The rest of a worker's device memory at stable addresses: a CUDA graph pool, persistent buffers and
workspaces in gpusnap's VMM arenas (:mod:`gpusnap.adapters.vmm`), each with what a capture does with it.

A worker's weights and KV cache already live in arenas; what the CUDA checkpoint still carried after them
(2.6 GB for vLLM 0.26's 8B server on an H200, ``bench/results/gpu-vllm-h200-8b-20261203T144418.json``) is the
memory torch's caching allocator holds for the engine: the CUDA graph pool, persistent buffers that graphs
read at their addresses, workspaces, and reserved-but-free segments. This module moves that memory into
arenas too, under one of two :class:`Policy` values:

- :attr:`Policy.KEEP` (a graph pool, persistent buffers): saved to the buffer store like the weights and
  filled back at the same addresses (read back, or prefilled by gpusnapd). A CUDA graph's private pool holds
  state that replays read and never write (kernel workspace metadata, scheduler counters set up at capture):
  SGLang's replays read garbage after a pause that dropped it (sgl-project/sglang PR #32718, which backs the
  pool up to host memory instead; about 0.8 GB per rank there).
- :attr:`Policy.SCRATCH` (workspaces every use rewrites before reading): released at capture and mapped again
  at resume, with no save; its bytes are then undefined. Only memory that every use rewrites may be scratch:
  SGLang dropped only the graph buffers its replay metadata path fully rewrites before every replay, and kept
  the init-once ones (``cu_seqlens_q = arange``, ``cache_seqlens = ones``) out of the released region
  (sgl-project/sglang PR #30474).

Two ways memory gets into an arena:

- **A pool** (:class:`ArenaPool`): a ``torch.cuda.MemPool`` whose allocator is gpusnap's, so that every
  segment torch's caching allocator asks for in it is an arena of its own (``cuMemAddressReserve`` +
  ``cuMemCreate`` + ``cuMemMap``; given back with ``cuMemUnmap`` + ``cuMemRelease`` + ``cuMemAddressFree``
  when torch frees the segment). Graphs captured with ``torch.cuda.graph(g, pool=pool.id)`` then keep their
  private memory there. The allocator is a pair of C function pointers (ctypes callbacks,
  ``torch._C._cuda_customAllocator``; what ``torch.cuda.memory.CUDAPluggableAllocator`` builds from a compiled
  library's symbols), so nothing is compiled. The driver calls run with the thread's stream-capture mode
  relaxed (``cuThreadExchangeStreamCaptureMode``), as torch's own ``cudaMalloc`` during a capture does.
- **A move** (:func:`gpusnap.adapters.vmm.stabilize`): tensors that exist already (persistent buffers found by
  :func:`default_pool_tensors`) move into a new arena, the same tensor objects, before any graph records their
  addresses.

:class:`Regions` keeps a worker's arenas by name and policy: :meth:`Regions.buffers` names each KEEP arena as
one buffer (the agent's offload path then writes it out, releases it, and reads it back or adopts gpusnapd's
prefill at the same address), :meth:`Regions.release_scratch` and :meth:`Regions.remap_scratch` handle the
rest. Requires torch only where tensors are made (imported when used).
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import enum
import gc
import logging
import sys
import threading
from collections.abc import Iterable
from typing import Any

from gpusnap.adapters import vmm

log = logging.getLogger(__name__)

ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
"""``void* alloc(size_t size, int device, cudaStream_t stream)``: torch's pluggable allocator's malloc."""
FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
"""``void free(void* ptr, size_t size, int device, cudaStream_t stream)``: its free."""

DEFAULT_POOL = (0, 0)
"""The id torch's caching allocator gives its default pool (``segment_pool_id`` in ``memory_snapshot``)."""


class Policy(enum.Enum):
    """What a capture does with a region's memory (see the module docstring)."""

    KEEP = "keep"
    """Saved to the buffer store, filled back at the same addresses."""
    SCRATCH = "scratch"
    """Released, mapped again at resume without its bytes."""


class _RelaxedCapture:
    """Relax the calling thread's stream-capture mode around driver calls (VMM calls are not stream work,
    and a capture in global mode would otherwise be invalidated by them, as by ``cudaMalloc``); a driver
    without the call (an old fake) is left alone."""

    def __init__(self, drv: Any):
        self.drv = drv
        self.old: Any = None

    def __enter__(self) -> None:
        exchange = getattr(self.drv, "cuThreadExchangeStreamCaptureMode", None)
        if exchange is not None:
            relaxed = self.drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
            self.old = vmm._check(self.drv, "cuThreadExchangeStreamCaptureMode", exchange(relaxed))

    def __exit__(self, *exc: object) -> None:
        if self.old is not None:
            vmm._check(
                self.drv, "cuThreadExchangeStreamCaptureMode", self.drv.cuThreadExchangeStreamCaptureMode(self.old)
            )


class ArenaPool:
    """Device memory torch's caching allocator asks for, one arena per segment (see the module docstring).

    Args:
        name: what the memory is (``"graphs"``), for buffer names and logs.
        policy: what a capture does with it.
        driver: the ``cuda.bindings.driver`` module (default: :func:`gpusnap.adapters.vmm.default_driver`, when
            first needed), or a fake with the same calls.

    :attr:`function_pointers` are the C allocator; :meth:`mem_pool` wraps them in a ``torch.cuda.MemPool``. A
    failed allocation returns NULL (torch then raises its out-of-memory error) and is logged with the driver's
    reason; :attr:`failures` counts them.
    """

    def __init__(self, name: str, policy: Policy, *, driver: Any = None):
        self.name = name
        self.policy = policy
        self._driver = driver
        self._lock = threading.Lock()
        self._segments: dict[int, vmm.Arena] = {}
        self.failures = 0
        self._c = (ALLOC_FN(self._alloc), FREE_FN(self._free))  # alive as long as the pool
        self._allocator: Any = None
        self._mem_pool: Any = None

    @property
    def drv(self) -> Any:
        if self._driver is None:
            self._driver = vmm.default_driver()
        return self._driver

    @property
    def function_pointers(self) -> tuple[int, int]:
        """Addresses of the C ``alloc`` and ``free`` functions (:data:`ALLOC_FN`, :data:`FREE_FN`)."""
        return tuple(int(ctypes.cast(f, ctypes.c_void_p).value or 0) for f in self._c)  # type: ignore[return-value]

    def arenas(self) -> list[vmm.Arena]:
        """The pool's segments, in address order."""
        with self._lock:
            return [self._segments[p] for p in sorted(self._segments)]

    @property
    def nbytes(self) -> int:
        """Bytes of address space the segments span."""
        return sum(a.size for a in self.arenas())

    def _alloc(self, size: int, device: int, stream: Any) -> int | None:
        try:
            drv = self.drv
            with _RelaxedCapture(drv):
                arena = vmm.Arena(size, device, driver=drv)
            arena.place(size)  # the whole segment is one storage: written out and read back as one buffer
        except Exception as exc:  # noqa: BLE001 (C calls this: NULL is torch's out-of-memory answer)
            self.failures += 1
            log.error("gpusnap: the %s pool could not give torch %d bytes on GPU %d: %s", self.name, size, device, exc)
            return None
        with self._lock:
            self._segments[arena.ptr] = arena
        return arena.ptr

    def _free(self, ptr: int | None, size: int, device: int, stream: Any) -> None:
        if sys.is_finalizing():
            return  # the process is ending: the driver takes its memory back with the context
        with self._lock:
            arena = self._segments.pop(int(ptr or 0), None)
        if arena is None:
            log.error("gpusnap: torch freed %#x in the %s pool, which the pool never gave it", int(ptr or 0), self.name)
            return
        try:
            drv = arena.drv
            with _RelaxedCapture(drv):
                vmm._check(drv, "cuCtxSynchronize", drv.cuCtxSynchronize())  # no kernel still uses it
                arena.close()
        except Exception as exc:  # noqa: BLE001 (C calls this; nothing to raise into)
            log.error("gpusnap: releasing a segment of the %s pool at %#x failed: %s", self.name, arena.ptr, exc)

    def mem_pool(self) -> Any:
        """A ``torch.cuda.MemPool`` whose segments come from this pool (made on first call, then the same);
        its ``id`` is what ``torch.cuda.graph(..., pool=)`` takes.

        Raises:
            RuntimeError: torch lacks the custom-allocator binding (``torch._C._cuda_customAllocator``).
        """
        if self._mem_pool is None:
            import torch

            make = getattr(torch._C, "_cuda_customAllocator", None)
            if make is None:
                raise RuntimeError(
                    f"torch {torch.__version__} has no custom CUDA allocator (torch._C._cuda_customAllocator); "
                    "leave GPUSNAP_VLLM_POOLS unset"
                )
            self._allocator = make(*self.function_pointers)
            self._mem_pool = torch.cuda.MemPool(self._allocator)
        return self._mem_pool


@dataclasses.dataclass
class Region:
    """Named memory with a policy: the arenas ``source`` gives (a list, or an :class:`ArenaPool`'s segments)."""

    name: str
    policy: Policy
    source: list[vmm.Arena] | ArenaPool

    def arenas(self) -> list[vmm.Arena]:
        return self.source.arenas() if isinstance(self.source, ArenaPool) else list(self.source)


class Regions:
    """A worker's regions (see the module docstring); names must be unique."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._released: list[vmm.Arena] = []

    def add(self, name: str, policy: Policy, source: list[vmm.Arena] | ArenaPool) -> Region:
        """Add (or extend: a list source is appended to a region of the same name and policy) a region."""
        have = self._regions.get(name)
        if have is not None and isinstance(source, list) and isinstance(have.source, list):
            if have.policy is not policy:
                raise ValueError(f"region {name!r} is {have.policy.value}, not {policy.value}")
            have.source.extend(source)
            return have
        if have is not None:
            raise ValueError(f"region {name!r} exists")
        region = self._regions[name] = Region(name, policy, source if isinstance(source, ArenaPool) else list(source))
        return region

    def __iter__(self) -> Any:
        return iter(list(self._regions.values()))

    def __bool__(self) -> bool:
        return any(r.arenas() for r in self._regions.values())

    def buffers(self, prefix: str) -> dict[str, Any]:
        """Each KEEP arena as one buffer: ``{prefix}.{region}.{i}`` → a uint8 tensor over its bytes (everything
        placed in it, :meth:`~gpusnap.adapters.vmm.Arena.seal`); the agent's offload path writes it out and
        releases the arena, and a restore fills it back at the same address."""
        named: dict[str, Any] = {}
        for region in self._regions.values():
            if region.policy is not Policy.KEEP:
                continue
            for i, arena in enumerate(region.arenas()):
                if arena.closed or not arena.mapped:
                    continue
                nbytes = arena.seal()
                if nbytes:
                    named[f"{prefix}.{region.name}.{i}"] = arena.bytes_tensor(arena.ptr, nbytes)
        return named

    def scratch(self) -> list[vmm.Arena]:
        return [a for r in self._regions.values() if r.policy is Policy.SCRATCH for a in r.arenas() if not a.closed]

    def release_scratch(self) -> int:
        """Release every SCRATCH arena (addresses kept, bytes not saved); returns the bytes released. The caller
        makes sure no GPU work uses them."""
        released = 0
        for arena in self.scratch():
            if arena.mapped:
                arena.release()
                self._released.append(arena)
                released += arena.size
        return released

    def remap_scratch(self, poison: int | None = None) -> None:
        """Map the released SCRATCH arenas again at their addresses; their bytes are undefined (``poison``:
        fill every byte with it, so that a test shows nothing reads them before writing)."""
        while self._released:
            arena = self._released[-1]
            if arena.closed:  # torch gave the segment back meanwhile: nothing to map
                self._released.pop()
                continue
            arena.remap()
            if poison is not None:
                arena.bytes_tensor(arena.ptr, arena.size).fill_(poison)
            self._released.pop()

    def describe(self) -> list[dict[str, Any]]:
        """Per region: name, policy, arenas, bytes of address space, bytes mapped now."""
        out = []
        for region in self._regions.values():
            arenas = [a for a in region.arenas() if not a.closed]
            out.append(
                {
                    "name": region.name,
                    "policy": region.policy.value,
                    "arenas": len(arenas),
                    "bytes": sum(a.size for a in arenas),
                    "mapped_bytes": sum(a.size for a in arenas if a.mapped),
                }
            )
        return out


def default_pool_tensors(device: int, segments: Iterable[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The live tensors on CUDA device ``device`` whose memory torch's caching allocator gave out of its default
    pool (one per storage; persistent buffers, once an engine is idle): what :func:`gpusnap.adapters.vmm.stabilize`
    can move into an arena. Tensors over other memory (host memory mapped for the device, foreign allocations,
    graph pools, arenas) are left out; so are those only C++ code holds (Python's garbage collector does not see
    them: cuBLAS workspaces, for one).

    Args:
        device: the CUDA ordinal.
        segments: ``(address, bytes)`` of the default pool's segments (default: from
            ``torch.cuda.memory_snapshot()``, ``segment_pool_id`` ``(0, 0)``).

    Returns:
        ``state<i>`` → tensor, largest storage first.
    """
    import torch

    if segments is None:
        segments = [
            (int(s["address"]), int(s["total_size"]))
            for s in torch.cuda.memory_snapshot()
            if int(s["device"]) == device and tuple(s.get("segment_pool_id", DEFAULT_POOL)) == DEFAULT_POOL
        ]
    spans = sorted(segments)
    starts = [a for a, _ in spans]

    def in_default_pool(ptr: int) -> bool:
        i = bisect.bisect_right(starts, ptr) - 1
        return i >= 0 and ptr < spans[i][0] + spans[i][1]

    try:
        from torch._subclasses.fake_tensor import FakeTensor

        skip: tuple[type, ...] = (FakeTensor,)
    except ImportError:  # (a torch without it has none to skip)
        skip = ()
    found: dict[int, Any] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor) or isinstance(obj, skip):
            continue
        try:
            if obj.device.type == "meta" or (obj.device.index or 0) != device:
                continue
            storage = obj.untyped_storage()
            ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
        except (RuntimeError, NotImplementedError, AttributeError, TypeError):
            continue
        if nbytes and ptr not in found and vmm.arena_of(ptr) is None and in_default_pool(ptr):
            found[ptr] = obj
    ordered = sorted(found.values(), key=lambda t: -t.untyped_storage().nbytes())
    return {f"state{i}": t for i, t in enumerate(ordered)}
