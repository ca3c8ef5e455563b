"""Copies of the files a restored tree continues writing, made in the restore's helper as the user who writes them.

The daemon decides which files (``gpusnap.daemon.operations.file_copies``) and sends a :class:`CopySpec` in
the helper's request (``criu_exec``'s ``file_copies``). :func:`make` has a child that *is* the user the file's
writer ran as (:class:`FileToCopy`'s ``owner``, for good; root only for a writer that ran as root:
``drivers.owner_child``), one per user, which opens each file by its path, so the
kernel checks every step against that user's rights, and reads its size. A file that still has its size at
the dump is left to CRIU when ``in_place``; otherwise the child creates the copy beside it (``O_EXCL``, no
symlink followed), with the file's mode bits, copies the first ``size`` bytes into it and sets its position
and flags as the tree held them. The copies' descriptors come back over a socket pair and go to CRIU as
inherited descriptors (``inherit_fd``, keyed by ``key``): CRIU's name of the file (its path without the
first ``/``), whose entries then share that descriptor, or with ``reopen`` the path itself, whose entries
CRIU marks external and reopens from it one by one, each with its own flags and position
(``criu_userpaths.external``). Either way CRIU resolves neither the file's path nor the copy's: root follows
no path here. A failed restore removes the copies it made (:meth:`Made.discard`, again as their users).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import os
import stat
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from gpusnap.daemon.api.types import Creds, FileCopy
from gpusnap.daemon.drivers import owner_child
from gpusnap.daemon.drivers.criu_userpaths import Refused

SETTABLE = os.O_APPEND | os.O_NONBLOCK | os.O_ASYNC | getattr(os, "O_DIRECT", 0) | getattr(os, "O_NOATIME", 0)
"""Status flags ``F_SETFL`` sets (fcntl(2)); set once the copy is written."""
AT_OPEN = os.O_SYNC | os.O_DSYNC
"""Flags only ``open(2)`` sets."""
CHUNK = 1 << 20
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class FileToCopy:
    """One file the tree continues writing at its own position (``operations.file_copies``)."""

    path: str
    key: str
    """CRIU's name of it (``inherit_fd``): its path without the first ``/``, or with ``reopen`` the path."""
    reopen: bool
    """Held through several open file descriptions: CRIU reopens the copy for each (``criu_userpaths.external``)."""
    copy: str
    """The copy's name, beside the file."""
    size: int
    """Its size at the dump: the bytes copied."""
    pos: int
    flags: int
    """The copy's position and ``open(2)`` flags, as the tree held the file."""
    owner: Creds
    """The rights of the process that writes it: the copy is made (and removed) with them."""


@dataclasses.dataclass(frozen=True)
class CopySpec:
    """What a restore's helper copies (``criu_exec``'s ``file_copies``)."""

    in_place: bool
    """A file that still has its size at the dump is continued in place (this restore took the claim)."""
    files: tuple[FileToCopy, ...]


@dataclasses.dataclass(frozen=True)
class Copied:
    """The owner's child's answer for one file: the copy's inode (with its descriptor), or why none was made
    (``error``: ``shrunk`` or ``copy``; ``now``: the file's size now)."""

    dev: int = 0
    ino: int = 0
    """The copy's device and inode."""
    error: str = ""
    now: int = 0
    why: str = ""
    """``copy``: the owner's own error."""


@dataclasses.dataclass(frozen=True)
class Made:
    """A copy made: removed later only while its name still names it (same device and inode), as its owner."""

    path: str
    """The copy's path."""
    dev: int
    ino: int
    owner: Creds


@dataclasses.dataclass(frozen=True)
class Ledger:
    """The copies a restored tree writes: its namespace init hands them to the reaper (``--copies-fd``), which
    removes them once the tree has ended (:func:`remove`)."""

    copies: tuple[Made, ...] = ()


