"""Host memory handed back to the kernel so that it reads as zero again, without writing it.

A page of a private anonymous mapping that ``madvise(MADV_DONTNEED)`` discarded is gone from the process:
its next access maps a fresh page of zeros (madvise(2): "subsequent accesses of pages in the range will
succeed, but will result in ... zero-fill-on-demand pages for anonymous private mappings"). The range keeps
its addresses, CRIU dumps no page for it (only pages present or swapped are dumped), and a restored process
finds it zero-filled on demand like any other absent page of a private anonymous mapping. Writing zeros
instead would fault every page in and zero it twice (the kernel's zero-fill, then the write): 0.45 s for
a 1 GiB vLLM KV cache on a 2-core VM (issue 25).

Only private anonymous memory behaves so: a shared or file-backed mapping would read its file's or its
sharers' bytes again, so :func:`discard` refuses any range that is not entirely private and anonymous.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

MADV_DONTNEED = 4
"""``<asm-generic/mman-common.h>``: the same value on every Linux architecture."""
PAGE = mmap.PAGESIZE


class NotAnonymous(ValueError):
    """The range is not entirely in private anonymous mappings: discarding it would not zero it."""


def _anonymous_private(fields: list[str]) -> bool:
    """A ``/proc/self/maps`` line's fields: private (``p``), no device or inode, and no file (``[heap]`` and
    ``[anon:…]`` names are anonymous; ``[stack]`` is too, but never holds a tensor)."""
    perms, dev, inode = fields[1], fields[3], fields[4]
    path = fields[5] if len(fields) > 5 else ""
    return perms.endswith("p") and inode == "0" and dev in ("00:00", "0:0") and (not path or path.startswith("["))


def private_anonymous(start: int, end: int, maps: str | None = None) -> bool:
    """Whether ``[start, end)`` lies entirely in private anonymous mappings of this process, with no hole.

    Args:
        start: the first byte's address.
        end: the address after the last byte.
        maps: the text of ``/proc/self/maps`` (read when ``None``).
    """
    if maps is None:
        with open(f"/proc/{os.getpid()}/maps") as f:
            maps = f.read()
    covered = start
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if hi <= covered or lo >= end:
            continue
        if lo > covered or not _anonymous_private(fields):
            return False
        covered = hi
        if covered >= end:
            return True
    return covered >= end


def discard(ranges: Sequence[tuple[int, int]]) -> int:
    """Make each ``(address, nbytes)`` range read as zero and give its whole pages back to the kernel: the
    pages entirely inside a range are discarded (``MADV_DONTNEED``), the partial pages at its ends are zeroed
    in place (their other bytes may belong to something else). Nothing may use the ranges meanwhile.

    Returns:
        The bytes discarded (whole pages; the rest was written).

    Raises:
        NotAnonymous: a range is not entirely in private anonymous memory (checked for all of them first:
            nothing was changed).
        OSError: ``madvise`` failed.
    """
    with open(f"/proc/{os.getpid()}/maps") as f:
        maps = f.read()
    for address, nbytes in ranges:
        if nbytes > 0 and not private_anonymous(address, address + nbytes, maps):
            raise NotAnonymous(f"{nbytes} bytes at {address:#x} are not all in private anonymous memory")
    return sum(_discard(address, nbytes) for address, nbytes in ranges if nbytes > 0)


def _discard(address: int, nbytes: int) -> int:
    end = address + nbytes
    lo = -(-address // PAGE) * PAGE
    hi = end // PAGE * PAGE
    if hi <= lo:
        ctypes.memset(address, 0, nbytes)
        return 0
    ctypes.memset(address, 0, lo - address)
    ctypes.memset(hi, 0, end - hi)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) of {hi - lo} bytes at {lo:#x}: {os.strerror(err)}")
    return hi - lo
