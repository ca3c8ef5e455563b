"""Named buffers kept out of the process image: write a worker's large tensors to files and back.

A worker names its large, reloadable tensors (weights; see ``TorchAdapter(buffers=...)``). At capture the
agent writes each tensor's storage to a file descriptor the daemon hands it and frees the memory, so
neither the CUDA checkpoint nor the CRIU image carries it; after a restore (or a failed capture) it
allocates the storages again and reads them back. Tensors stay the same Python objects. A plain storage's
device address changes; a storage in a VMM arena (:func:`gpusnap.adapters.vmm.stabilize`) keeps it: its
arena is released once all of its storages are written and re-mapped at the same addresses before they
are read back, so CUDA graphs that read those tensors stay valid.

Data path (gpusnap measurements on an H200, bench/results/offload-probe-*.json and
buffers-probe-*.json): host↔device copies from pageable memory run at about 7 GB/s, from pinned memory at
about 54 GB/s. CUDA storages therefore
go through a ring of pinned bounce buffers: one worker thread per slot reads (``preadv``) or writes
(``pwritev``) a chunk of the file while other slots' copies run on their own CUDA streams. CPU
storages are read and written in place. ``preadv``/``pwritev`` and stream waits release the GIL.

Requires torch (imported when used).
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CHUNK_BYTES = 64 << 20
"""Bytes per copy step (one pinned slot)."""


def _default_threads() -> int:
    return max(2, min(12, os.cpu_count() or 2))


@dataclasses.dataclass
class Buffer:
    """One storage to move: ``name`` (the first tensor name that uses it), its size in bytes, and the VMM
    arena it lives in (``None``: a plain storage, freed by resizing it to 0 bytes)."""

    name: str
    storage: Any  # torch.UntypedStorage
    nbytes: int
    arena: Any = None  # gpusnap.adapters.vmm.Arena
    address: int = 0  # the storage's device address (arena-backed buffers)
    freed: bool = False  # an arena-backed buffer was written out (its memory goes with the arena)

    @property
    def out(self) -> bool:
        """True while the buffer's data is not in memory (written out and freed)."""
        return self.freed if self.arena is not None else self.storage.nbytes() == 0


def collect(tensors: Mapping[str, Any]) -> list[Buffer]:
    """The distinct storages behind ``tensors`` (name → torch.Tensor), largest first.

    Tensors that share a storage (tied weights, views) yield one buffer, named after the first of them.
    Empty storages are left out. Storages in a VMM arena (:mod:`gpusnap.adapters.vmm`) keep their arena.

    Raises:
        TypeError: a value is not a torch.Tensor.
        ValueError: a tensor's storage cannot be resized (so it could not be freed) and is in no arena.
    """
    import torch

    from gpusnap.adapters import vmm

    seen: dict[tuple[str, int], Buffer] = {}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"buffer {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        storage = tensor.untyped_storage()
        arena = vmm.arena_of(storage.data_ptr()) if storage.nbytes() > 0 else None
        if arena is None and not storage.resizable():
            raise ValueError(
                f"buffer {name!r} cannot be freed: its storage is not resizable (it wraps memory torch "
                "does not own, e.g. from numpy or a memory-mapped file); do not name it"
            )
        key = (str(storage.device), storage.data_ptr())
        if storage.nbytes() > 0 and key not in seen:
            seen[key] = Buffer(name, storage, storage.nbytes(), arena, storage.data_ptr())
    return sorted(seen.values(), key=lambda b: -b.nbytes)


