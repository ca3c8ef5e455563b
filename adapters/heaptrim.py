"""A quiesced worker's heaps given back before the dump: fewer pages for CRIU to write and to restore.

A serving engine's Python and C heaps hold memory it freed but the allocator kept: garbage not yet
collected, and glibc's free chunks (warm-up batches, tokenizer and request buffers). CRIU dumps and restores
every such page like any other. Right before the capture the agent collects Python's garbage
(``gc.collect``) and asks glibc to give its free memory back (``malloc_trim(0)``, which since glibc 2.8 also
``madvise(MADV_DONTNEED)``\\ s whole free pages inside each arena, not only the top of the heap). Nothing the
worker holds changes; what it frees later comes back as fresh zero pages when it allocates again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

_STATM_PAGES = 4096


def _resident_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _STATM_PAGES


def trim() -> int:
    """Collect Python's garbage and return glibc's free heap pages to the kernel; returns the resident bytes
    this released (0 where the C library has no ``malloc_trim``, e.g. musl)."""
    before = _resident_bytes()
    gc.collect()
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(ctypes.c_size_t(0))
    released = max(0, before - _resident_bytes())
    log.info("gpusnap agent: heaps trimmed before the capture: %d MiB released", released >> 20)
    return released
