"""A restored tree's private /dev/shm, made by the restore's namespace init (``criu_exec``) before CRIU runs.

CRIU keeps only the path and size of a linked tmpfs file that a process maps or holds open, so named POSIX
shared memory (vLLM's ``psm_*`` message queues, its ``*-cpushm_*`` TP buffers, spawn-context semaphores) must
be brought back around it: the files saved beside the images (``store.DEV_SHM``) are copied into a fresh tmpfs
mounted on /dev/shm in the restore's mount namespace. A private copy per restore keeps two restored trees (or a
restored tree and its still-running source) from sharing one segment.

CRIU only opens such a file and checks its size; no code reads its bytes before the restored tasks run. So
where the restore fills pages on several threads (``pagefill``), a large file is made at its size now and its
bytes are copied by those threads with the pages (:class:`Deferred`), between CRIU's ``post-restore`` and
``pre-resume``, on every core instead of one ``cp``'s; small files,
and files linked under several names (CRIU's ``link_remap.N`` beside the name it stands for), are copied at
once, by one ``cp`` that keeps the links and holes.

A store under /dev/shm (a RAM store) would be hidden by the fresh tmpfs: it is carried over, a bind mount of it
at the same path inside (``open_tree``/``move_mount``), so that CRIU and the helper find every path they were
given; :func:`drop_carried` unmounts it once CRIU is done.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import subprocess
import threading

MS_NOSUID, MS_NODEV = 2, 4
SYS_OPEN_TREE, SYS_MOVE_MOUNT = 428, 429
"""The new mount API's system calls (the same numbers on every architecture since Linux 5.2)."""
OPEN_TREE_CLONE, AT_RECURSIVE, MOVE_MOUNT_F_EMPTY_PATH, MNT_DETACH = 1, 0x8000, 0x4, 2
AT_FDCWD = -100
DEFER_BYTES = 1 << 20
"""Files at least this large are copied by the page fill's threads (when there is a fill)."""
DEV_SHM = "/dev/shm"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclasses.dataclass
class Deferred:
    """A file made at its size in the private /dev/shm whose bytes are still to be copied from ``source``
    (``pagefill`` does, range by range; :meth:`close` then gives it the saved file's times)."""

    source: str
    fd: int
    times_ns: tuple[int, int]
    data: list[tuple[int, int]]
    """The (offset, length) ranges of ``source`` that hold data (its holes stay holes)."""
    src_fd: int = -1

    def source_fd(self) -> int:
        """The saved file, opened read-only (once)."""
        if self.src_fd < 0:
            self.src_fd = os.open(self.source, os.O_RDONLY | os.O_CLOEXEC)
        return self.src_fd

    def close(self) -> None:
        """Give the copy the saved file's access and modification times (as ``cp -a`` does), then close both."""
        if self.fd >= 0:
            os.utime(self.fd, ns=self.times_ns)
            os.close(self.fd)
            self.fd = -1
        if self.src_fd >= 0:
            os.close(self.src_fd)
            self.src_fd = -1


COPY_BUFFER_BYTES = 4 << 20
"""The buffer each copying thread reads a saved file into before it writes the private copy."""

_buffers = threading.local()


def thread_buffer() -> memoryview:
    """This thread's copy buffer (``COPY_BUFFER_BYTES``), made on its first copy."""
    buf: memoryview | None = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = memoryview(bytearray(COPY_BUFFER_BYTES))
    return buf


