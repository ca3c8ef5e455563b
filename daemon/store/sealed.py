"""Sealed memfds: what a worker writes its buffers into, so that no write of the worker's reaches the store.

A capture with offload used to hand the worker read-write descriptors of the buffer store's own files; a
descriptor cannot be taken back, so a hostile worker could grow those files past every budget, during or
after its capture (docs/security.md, "A worker's buffer descriptors"). Instead the worker now gets, per
buffer, a memfd of exactly the announced size with ``F_SEAL_GROW``, ``F_SEAL_SHRINK`` and ``F_SEAL_SEAL``
(memfd_create(2), fcntl(2) "File Sealing"): a write past its end, ``ftruncate`` and ``fallocate`` beyond it
fail with ``EPERM`` through every descriptor, its own or one reopened from ``/proc``, and no further seal
can be added. gpusnapd copies each memfd into a file of its own (:func:`copy_chunk`, ``sendfile(2)``:
a copy in the kernel) and punches the copied range out of the memfd, so the pages the worker wrote are
freed chunk by chunk. Pages of a memfd are charged to the cgroup of the process that wrote them, the
worker's; what the worker may still do with a descriptor it kept is write its own memory.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

MFD_NOEXEC_SEAL = 0x0008
"""memfd_create(2) flag (Linux 6.3): not executable, and sealed so (required where vm.memfd_noexec = 2)."""
SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def create(size: int, name: str = "gpusnap-buffer") -> int:
    """A memfd of ``size`` bytes (a hole: no memory until written) sealed against growing, shrinking and
    further seals; close-on-exec.

    Raises:
        OSError: the kernel refused (``EMFILE``: out of descriptors).
    """
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        fd = os.memfd_create(name, flags | MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a kernel before 6.3 knows no MFD_NOEXEC_SEAL
            raise
        fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_chunk(src: int, dst: int, offset: int, length: int) -> None:
    """Copy ``length`` bytes at ``offset`` of memfd ``src`` to the same offset of the file ``dst`` (a
    descriptor of its own: its file position is moved), then punch them out of ``src``.

    Raises:
        OSError: the copy failed (``ENOSPC``), or ``src`` ended early.
    """
    os.lseek(dst, offset, os.SEEK_SET)
    done = 0
    while done < length:
        n = os.sendfile(dst, src, offset + done, length - done)
        if n == 0:
            raise OSError(errno.EIO, f"buffer memfd ended at {offset + done} bytes, before {offset + length}")
        done += n
    punch(src, offset, length)


def punch(fd: int, offset: int, length: int) -> None:
    """Free the pages of ``fd`` in [offset, offset + length), keeping its size (best effort: a kernel that
    refuses leaves them until the memfd is closed)."""
    _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