def _as_bytes(storage: Any) -> Any:
    """A 1-D uint8 tensor over the whole storage."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclasses.dataclass(frozen=True)
class _Step:
    fd: int
    tensor: Any  # uint8 view of the storage
    offset: int
    size: int


def _steps(buffers: Sequence[Buffer], fds: Sequence[int]) -> list[_Step]:
    """Chunks of every buffer, interleaved across buffers: concurrent threads then work on different
    files, and writes to one file serialize on its inode lock."""
    per_buffer = []
    for buf, fd in zip(buffers, fds, strict=True):
        view = _as_bytes(buf.storage)
        per_buffer.append(
            [_Step(fd, view, off, min(CHUNK_BYTES, buf.nbytes - off)) for off in range(0, buf.nbytes, CHUNK_BYTES)]
        )
    out: list[_Step] = []
    for round_ in itertools.zip_longest(*per_buffer):
        out.extend(step for step in round_ if step is not None)
    return out


def _run_parallel(steps: Iterable[_Step], work: Any, threads: int) -> None:
    """Run ``work(state, step)`` for every step on ``threads`` threads (``state``: one dict per thread),
    wait for each thread's CUDA streams, and re-raise the first error."""
    todo: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()
    for step in steps:
        todo.put(step)
    errors: list[BaseException] = []

    def loop() -> None:
        state: dict[str, Any] = {}
        while not errors:
            step = todo.get()
            if step is None:
                break
            try:
                work(state, step)
            except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
                errors.append(exc)
                break
        for stream in state.get("streams", {}).values():
            stream.synchronize()
        _release_slot(state)

    pool = [threading.Thread(target=loop, name=f"gpusnap-buffers-{i}", daemon=True) for i in range(threads)]
    for _ in pool:
        todo.put(None)
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def _memory(tensor: Any) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (``Tensor.numpy()`` would make its storage
    non-resizable, and resizing is how buffers are freed)."""
    size = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


def _full_io(call: Any, fd: int, view: memoryview, offset: int, what: str) -> None:
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{what}: short transfer at offset {offset + done} (file truncated?)")
        done += n


def _slot(state: dict[str, Any], device: Any) -> tuple[Any, Any, memoryview]:
    """The thread's pinned slot (allocated on first use), its stream on ``device``, and a view of the slot.

    Slots come from torch's caching host allocator (``cudaHostAlloc``): on an H200 host, 12 threads moved
    16 GiB at 14–21 GB/s with them, and at 7–9 GB/s with ``cudaHostRegister``-ed anonymous mappings
    (bench/results/buffers-probe-*.json). :func:`release_host_cache` gives them back afterwards, so they
    are not captured.
    """
    import torch

    if "slot" not in state:
        state["slot"] = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        state["view"] = _memory(state["slot"])
        state["streams"] = {}
    streams = state["streams"]
    if device not in streams:
        streams[device] = torch.cuda.Stream(device=device)
    return state["slot"], streams[device], state["view"]


def _release_slot(state: dict[str, Any]) -> None:
    state.pop("view", None)
    state.pop("slot", None)


def release_host_cache(devices: Iterable[Any] = ()) -> None:
    """Free torch's cached pinned host blocks (the slots, which batches reuse, and the engine's own), which
    the image would otherwise hold. ``torch._C._host_emptyCache`` exists in the torch 2.x releases gpusnap
    runs on; where it is missing the slots stay cached (64 MiB per thread).

    Args:
        devices: GPUs to wait for first, so no block is kept for a pending copy (before a capture: the
            buffers' devices; never others, which would get a context). The copies of :func:`write` and
            :func:`read` are complete when they return, so a release after a reload, while the engine
            serves again, names none.
    """
    import torch

    if torch.cuda.is_initialized():
        for device in devices:
            torch.cuda.synchronize(device)
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()


def write(buffers: Sequence[Buffer], fds: Sequence[int], threads: int | None = None) -> float:
    """Write each buffer's bytes to the matching file descriptor, from offset 0.

    Returns:
        Seconds spent in the copies and writes. The pinned slots stay in torch's host cache for
        the next batch: call :func:`release_host_cache` before the process is captured.

    Raises:
        OSError: a write failed (e.g. ENOSPC); the files' contents are then undefined.
    """
    import torch

    def work(state: dict[str, Any], step: _Step) -> None:
        src = step.tensor[step.offset : step.offset + step.size]
        if step.tensor.device.type == "cpu":
            _full_io(os.pwritev, step.fd, _memory(src), step.offset, "write")
            return
        slot, stream, view = _slot(state, step.tensor.device)
        with torch.cuda.stream(stream):
            slot[: step.size].copy_(src, non_blocking=True)
        stream.synchronize()
        _full_io(os.pwritev, step.fd, view[: step.size], step.offset, "write")

    for device in {b.storage.device for b in buffers if b.storage.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # the engine's last kernels wrote these tensors
    t0 = time.monotonic()
    _run_parallel(_steps(buffers, fds), work, threads or _default_threads())
    return time.monotonic() - t0


def trim_heap() -> None:
    """Return the C heap's free memory to the kernel (glibc ``malloc_trim``), so the image does not carry
    freed pages; a no-op on other C libraries."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free(buffers: Sequence[Buffer]) -> None:
    """Release each buffer's memory; tensors stay valid objects.

    A plain storage is resized to 0 bytes. An arena-backed buffer is marked out, and its arena is released
    (:meth:`~gpusnap.adapters.vmm.Arena.release`, addresses kept) once every storage placed in it is out;
    until then its memory stays mapped and its data in place.

    Raises:
        gpusnap.adapters.vmm.VmmError: releasing an arena failed.
    """
    import torch

    full = []
    for buf in buffers:
        if buf.arena is None:
            buf.storage.resize_(0)
            continue
        buf.freed = True
        if buf.arena.mark_out(buf.address) and buf.arena not in full:
            full.append(buf.arena)
    for device in {b.storage.device for b in buffers if b.arena in full and b.storage.device.type == "cuda"}:
        torch.cuda.synchronize(device)  # no copy or kernel still reads the memory
    for arena in full:
        arena.release()
    if any(b.storage.device.type == "cuda" for b in buffers):
        torch.cuda.empty_cache()


def read(buffers: Sequence[Buffer], fds: Sequence[int], threads: int | None = None) -> tuple[float, float]:
    """Allocate each buffer's storage again (``nbytes``) and fill it from the matching descriptor.

    Returns:
        Seconds spent allocating the storages, then reading and copying. The pinned slots stay in
        torch's host cache for the next batch: see :func:`release_host_cache`.

    Arena-backed buffers get their arena re-mapped at the same addresses (:meth:`~gpusnap.adapters.vmm.Arena.remap`;
    a no-op while it is still mapped) instead.

    Raises:
        OSError: a read failed or a file is shorter than its buffer.
        gpusnap.adapters.vmm.VmmError: re-mapping an arena failed (e.g. the GPU is out of memory).
    """
    import torch

    t0 = time.monotonic()
    for buf in buffers:
        if buf.arena is not None:
            buf.arena.remap()
        elif buf.storage.nbytes() != buf.nbytes:
            buf.storage.resize_(buf.nbytes)
    t1 = time.monotonic()

    def work(state: dict[str, Any], step: _Step) -> None:
        dst = step.tensor[step.offset : step.offset + step.size]
        if step.tensor.device.type == "cpu":
            _full_io(os.preadv, step.fd, _memory(dst), step.offset, "read")
            return
        slot, stream, view = _slot(state, step.tensor.device)
        for pending in state["streams"].values():
            pending.synchronize()  # the slot's previous copy is done before it is overwritten
        _full_io(os.preadv, step.fd, view[: step.size], step.offset, "read")
        with torch.cuda.stream(stream):
            dst.copy_(slot[: step.size], non_blocking=True)

    _run_parallel(_steps(buffers, fds), work, threads or _default_threads())
    back_in(buffers)
    return t1 - t0, time.monotonic() - t1


def back_in(buffers: Iterable[Buffer]) -> None:
    """Count the arena-backed ``buffers`` as back in their arena, whose memory is mapped again and holds their
    bytes (read back by :func:`read`, or adopted from gpusnapd's prefill: the agent's ``MapArenas``)."""
    for buf in buffers:
        if buf.arena is not None:
            buf.arena.mark_in(buf.address)
            buf.freed = False