@dataclasses.dataclass
class Copies:
    """What :func:`make` made: ``inherit`` (CRIU's key, descriptor) pairs and ``copies`` for the result."""

    inherit: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    copies: list[FileCopy] = dataclasses.field(default_factory=list)
    """The file, its copy's path, the bytes copied."""
    made: list[Made] = dataclasses.field(default_factory=list)
    reopen: set[str] = dataclasses.field(default_factory=set)
    """Paths whose copy CRIU reopens once per open file description (``criu_userpaths.external``)."""

    def close_fds(self) -> None:
        """Close this process's descriptors of the copies (once CRIU has inherited them)."""
        for _, fd in self.inherit:
            os.close(fd)
        self.inherit = [(key, -1) for key, _ in self.inherit]

    def reopened(self) -> frozenset[str]:
        """The paths CRIU must take as external files (their copies' descriptors are keyed by the path)."""
        return frozenset(self.reopen)

    def ledger(self) -> Ledger:
        """What :func:`remove` needs to remove the copies later."""
        return Ledger(tuple(self.made))

    def discard(self) -> None:
        """Remove the copies (a failed restore), each as the user who made it; a name that no longer names
        its copy is left."""
        remove(self.ledger())


def remove(ledger: Ledger) -> None:
    """Remove the copies of ``ledger``, each in a child that is the user who made it, and only while its name
    still names that copy (same device and inode): the tree that wrote them has ended
    (``gpusnap.daemon.drivers.reaper``), or its restore failed."""
    for owner, group in _by_owner(ledger.copies, lambda m: m.owner):
        _as_owner(owner, functools.partial(_unlink_all, group))


def make(spec: CopySpec | None) -> Copies:
    """The copies ``spec`` asks for (module docstring); nothing when ``spec`` is ``None``.

    Raises:
        Refused: a file is shorter than at the dump (``FILE_SHRUNK``), or its copy could not be made
            (``FILE_COPY_FAILED``); copies made before are removed.
    """
    made = Copies()
    if not spec or not spec.files:
        return made
    failure = None
    try:
        for owner, files in _by_owner(spec.files, lambda f: f.owner):
            replies = _as_owner(owner, functools.partial(_copy_all, files, spec.in_place))
            for f, (reply, fd) in zip(files, replies, strict=False):
                if reply.error:
                    failure = (f, reply)
                    break
                if fd >= 0:
                    made.inherit.append((f.key, fd))
                    made.copies.append(FileCopy(f.path, _copy_path(f), f.size))
                    made.made.append(Made(_copy_path(f), reply.dev, reply.ino, owner))
                    if f.reopen:
                        made.reopen.add(f.path)
            if failure is not None:
                break
    except BaseException:
        made.close_fds()
        made.discard()
        raise
    if failure is not None:
        made.close_fds()
        made.discard()
        raise _refusal(*failure)
    return made


def _by_owner(items: Iterable[T], owner_of: Callable[[T], Creds]) -> list[tuple[Creds, list[T]]]:
    """``items`` grouped by ``owner_of(item)``, in the order each owner first appears."""
    groups: dict[Creds, list[T]] = {}
    for item in items:
        groups.setdefault(owner_of(item), []).append(item)
    return list(groups.items())


def _copy_all(files: Sequence[FileToCopy], in_place: bool) -> list[tuple[Copied, int]]:
    return [_one(f, in_place) for f in files]


def _unlink_all(made: Sequence[Made]) -> list[tuple[Copied, int]]:
    return [_unlink_same(m.path, m.dev, m.ino) for m in made]


