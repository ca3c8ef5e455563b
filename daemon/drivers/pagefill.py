"""A restored tree's private memory filled by several threads, through CRIU's lazy-pages protocol.

CRIU restores a process's private pages on one thread per process: each restored task ``preadv``s its
``pages-<id>.img`` into freshly mapped anonymous memory, so every 4 KiB page is faulted in, zeroed by the
kernel and then overwritten. On a 2-core VM that ran at 1.0–1.5 GB/s, two thirds of it zeroing pages
(docs/performance.md, "Pages at memory speed"). This module fills the same pages instead, from the CRIU
helper (``criu_exec``), with ``threads`` threads at once, each ``UFFDIO_COPY``-ing runs of pages straight from
a read-only mapping of the pages image: the kernel allocates each page and copies into it, without zeroing it
first, and the threads run on every core.

It uses CRIU's own protocol for this (``criu restore --lazy-pages``; criu/uffd.c in CRIU 4.2), with gpusnap in
the place of ``criu lazy-pages``:

1. Before CRIU runs, :class:`PageFill` listens on ``lazy-pages.socket`` in CRIU's working directory (CRIU
   connects to that name, relative to it; the directory is root's and private to the request).
2. For each task CRIU restores it sends the task's PID (as in the images, a 32-bit int) and then a
   ``userfaultfd`` on a message of its own (``SCM_RIGHTS``); a zombie is sent as its negated PID, with no
   descriptor. CRIU's restorer registers each lazy VMA (private anonymous, not a stack page) with it and
   leaves its pages out (pagemap entries flagged ``PE_LAZY``, which a plain dump sets); at the end of the
   restore CRIU sends ``0x52535446`` ("ReSTore Finished").
3. From the start, a page fault on a registered page is served at once (:meth:`PageFill.handle`): its bytes
   from the image, or a zero page where the image holds none.
4. At CRIU's ``post-restore`` (every restorer has mapped and registered its VMAs, and every task is
   forked, so a new thread can no longer take a PID CRIU still has to give) :meth:`PageFill.start` starts the
   threads. They take runs of at most ``CHUNK_BYTES`` from a shared queue.
5. At ``pre-resume`` (every task restored and stopped, none has run an instruction of its own)
   :meth:`PageFill.finish` waits for the threads, checks that every page went in, and closes the
   ``userfaultfd``s: the tasks then own ordinary anonymous memory, as after a plain restore (a page the
   image did not hold faults in as a zero page, as it would have). Only then may the tree run.

Unlike ``criu lazy-pages`` (CRIU's own server), nothing is served after the tree runs: no task runs an
instruction while a page is missing, so the non-cooperative events (fork, ``mremap``, ``madvise``,
``munmap``) that a running task would raise cannot come, and one that does fails the restore. The tree is
killed, never resumed, when the fill fails (``criu_exec``). Pages CRIU restores itself (shared memory, stacks,
pages inherited copy-on-write from a parent, which a lazy restore gives each process its own copy of) are
untouched.

Runs in the helper, which has pycriu; the daemon never imports it.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import fcntl
import functools
import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpusnap.daemon.drivers import criu_images, privateshm

SOCKET_NAME = "lazy-pages.socket"
"""The name CRIU connects to in its working directory (criu/uffd.c ``LAZY_PAGES_SOCK_NAME``)."""
RESTORE_FINISHED = 0x52535446
"""What CRIU sends in place of a PID once the restore is done (criu/uffd.c ``LAZY_PAGES_RESTORE_FINISHED``)."""
PAGE = 4096
CHUNK_BYTES = 4 << 20
"""The most one ``UFFDIO_COPY`` copies: large enough that the ioctl's own cost vanishes, small enough that
the threads share the last runs of a process evenly."""
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2
"""``pagemap_entry.flags`` (criu/include/pagemap.h; as in ``criu_pages``)."""

# linux/userfaultfd.h: _IOWR(0xAA, nr, struct) and the message layout.
UFFDIO_COPY = 0xC028AA03
"""``struct uffdio_copy {u64 dst, src, len, mode; s64 copy}``."""
UFFDIO_ZEROPAGE = 0xC020AA04
"""``struct uffdio_zeropage {struct uffdio_range {u64 start, len}; u64 mode; s64 zeropage}``."""
UFFD_MSG_BYTES = 32
UFFD_EVENT_PAGEFAULT = 0x12
_COPY = struct.Struct("QQQQq")
_ZEROPAGE = struct.Struct("QQQq")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class PageFillError(Exception):
    """The pages could not all be filled; the message says which process and why."""


@dataclasses.dataclass(frozen=True)
class Run:
    """Pages the image holds for a process and CRIU left to the fill: ``length`` bytes at ``vaddr``, found at
    ``offset`` in its pages image."""

    vaddr: int
    offset: int
    length: int


def _messages(images_dir_fd: int, name: str, pid: int) -> list[bytes]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=images_dir_fd)
        with os.fdopen(fd, "rb") as fh:
            raw = list(criu_images.entries(fh.read()))
    except OSError as exc:
        raise PageFillError(f"cannot read {name} of PID {pid}: {exc}") from exc
    if not raw:
        raise PageFillError(f"{name} of PID {pid} is empty")
    return raw


def lazy_runs(images_dir_fd: int, pid: int) -> tuple[str, list[Run]]:
    """The pages image (its file name) and the ``PE_LAZY`` runs of process ``pid``'s ``pagemap-<pid>.img``,
    in address order, each within one VMA of its ``mm-<pid>.img`` (a pagemap entry may span adjacent VMAs,
    and one ``UFFDIO_COPY`` may not).

    Raises:
        PageFillError: an image cannot be read, or the pagemap names pages kept in a parent image (an
            incremental dump, which gpusnap does not make).
    """
    pagemap_pb2, mm_pb2 = criu_images.modules("pagemap_pb2", "mm_pb2")
    raw = _messages(images_dir_fd, f"pagemap-{pid}.img", pid)
    ends = sorted(v.end for v in mm_pb2.mm_entry.FromString(_messages(images_dir_fd, f"mm-{pid}.img", pid)[0]).vmas)
    head = pagemap_pb2.pagemap_head.FromString(raw[0])
    runs: list[Run] = []
    offset = 0
    for message in raw[1:]:
        entry = pagemap_pb2.pagemap_entry.FromString(message)
        flags = entry.flags if entry.HasField("flags") else (0 if entry.in_parent else PE_PRESENT)
        if flags & PE_PARENT:
            raise PageFillError(f"the pagemap of PID {pid} names pages of a parent image")
        if not flags & PE_PRESENT:
            continue
        length = entry.nr_pages * PAGE
        if flags & PE_LAZY:
            runs.extend(_split(Run(entry.vaddr, offset, length), ends))
        offset += length
    runs.sort(key=lambda r: r.vaddr)
    return f"pages-{head.pages_id}.img", runs


def _split(run: Run, ends: list[int]) -> Iterator[Run]:
    """``run`` cut where a VMA ends (``ends``: every VMA's end, sorted)."""
    start, stop = run.vaddr, run.vaddr + run.length
    i = bisect.bisect_right(ends, start)
    while i < len(ends) and ends[i] < stop:
        yield Run(start, run.offset + (start - run.vaddr), ends[i] - start)
        start = ends[i]
        i += 1
    yield Run(start, run.offset + (start - run.vaddr), stop - start)


class _Process:
    """One restored process: its ``userfaultfd``, its lazy runs and a read-only mapping of its pages image."""

    def __init__(self, pid: int, uffd: int, images_dir_fd: int):
        self.pid = pid
        self.uffd = uffd
        pages, self.runs = lazy_runs(images_dir_fd, pid)
        self.starts = [r.vaddr for r in self.runs]
        self.size = 0
        self.base = 0
        need = max((r.offset + r.length for r in self.runs), default=0)
        if not need:
            return
        fd = os.open(pages, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=images_dir_fd)
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise PageFillError(f"{pages} holds {size} bytes, its pagemap names {need}")
            base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if base in (None, _MAP_FAILED):
                raise PageFillError(f"cannot map {pages}: {os.strerror(ctypes.get_errno())}")
        finally:
            os.close(fd)
        self.size, self.base = size, int(base)

    def chunks(self) -> list[tuple[_Process, int, int, int]]:
        """The fill's work for this process: (process, destination, source address, bytes), in address order."""
        out = []
        for r in self.runs:
            for done in range(0, r.length, CHUNK_BYTES):
                out.append((self, r.vaddr + done, self.base + r.offset + done, min(CHUNK_BYTES, r.length - done)))
        return out

    def source_of(self, address: int) -> int:
        """Where the page at ``address`` is in the mapped image, or 0 where the image holds none."""
        i = bisect.bisect_right(self.starts, address) - 1
        if i >= 0:
            r = self.runs[i]
            if r.vaddr <= address < r.vaddr + r.length:
                return self.base + r.offset + (address - r.vaddr)
        return 0

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.size)
            self.base = 0
        if self.uffd >= 0:
            os.close(self.uffd)
            self.uffd = -1


