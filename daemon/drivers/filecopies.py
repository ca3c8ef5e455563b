"""Copies of the files a restored tree continues writing, made in the restore's helper as the user who writes them.

The daemon decides which files (``gpusnap.daemon.operations.file_copies``) and sends, in the helper's
request (``criu_exec``'s ``file_copies``)::

    {"in_place": true,
     "files": [{"path": "/home/u/w.log", "key": "home/u/w.log", "reopen": false, "copy": "w.log.gpusnap-op-…",
                "size": 18649, "pos": 18649, "flags": 32769, "uid": 1000, "gid": 1000, "groups": [1000]}]}

:func:`make` forks a child that *is* the user the file's writer ran as (``uid``, ``gid`` and ``groups``, for
good; root only for a writer that ran as root), one per user, which opens each file by its path, so the
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
import json
import os
import socket
import stat
from typing import Any

from gpusnap.daemon.drivers.criu_userpaths import Refused

SETTABLE = os.O_APPEND | os.O_NONBLOCK | os.O_ASYNC | getattr(os, "O_DIRECT", 0) | getattr(os, "O_NOATIME", 0)
"""Status flags ``F_SETFL`` sets (fcntl(2)); set once the copy is written."""
AT_OPEN = os.O_SYNC | os.O_DSYNC
"""Flags only ``open(2)`` sets."""
CHUNK = 1 << 20


@dataclasses.dataclass
class Made:
    """What :func:`make` made: ``inherit`` (CRIU's key, descriptor) pairs and ``copies`` for the result."""

    inherit: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    copies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``{"path", "copy", "size_bytes"}``: the file, its copy's path, the bytes copied."""
    ids: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(st_dev, st_ino) of each copy: :meth:`discard` removes a name only while it still names that copy."""

    def close_fds(self) -> None:
        """Close this process's descriptors of the copies (once CRIU has inherited them)."""
        for _, fd in self.inherit:
            os.close(fd)
        self.inherit = [(key, -1) for key, _ in self.inherit]

    owners: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The credentials each copy was made with (``uid``, ``gid``, ``groups``)."""
    reopen: set[str] = dataclasses.field(default_factory=set)
    """Paths whose copy CRIU reopens once per open file description (``criu_userpaths.external``)."""

    def reopened(self) -> frozenset[str]:
        """The paths CRIU must take as external files (their copies' descriptors are keyed by the path)."""
        return frozenset(self.reopen)

    def ledger(self) -> list[dict[str, Any]]:
        """What :func:`remove` needs to remove the copies later: each copy's path, device, inode and the
        credentials it was made with (JSON-ready)."""
        return [
            {"path": c["copy"], "dev": d, "ino": i, **o}
            for c, (d, i), o in zip(self.copies, self.ids, self.owners, strict=True)
        ]

    def discard(self) -> None:
        """Remove the copies (a failed restore), each as the user who made it; a name that no longer names
        its copy is left."""
        remove(self.ledger())


def remove(ledger: list[dict[str, Any]]) -> None:
    """Remove the copies of ``ledger`` (:meth:`Made.ledger`), each in a child that is the user who made it,
    and only while its name still names that copy (same device and inode): the tree that wrote them has
    ended (``gpusnap.daemon.drivers.reaper``), or its restore failed."""
    for owner, group in _by_owner(ledger, _owner):
        _as_owner(owner, lambda group=group: [_unlink_same(it) for it in group])


def make(spec: dict[str, Any] | None) -> Made:
    """The copies ``spec`` asks for (module docstring); nothing when ``spec`` is ``None``.

    Raises:
        Refused: a file is shorter than at the dump (``FILE_SHRUNK``), or its copy could not be made
            (``FILE_COPY_FAILED``); copies made before are removed.
    """
    if not spec or not spec.get("files"):
        return Made()
    made = Made()
    failure = None
    try:
        for owner, files in _by_owner(spec["files"], _owner):
            replies = _as_owner(owner, lambda files=files: [_one(f, bool(spec["in_place"])) for f in files])
            for f, (reply, fd) in zip(files, replies, strict=False):
                if "error" in reply:
                    failure = (f, reply)
                    break
                if fd >= 0:
                    made.inherit.append((f["key"], fd))
                    made.copies.append({"path": f["path"], "copy": _copy_path(f), "size_bytes": f["size"]})
                    made.ids.append((reply["dev"], reply["ino"]))
                    made.owners.append(owner)
                    if f.get("reopen"):
                        made.reopen.add(f["path"])
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


def _owner(f: dict[str, Any]) -> dict[str, Any]:
    """The credentials a file's copy is made with: its writer's (``uid``, ``gid``, ``groups``)."""
    return {"uid": int(f["uid"]), "gid": int(f["gid"]), "groups": [int(g) for g in f["groups"]]}


def _by_owner(items: list[Any], owner_of: Any) -> list[tuple[dict[str, Any], list[Any]]]:
    """``items`` grouped by ``owner_of(item)``, in the order each owner first appears."""
    groups: dict[str, tuple[dict[str, Any], list[Any]]] = {}
    for item in items:
        owner = owner_of(item)
        groups.setdefault(json.dumps(owner, sort_keys=True), (owner, []))[1].append(item)
    return list(groups.values())


def _one(f: dict[str, Any], in_place: bool) -> tuple[dict[str, Any], int]:
    """In the owner's child: the copy of one file (its reply and descriptor; -1 when none is needed)."""
    try:
        src = os.open(f["path"], os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}, -1  # CRIU opens it and says what is wrong (the file-rights check came first)
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            return {}, -1
        if st.st_size < f["size"]:
            return {"error": "shrunk", "now": st.st_size}, -1
        if in_place and st.st_size == f["size"]:
            return {}, -1
        try:
            dst = _create(f, stat.S_IMODE(st.st_mode) & 0o777)
        except OSError as exc:
            return {"error": "copy", "now": st.st_size, "why": exc.strerror or str(exc)}, -1
        made = os.fstat(dst)
        try:
            _copy(src, dst, f["size"])
            os.lseek(dst, f["pos"], os.SEEK_SET)
            fcntl.fcntl(dst, fcntl.F_SETFL, f["flags"] & SETTABLE)
        except OSError as exc:
            os.close(dst)
            _unlink_same({"path": _copy_path(f), "dev": made.st_dev, "ino": made.st_ino})
            return {"error": "copy", "now": st.st_size, "why": exc.strerror or str(exc)}, -1
        return {"dev": made.st_dev, "ino": made.st_ino}, dst
    finally:
        os.close(src)


def _copy_path(f: dict[str, Any]) -> str:
    return os.path.join(os.path.dirname(str(f["path"])), str(f["copy"]))


def _create(f: dict[str, Any], mode: int) -> int:
    """The copy, created beside the file (no symlink followed, never an existing file), with ``mode``."""
    parent = os.open(os.path.dirname(f["path"]) or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = (f["flags"] & (os.O_ACCMODE | AT_OPEN)) | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(f["copy"], flags, 0o600, dir_fd=parent)
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


def _unlink_same(item: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """In the owner's child: remove ``item["path"]`` if it is still the copy made (same device and inode)."""
    try:
        st = os.lstat(item["path"])
        if (st.st_dev, st.st_ino) == (item["dev"], item["ino"]):
            os.unlink(item["path"])
    except OSError:
        pass
    return {}, -1


def _as_owner(spec: dict[str, Any], work: Any) -> list[tuple[dict[str, Any], int]]:
    """Run ``work()`` (a list of (reply, fd) pairs) in a child that is ``spec``'s uid, gid and groups (an
    owner as :func:`_owner` gives it); the replies come back one message each, with their descriptor.

    Raises:
        Refused: the child could not become the owner or died (``FILE_COPY_FAILED``, INTERNAL).
    """
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - its replies and exit status are checked by the parent
        code = 1
        try:
            parent.close()
            uid, gid = int(spec["uid"]), int(spec["gid"])
            os.setgroups([int(g) for g in spec["groups"]])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            if uid != 0 and (os.geteuid() == 0 or os.getegid() == 0 and gid != 0):
                raise OSError(errno.EPERM, "could not drop to the owner's credentials")
            for reply, fd in work():
                socket.send_fds(child, [json.dumps(reply).encode()], [fd] if fd >= 0 else [])
                if fd >= 0:
                    os.close(fd)
            code = 0
        finally:
            os._exit(code)
    child.close()
    out: list[tuple[dict[str, Any], int]] = []
    try:
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(parent, 65536, 1)
            if not msg:
                break
            out.append((json.loads(msg), fds[0] if fds else -1))
    finally:
        parent.close()
        _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        for _, fd in out:
            if fd >= 0:
                os.close(fd)
        raise Refused(
            f"the copies of the files the tree writes could not be made as uid {spec['uid']} (helper exit status "
            f"{os.waitstatus_to_exitcode(status)})",
            reason="FILE_COPY_FAILED",
            code="INTERNAL",
        )
    return out


def _refusal(f: dict[str, Any], reply: dict[str, Any]) -> Refused:
    path, size, now = f["path"], f["size"], reply["now"]
    if reply["error"] == "shrunk":
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
        f"first {size} bytes, {copy}, which uid {f['uid']} could not create ({reply['why']}); let uid "
        f"{f['uid']} create files in {os.path.dirname(path) or '/'} (and free space there), or open the file "
        "with O_APPEND in the worker",
        reason="FILE_COPY_FAILED",
        code="FAILED_PRECONDITION",
    )