def _one(f: FileToCopy, in_place: bool) -> tuple[Copied, int]:
    """In the owner's child: the copy of one file (its answer and descriptor; -1 when none is needed)."""
    try:
        src = os.open(f.path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return Copied(), -1  # CRIU opens it and says what is wrong (the file-rights check came first)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            return Copied(), -1
        if st.st_size < f.size:
            return Copied(error="shrunk", now=st.st_size), -1
        if in_place and st.st_size == f.size:
            return Copied(), -1
        try:
            dst = _create(f, stat.S_IMODE(st.st_mode) & 0o777)
        except OSError as exc:
            return Copied(error="copy", now=st.st_size, why=exc.strerror or str(exc)), -1
        made = os.fstat(dst)
        try:
            _copy(src, dst, f.size)
            os.lseek(dst, f.pos, os.SEEK_SET)
            fcntl.fcntl(dst, fcntl.F_SETFL, f.flags & SETTABLE)
        except OSError as exc:
            os.close(dst)
            _unlink_same(_copy_path(f), made.st_dev, made.st_ino)
            return Copied(error="copy", now=st.st_size, why=exc.strerror or str(exc)), -1
        return Copied(dev=made.st_dev, ino=made.st_ino), dst
    finally:
        os.close(src)


def _copy_path(f: FileToCopy) -> str:
    return os.path.join(os.path.dirname(f.path), f.copy)


def _create(f: FileToCopy, mode: int) -> int:
    """The copy, created beside the file (no symlink followed, never an existing file), with ``mode``."""
    parent = os.open(os.path.dirname(f.path) or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = (f.flags & (os.O_ACCMODE | AT_OPEN)) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f.copy, flags, 0o600, dir_fd=parent)
    finally:
        os.close(parent)
    os.fchmod(fd, mode)
    return fd


def _copy(src: int, dst: int, size: int) -> None:
    """The first ``size`` bytes of ``src`` into ``dst`` (in the kernel where it can, else read and written).

    Raises:
        OSError: ``ENODATA`` when ``src`` ended before ``size`` bytes (cut back meanwhile).
    """
    done = 0
    while done < size:
        try:
            n = os.copy_file_range(src, dst, min(size - done, 1 << 30), done, done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = os.pwrite(dst, os.pread(src, min(size - done, CHUNK), done), done)
        if n == 0:
            raise OSError(errno.ENODATA, "the file was cut back while it was copied")
        done += n


def _unlink_same(path: str, dev: int, ino: int) -> tuple[Copied, int]:
    """In the owner's child: remove ``path`` if it is still the copy made (same device and inode)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except OSError:
        pass
    return Copied(), -1


def _as_owner(owner: Creds, work: Callable[[], Sequence[tuple[Copied, int]]]) -> list[tuple[Copied, int]]:
    """Run ``work()`` (a list of (answer, fd) pairs) in a child that is ``owner`` (``drivers.owner_child``); the
    answers come back one message each, with their descriptor.

    Raises:
        Refused: the child could not become the owner or died (``FILE_COPY_FAILED``, INTERNAL).
    """
    replies, status = owner_child.run_as(
        owner, lambda: [(reply, [fd] if fd >= 0 else []) for reply, fd in work()], Copied
    )
    if status != 0:
        owner_child.close_all(replies)
        raise Refused(
            f"the copies of the files the tree writes could not be made as uid {owner.uid} (helper exit status "
            f"{status})",
            reason="FILE_COPY_FAILED",
            code="INTERNAL",
        )
    return [(reply, fds[0] if fds else -1) for reply, fds in replies]


def _refusal(f: FileToCopy, reply: Copied) -> Refused:
    path, size, now = f.path, f.size, reply.now
    if reply.error == "shrunk":
        return Refused(
            f"{path} is {now} bytes, {size} at the dump: it was cut back since, and the tree continues it after "
            f"byte {size}; a restore cannot bring the bytes back: dump the worker again, or put the file back as "
            "it was",
            reason="FILE_SHRUNK",
            code="FAILED_PRECONDITION",
        )
    copy = _copy_path(f)
    why = "it grew since the dump" if now != size else "an earlier restore of this snapshot (or its source) writes it"
    return Refused(
        f"{path} is one the tree writes at its own position and {why}, so this restore continues a copy of its "
        f"first {size} bytes, {copy}, which uid {f.owner.uid} could not create ({reply.why}); let uid "
        f"{f.owner.uid} create files in {os.path.dirname(path) or '/'} (and free space there), or open the file "
        "with O_APPEND in the worker",
        reason="FILE_COPY_FAILED",
        code="FAILED_PRECONDITION",
    )