def copy(uffd: int, dst: int, src: int, length: int) -> None:
    """``UFFDIO_COPY`` ``length`` bytes from ``src`` (this process) to ``dst`` (the ``userfaultfd``'s process),
    skipping pages already present (a fault served them first). The GIL is released during the ioctl.

    Raises:
        OSError: the kernel refused the copy (``ENOENT``: no registered VMA there; ``EFAULT``: ``src`` unreadable).
    """
    while length > 0:
        arg = bytearray(_COPY.pack(dst, src, length, 0, 0))
        try:
            fcntl.ioctl(uffd, UFFDIO_COPY, arg, True)
            return
        except OSError as exc:
            done = _COPY.unpack(arg)[4]
            if exc.errno == errno.EEXIST:
                done = max(done, 0) + PAGE  # the page at dst + done exists: step over it
            elif exc.errno == errno.EAGAIN and done > 0:
                pass  # partial copy: go on from where it stopped
            else:
                raise
        dst, src, length = dst + done, src + done, length - done


def _zero_page(uffd: int, address: int) -> None:
    arg = bytearray(_ZEROPAGE.pack(address, PAGE, 0, 0))
    try:
        fcntl.ioctl(uffd, UFFDIO_ZEROPAGE, arg, True)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise


@dataclasses.dataclass(frozen=True)
class Stats:
    """What a fill did: ``bytes`` of pages copied by ``threads`` threads in ``seconds`` (from :meth:`PageFill.start`
    to the last copy), ``processes`` filled, page ``faults`` served before the threads had a page in, and
    ``file_bytes`` of private /dev/shm files copied with them (``privateshm.Deferred``)."""

    bytes: int
    seconds: float
    threads: int
    processes: int
    faults: int
    file_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class PageFill:
    """Serve CRIU's lazy-pages socket for one restore (module docstring). Single-threaded until :meth:`start`;
    the helper's loop calls :meth:`handle` for every descriptor of :meth:`selectables` that is readable.

    Args:
        images_dir_fd: the images CRIU restores from.
        work_dir_fd: CRIU's working directory (the socket is made there; it must hold no other).
        threads: how many threads fill the pages (at least 1).
    """

    def __init__(self, images_dir_fd: int, work_dir_fd: int, threads: int, files: Sequence[privateshm.Deferred] = ()):
        self.images_dir_fd = images_dir_fd
        self.files = list(files)
        """Private /dev/shm files whose bytes the threads copy too (``privateshm``)."""
        self.threads = max(1, threads)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(f"/proc/self/fd/{work_dir_fd}/{SOCKET_NAME}")
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self.processes: dict[int, _Process] = {}
        self.finished = False
        """CRIU sent ``RESTORE_FINISHED``."""
        self.hung_up = False
        """CRIU's connection ended (after ``RESTORE_FINISHED``, or because CRIU failed or died)."""
        self.faults = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._work: list[tuple[Callable[[], None], int, str]] = []
        """(copy, bytes, what) for each chunk of pages, or of a file (its bytes negated)."""
        self._next = 0
        self._workers: list[threading.Thread] = []
        self._started = 0.0
        self._last_copy = 0.0
        self._bytes = 0
        self._file_bytes = 0

    def selectables(self) -> list[int]:
        """The descriptors to watch: the socket (listening, then CRIU's connection) and every ``userfaultfd``."""
        sock = [] if self.hung_up else [(self.conn if self.conn is not None else self.listener).fileno()]
        return [*sock, *(p.uffd for p in self.processes.values() if p.uffd >= 0)]

    def handle(self, fd: int) -> None:
        """``fd`` (one of :meth:`selectables`) is readable: take CRIU's connection, a process's ``userfaultfd``,
        or serve page faults.

        Raises:
            PageFillError: CRIU broke the protocol, a process's images cannot be filled from, or an event
                other than a page fault came (a task ran).
        """
        if fd == self.listener.fileno() and self.conn is None:
            self.conn, _ = self.listener.accept()
            return
        if self.conn is not None and fd == self.conn.fileno():
            self._receive()
            return
        for p in self.processes.values():
            if p.uffd == fd:
                self._serve(p)
                return

    def _read_exactly(self, n: int) -> tuple[bytes, list[int]] | None:
        """``n`` bytes of CRIU's connection and the descriptors that came with them; ``None`` at its end."""
        assert self.conn is not None
        data, fds = b"", []
        while len(data) < n:
            chunk, got, _flags, _addr = socket.recv_fds(self.conn, n - len(data), 4)
            fds.extend(got)
            if not chunk:
                for f in fds:
                    os.close(f)
                self.hung_up = True  # CRIU's own answer says why, if it had not finished
                return None
            data += chunk
        return data, fds

    def _receive(self) -> None:
        got = self._read_exactly(4)
        if got is None:
            return
        data, fds = got
        (pid,) = struct.unpack("<i", data)
        if pid == RESTORE_FINISHED:
            self.finished = True
            return
        if pid < 0:  # a zombie: no memory to fill
            return
        rest = self._read_exactly(1)  # the byte that carries the descriptor
        fds.extend(rest[1] if rest else ())
        if len(fds) != 1:
            for f in fds:
                os.close(f)
            raise PageFillError(f"CRIU sent {len(fds)} descriptors for PID {pid}, not its userfaultfd")
        if pid in self.processes:
            os.close(fds[0])
            raise PageFillError(f"CRIU sent a second userfaultfd for PID {pid}")
        os.set_blocking(fds[0], False)
        self.processes[pid] = _Process(pid, fds[0], self.images_dir_fd)

    def _serve(self, p: _Process) -> None:
        """Serve every fault queued on ``p``'s ``userfaultfd``."""
        try:
            data = os.read(p.uffd, UFFD_MSG_BYTES * 64)
        except BlockingIOError:
            return
        for at in range(0, len(data) - UFFD_MSG_BYTES + 1, UFFD_MSG_BYTES):
            event = data[at]
            if event != UFFD_EVENT_PAGEFAULT:
                raise PageFillError(f"PID {p.pid} raised userfaultfd event {event:#x} while its pages were filled")
            address = struct.unpack_from("<Q", data, at + 16)[0] & ~(PAGE - 1)
            src = p.source_of(address)
            if src:
                copy(p.uffd, address, src, PAGE)
            else:
                _zero_page(p.uffd, address)
            self.faults += 1

    def start(self) -> None:
        """Start the threads (at CRIU's ``post-restore``: module docstring, step 4)."""
        for p in self.processes.values():
            for _, dst, src, n in p.chunks():
                self._work.append((functools.partial(copy, p.uffd, dst, src, n), n, f"PID {p.pid}'s pages at {dst:#x}"))
        for f in self.files:
            src = f.source_fd()
            for offset, length in f.data:
                for done in range(0, length, CHUNK_BYTES):
                    at, n = offset + done, min(CHUNK_BYTES, length - done)
                    self._work.append((functools.partial(privateshm.copy_range, src, f.fd, at, n), -n, f.source))
        self._work.sort(key=lambda w: -abs(w[1]))  # whole chunks first, the short tails of runs last
        self._started = self._last_copy = time.monotonic()
        for i in range(min(self.threads, max(1, len(self._work)))):
            t = threading.Thread(target=self._fill, name=f"gpusnap-pagefill-{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def _fill(self) -> None:
        while True:
            with self._lock:
                if self.error is not None or self._next >= len(self._work):
                    return
                job, n, what = self._work[self._next]
                self._next += 1
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 (kept for finish(), which raises it)
                with self._lock:
                    if self.error is None:
                        self.error = PageFillError(f"filling {what} failed: {exc}")
                return
            with self._lock:
                if n >= 0:
                    self._bytes += n
                else:  # a file's bytes
                    self._file_bytes -= n
                self._last_copy = time.monotonic()

    def finish(self, timeout_s: float) -> Stats:
        """Wait for every page (serving faults meanwhile), then close the ``userfaultfd``s: the tasks may run.

        Raises:
            PageFillError: a copy failed, or the threads did not finish within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while any(t.is_alive() for t in self._workers):
            if time.monotonic() > deadline:
                with self._lock:
                    self.error = self.error or PageFillError(f"the pages were not filled within {timeout_s:g} s")
                break
            fds = [p.uffd for p in self.processes.values() if p.uffd >= 0]
            ready, _, _ = select.select(fds, [], [], 0.01) if fds else ([], [], [])
            by_fd = {p.uffd: p for p in self.processes.values()}
            for fd in ready:
                self._serve(by_fd[fd])
        for t in self._workers:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self.error is not None:
            raise self.error
        if not self.finished:
            raise PageFillError("CRIU did not say it had finished restoring before the tree was to run")
        if self._next < len(self._work):
            raise PageFillError(f"{len(self._work) - self._next} runs of pages were never filled")
        stats = Stats(
            self._bytes,
            self._last_copy - self._started,
            len(self._workers),
            len(self.processes),
            self.faults,
            self._file_bytes,
        )
        for p in self.processes.values():
            p.close()  # the tasks' registered ranges go with the last reference: they fault as usual from now
        self._close_files()
        return stats

    def _close_files(self) -> None:
        self._work.clear()
        for f in self.files:
            f.close()

    def close(self) -> None:
        """Stop the threads and release everything (after a failure: only once the tree is killed)."""
        with self._lock:
            self.error = self.error or PageFillError("the fill was stopped")
        for t in self._workers:
            t.join(timeout=5)
        for p in self.processes.values():
            p.close()
        self._close_files()
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
"""``_IOWR(0xAA, 0x3F, struct uffdio_api {u64 api, features, ioctls})``."""
NEEDED_FEATURES = 0x2 | 0x4 | 0x8 | 0x40
"""The events CRIU's lazy restore asks for (criu/uffd.c ``NEED_UFFD_API_FEATURES``): ``UFFD_FEATURE_EVENT_FORK``,
``_REMAP``, ``_REMOVE`` and ``_UNMAP``. CRIU refuses a lazy restore where the kernel lacks one."""
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}


def probe() -> str:
    """Why this host cannot fill pages this way ("" when it can): ``userfaultfd(2)`` and the API features CRIU's
    lazy restore needs, asked of the kernel in this process (a seccomp filter, a kernel without
    ``CONFIG_USERFAULTFD``, or one too old all show here)."""
    nr = _SYS_USERFAULTFD.get(os.uname().machine)
    if nr is None:
        return f"no userfaultfd system call number known for {os.uname().machine}"
    _libc.syscall.restype = ctypes.c_long
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(os.O_CLOEXEC | os.O_NONBLOCK))
    if fd < 0:
        return f"userfaultfd(2): {os.strerror(ctypes.get_errno())}"
    try:
        arg = bytearray(struct.pack("QQQ", UFFD_API, NEEDED_FEATURES, 0))
        try:
            fcntl.ioctl(fd, UFFDIO_API, arg, True)
        except OSError as exc:
            return f"UFFDIO_API: {exc.strerror}"
        features = struct.unpack("QQQ", arg)[1]
        if features & NEEDED_FEATURES != NEEDED_FEATURES:
            return f"the kernel's userfaultfd lacks events CRIU's lazy restore needs (features {features:#x})"
        return ""
    finally:
        os.close(fd)


MIN_BYTES = 64 << 20
"""Below this many bytes of pages images a restore leaves the pages to CRIU: the fill's own start (a socket,
each process's pagemap read, its threads) costs 15–40 ms, more than it saves on a small tree (measured
on the 2-core CI host: a 4 MiB tree restored in 0.206 s with the fill against 0.192 s without, medians of 12)."""
MAX_AUTO_THREADS = 8
"""Most threads ``page_fill_threads = 0`` gives: past a few threads a fill is bound by memory bandwidth."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """How restores fill private pages on this host: ``threads`` (0: CRIU's own reads) and, when off, why."""

    threads: int
    reason: str = ""

    def summary(self) -> str:
        """One line for ``gpusnap node``."""
        return f"{self.threads} threads" if self.threads else f"off ({self.reason})"


OFF = Setting(0, "page_fill_threads = -1")


def setting(configured: int) -> Setting:
    """``page_fill_threads`` (``DaemonConfig``: -1 off, 0 one per CPU this process may run on, at most
    ``MAX_AUTO_THREADS``, else that many) on this host, after :func:`probe`."""
    if configured < 0:
        return OFF
    reason = probe()
    if reason:
        return Setting(0, f"{reason}; each restored process reads its own pages, on one thread")
    return Setting(configured or min(MAX_AUTO_THREADS, len(os.sched_getaffinity(0))))