def copy_range(src: int, dst: int, offset: int, length: int) -> None:
    """Copy bytes ``[offset, offset + length)`` of file ``src`` to the same offsets of file ``dst``, through this
    thread's buffer (:func:`thread_buffer`). ``pread`` into a buffer the thread reuses, then ``pwrite``: no page
    of the source is mapped, so the copy faults nothing in, and threads on distinct ranges do not serialize on
    one address space (an ``mmap`` of the source ran 20–30 % slower in a 1 GiB microbenchmark on the 2-core VM,
    and alike in the vLLM-on-CPU bench).

    Raises:
        OSError: a read or a write failed, or the source ended before ``offset + length``.
    """
    buf = thread_buffer()
    end = offset + length
    while offset < end:
        got = os.preadv(src, [buf[: min(len(buf), end - offset)]], offset)
        if got == 0:
            raise OSError(errno.EIO, f"the saved file ended at byte {offset} of a copy up to {end}")
        done = 0
        while done < got:
            done += os.pwrite(dst, buf[done:got], offset + done)
        offset += got


def mount(saved: str, store: str, defer: bool) -> tuple[str, list[Deferred]]:
    """Mount the fresh tmpfs on /dev/shm (this mount namespace only, which must be the restore's own), carry a
    store under /dev/shm over, and bring back the files ``saved`` holds: small and linked ones now, and with
    ``defer`` the others made at their size, their bytes left to the caller (the page fill's threads copy
    each :class:`Deferred` before the tree runs; without ``defer`` every file is copied now). Returns the path carried over ("": none)
    and what was deferred.

    Raises:
        OSError: a mount, or a copy, failed.
    """
    carried = _clone_mount(store) if _under(store, DEV_SHM) else -1
    _check(_libc.mount(b"tmpfs", DEV_SHM.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), None), "mount")
    os.chmod(DEV_SHM, 0o1777)
    if carried >= 0:
        os.makedirs(store, 0o700, exist_ok=True)
        _move_mount(carried, store)
    now, later = [], []
    for name in sorted(os.listdir(saved)):
        path = os.path.join(saved, name)
        st = os.lstat(path)
        if defer and os.path.isfile(path) and st.st_nlink == 1 and st.st_size >= DEFER_BYTES:
            later.append(_made_at_size(path, st))
        else:
            now.append(path)
    if now:  # one cp keeps hard links (CRIU's link_remap.N beside the name it stands for) and holes
        subprocess.run(["cp", "-a", "--sparse=always", "--", *now, DEV_SHM + "/"], check=True)
    return (store if carried >= 0 else ""), later


def _made_at_size(path: str, st: os.stat_result) -> Deferred:
    """``path``'s copy in /dev/shm, with its size, owner and mode, and the ranges of it that hold data."""
    fd = os.open(os.path.join(DEV_SHM, os.path.basename(path)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchown(fd, st.st_uid, st.st_gid)
    os.fchmod(fd, st.st_mode & 0o7777)
    os.ftruncate(fd, st.st_size)
    return Deferred(path, fd, (st.st_atime_ns, st.st_mtime_ns), _data_ranges(path, st.st_size))


def _data_ranges(path: str, size: int) -> list[tuple[int, int]]:
    """The (offset, length) ranges of ``path`` that hold data (``SEEK_DATA``/``SEEK_HOLE``)."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole from here
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, end - start))
            offset = end
    finally:
        os.close(fd)
    return out


def _under(path: str, top: str) -> bool:
    real = os.path.realpath(path)
    return real == top or real.startswith(top + "/")


def _clone_mount(path: str) -> int:
    """A detached bind mount of ``path`` (with what is mounted below it), as a descriptor."""
    fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), OPEN_TREE_CLONE | AT_RECURSIVE)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree({path}): {os.strerror(err)}")
    return int(fd)


def _move_mount(fd: int, path: str) -> None:
    """Attach the detached mount ``fd`` at ``path``."""
    _check(
        _libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, os.fsencode(path), MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount({path})",
    )
    os.close(fd)


def drop_carried(path: str) -> None:
    """Unmount what :func:`mount` carried over at ``path`` and remove the directories made for it."""
    if not path:
        return
    _check(_libc.umount2(os.fsencode(path), MNT_DETACH), f"umount({path})")
    while path not in (DEV_SHM, "/"):
        try:
            os.rmdir(path)
        except OSError:
            return
        path = os.path.dirname(path)
