"""What CRIU would create, bind or unlink as root by a path a non-root snapshot's owner controls.

CRIU restores as root and acts on the tree's paths by name, following symlinks in the directory part
(criu/sk-unix.c, criu/files-reg.c). For a unix socket bound to a path it unlinks a socket file found
there (``stat`` → ``unlinkat``), binds, ``fchownat``s and ``fchmodat``s the name to the recorded owner
and mode, and connects sockets to a named peer by the peer's path (``unlink_sk``, ``bind_unix_sk``,
``restore_file_perms``, ``post_open_standalone``). For a deleted file (a ghost) it creates
``<path>.cr.<id>.ghost`` (a directory: ``<path>`` itself, with any missing parent) with the saved bytes,
chowns it to the saved owner and removes it once opened (``create_ghost``, ``clean_one_remap``). For a
deleted file with another name it opens and then unlinks the ``link_remap.<id>`` it made beside it at the
dump. A user who swaps a directory on such a path for a symlink (before the restore, or during it with
``renameat2(RENAME_EXCHANGE)``) makes root delete, chown or chmod any file, replace any socket with the
user's own listener, or create a directory or file of the user's in any directory (issue 19). A check
before CRIU cannot close those races.

So for a snapshot of a non-root owner CRIU acts on none of those paths. Before CRIU runs, the restore's
helper (inside the namespaces the tree is restored into) calls :func:`prepare`, which reads
``files.img``, ``remap-fpath.img`` and ``sk-queues.img`` and

1. has a child process that *is* the owner (it drops to the owner's uid, gid and groups for good) do
   what CRIU would do by a socket's path: remove a stale socket file at the name, bind, listen, set the
   recorded mode, connect to a named peer, and unlink a name that was deleted at the dump. The kernel
   checks every step against the owner's rights, so it reaches only what the owner could reach alone.
   Those sockets get their file flags and socket options as CRIU would set them (``restore_sk_common``)
   and go to CRIU as inherited descriptors (``inherit_fd``, key ``socket:[ino]``);
2. moves every ghost into ``<scratch>/ghosts`` (root's, 0700): CRIU creates, chowns, opens and removes
   it there, where no user can redirect it;
3. gives CRIU a copy of the images directory (links, in ``scratch_dir``) whose ``files.img`` names no
   path CRIU would act on: inherited socket entries are marked external (``USK_EXTERN``: CRIU neither
   unlinks by their name nor adds a fake queuer for them), other named socket entries (accepted
   connections, which carry their listener's name but come back as socket pairs) lose their name, and
   ghosts' names point into the scratch directory.

Refused (``UNIX_SOCKET_UNRESTORABLE``): an inherited socket with queued data (CRIU would send it through a
peer it no longer restores), and a bound socket in a connected pair of the tree; (``LINK_REMAP_UNSAFE``) a
link remap outside ``/dev/shm`` (whose own name gpusnap puts back with ``O_EXCL``, ``drivers.devshm``, or
restores into a private tmpfs). Abstract socket names have no path and stay CRIU's. Root's snapshots
are restored as CRIU does it (root's own paths). Files CRIU only opens by path (open, mapped, cwd, root,
exe, FIFOs) are the file-rights check's (``access.file_rights``; docs/security.md).

Only the helper runs this module (gpusnapd imports it for ``Refused``, through ``criu_protocol``): it needs pycriu's
generated image classes (``fdinfo_pb2``), which it loads on first use.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import stat
import struct
from typing import Any

from gpusnap.daemon.api.types import Creds
from gpusnap.daemon.drivers import criu_images, owner_child

USK_EXTERN = 1
"""criu/sk-unix.c: an entry CRIU does not create, bind or unlink by name."""
TCP_ESTABLISHED, TCP_LISTEN = 1, 10
SETTABLE_FLAGS = os.O_APPEND | os.O_NONBLOCK | getattr(os, "O_ASYNC", 0o20000)
"""File status flags ``F_SETFL`` may change (fcntl(2)); CRIU's ``rst_file_params`` sets the recorded ones."""
SO_SNDBUFFORCE, SO_RCVBUFFORCE, SO_PASSSEC = 32, 33, 34
LINKED, GHOST = 0, 1
"""images/remap-file-path.proto ``remap_type``."""
GHOSTS = "ghosts"
"""Where in the scratch directory CRIU creates a non-root snapshot's ghost files."""


class Refused(Exception):
    """The restore cannot go on; ``reason`` and ``code`` (a gRPC code name) for the daemon's error."""

    def __init__(self, message: str, *, reason: str, code: str):
        super().__init__(message)
        self.reason = reason
        self.code = code


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What CRIU gets instead: ``images_dir`` (a scratch copy of links), ``inherit`` (key, fd) pairs."""

    images_dir: str
    inherit: tuple[tuple[str, int], ...]


@dataclasses.dataclass
class _Op:
    """One socket the owner makes: bound at ``bind`` (relative to ``bind_dir``), connected to ``connect``."""

    entry: Any
    bind: bytes = b""
    bind_dir: str = ""
    connect: bytes = b""
    connect_dir: str = ""
    listen: int = -1
    mode: int = -1
    gid: int = -1
    deleted: bool = False


def warm() -> None:
    """Import what :func:`prepare` needs (0.1–0.3 s on a loaded 2-core host): called while the restore
    waits for the daemon's go, so that the wait pays for it."""
    _pb()


def _pb() -> tuple[Any, Any, Any]:
    """pycriu's ``fdinfo_pb2``, ``sk_packet_pb2`` and ``remap_file_path_pb2`` (``criu_images.modules``)."""
    fdinfo_pb2, sk_packet_pb2, remap_file_path_pb2 = criu_images.modules(
        "fdinfo_pb2", "sk_packet_pb2", "remap_file_path_pb2"
    )
    return fdinfo_pb2, sk_packet_pb2, remap_file_path_pb2


def _name(raw: bytes) -> bytes:
    return raw.split(b"\0", 1)[0] if raw[:1] != b"\0" else b""


def _show(name: bytes, directory: str = "") -> str:
    text = name.decode(errors="replace")
    return os.path.join(directory, text) if directory and not text.startswith("/") else text


def _records(data: bytes, cls: Any) -> list[Any]:
    return [cls.FromString(raw) for raw in criu_images.entries(data)]


def _unrestorable(message: str) -> Refused:
    return Refused(message, reason="UNIX_SOCKET_UNRESTORABLE", code="FAILED_PRECONDITION")


def plan(
    files_img: bytes, remaps: list[Any], queued_for: set[int], scratch_dir: str, reopen: frozenset[str] = frozenset()
) -> tuple[list[_Op], bytes] | None:
    """The sockets the owner makes and the rewritten ``files.img``; ``None`` when nothing needs either.

    Args:
        remaps: ``remap-fpath.img``'s entries (``remap_file_path_entry``).
        queued_for: ids of the sockets that hold queued data (``sk-queues.img``'s ``id_for``).
        scratch_dir: where ghosts go (``<scratch_dir>/ghosts``, made by :func:`prepare`).
        reopen: paths of regular files CRIU reopens from an inherited descriptor (see :func:`external`).

    Raises:
        Refused: reason ``UNIX_SOCKET_UNRESTORABLE`` or ``LINK_REMAP_UNSAFE``.
    """
    fdinfo_pb2 = _pb()[0]
    files = _records(files_img, fdinfo_pb2.file_entry)
    regs = {fe.reg.id: fe.reg for fe in files if fe.HasField("reg")}
    ghosts: set[int] = set()
    for r in remaps:
        if r.remap_type == GHOST:
            ghosts.add(r.orig_id)
        elif r.remap_type == LINKED and r.remap_id in regs:
            linked = regs[r.remap_id].name
            if os.path.dirname(linked) != "/dev/shm":
                raise Refused(
                    f"the snapshot reopens {linked}, a link CRIU made at the dump to a deleted file of the tree "
                    "with another name; CRIU would open and remove it by its path as root, in a directory the "
                    "owner controls: restore it as root",
                    reason="LINK_REMAP_UNSAFE",
                    code="FAILED_PRECONDITION",
                )
    usk = {fe.usk.ino: fe.usk for fe in files if fe.HasField("usk")}
    ops: dict[int, _Op] = {}
    for u in usk.values():
        if u.uflags & USK_EXTERN:
            continue  # an outside peer's placeholder: never opened, bound or unlinked
        name, peer = _name(u.name), usk.get(u.peer) if u.peer else None
        mutual = peer is not None and peer.peer == u.ino and peer is not u
        binds = bool(name) and not (u.type != socket.SOCK_DGRAM and u.state == TCP_ESTABLISHED)
        connects = peer is not None and not mutual and bool(_name(peer.name))
        if binds and mutual:
            raise _unrestorable(
                f"the tree's unix socket {_show(name, u.name_dir)} is bound and connected to another socket of "
                "the tree as a pair; gpusnap restores a non-root snapshot's named sockets only when they listen, "
                "are bound alone or are connected by name: restore it as root"
            )
        if not (binds or connects):
            continue
        op = ops[u.ino] = _Op(entry=u)
        if binds:
            op.bind, op.bind_dir = name, u.name_dir
            op.listen = u.backlog if u.state == TCP_LISTEN else -1
            op.deleted = bool(u.deleted)
            if u.HasField("file_perms"):
                op.mode, op.gid = u.file_perms.mode & 0o7777, u.file_perms.gid
        if connects:
            assert peer is not None
            op.connect, op.connect_dir = _name(peer.name), peer.name_dir
    for op in ops.values():
        if op.entry.id in queued_for:
            raise _unrestorable(
                f"the tree's unix socket {_show(op.bind or op.connect, op.bind_dir or op.connect_dir)} holds "
                "queued data; gpusnap restores a non-root snapshot's named sockets itself and cannot refill "
                "their queues: let the tree read its sockets empty before the dump, or restore it as root"
            )
    named = [u for u in usk.values() if _name(u.name) and not u.uflags & USK_EXTERN and u.ino not in ops]
    if not (ops or named or ghosts or reopen):
        return None
    out = bytearray(criu_images.header(files_img))
    for fe in files:
        if fe.HasField("reg") and fe.reg.name in reopen:
            fe.reg.ext = True
        if fe.HasField("usk") and fe.usk.ino in ops:
            fe.usk.uflags |= USK_EXTERN
            fe.usk.deleted = False
        elif fe.HasField("usk") and any(fe.usk is u for u in named):
            fe.usk.name = b""
            fe.usk.ClearField("name_dir")
            fe.usk.ClearField("file_perms")
            fe.usk.deleted = False
        elif fe.HasField("reg") and fe.reg.id in ghosts:
            fe.reg.name = os.path.join(scratch_dir, GHOSTS, f"{fe.reg.id}-{os.path.basename(fe.reg.name)}")
        blob = fe.SerializeToString()
        out += struct.pack("<I", len(blob)) + blob
    order = sorted(ops.values(), key=lambda o: bool(o.connect))  # every bind before any connect
    return order, bytes(out)


def _read(images_dir: str, name: str) -> bytes:
    try:
        with open(os.path.join(images_dir, name), "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return b""


def _queued(data: bytes) -> set[int]:
    sk_packet_pb2 = _pb()[1]
    found: set[int] = set()

    def extra(payload: bytes) -> int:
        pkt = sk_packet_pb2.sk_packet_entry()
        pkt.ParseFromString(payload)
        found.add(pkt.id_for)
        return int(pkt.length)

    for _ in criu_images.entries(data, extra):
        pass
    return found


def external(files_img: bytes, reopen: frozenset[str]) -> bytes | None:
    """``files.img`` with every regular file named in ``reopen`` marked external (``reg.ext``); ``None`` when
    there is none. CRIU then opens each such entry (each open file description the tree held) from the
    inherited descriptor keyed by its path (``inherit_fd``, key ``/path``) through ``/proc/self/fd``, with
    the entry's own flags and position (criu/files-reg.c ``open_path``), instead of resolving the path: how a
    file held through several descriptions continues a copy (``gpusnap.daemon.operations.file_copies``)."""
    if not reopen:
        return None
    fdinfo_pb2 = _pb()[0]
    out = bytearray(criu_images.header(files_img))
    for raw in criu_images.entries(files_img):
        fe = fdinfo_pb2.file_entry.FromString(raw)
        if fe.HasField("reg") and fe.reg.name in reopen:
            fe.reg.ext = True
        blob = fe.SerializeToString()
        out += struct.pack("<I", len(blob)) + blob
    return bytes(out)


def prepare(
    images_dir: str, scratch_dir: str, owner: Creds | None, reopen: frozenset[str] = frozenset()
) -> Prepared | None:
    """Make the snapshot's path-named unix sockets as ``owner`` (``None``: a
    tree that ran as root, whose sockets and ghosts are CRIU's) and the images CRIU restores instead (see the
    module docstring), with the regular files of ``reopen`` external (:func:`external`); ``None`` when
    nothing needs either.

    Creates ``scratch_dir`` (the caller removes it with :func:`discard`).

    Raises:
        Refused: a socket the owner cannot make (``FILE_NOT_PERMITTED``, ``ADDRESS_IN_USE``), or what
            gpusnap does not restore for non-root owners (``UNIX_SOCKET_UNRESTORABLE``, ``LINK_REMAP_UNSAFE``).
    """
    files = _read(images_dir, "files.img")
    planned: tuple[list[_Op], bytes] | None
    if owner is None:
        rewritten = external(files, reopen)
        planned = None if rewritten is None else ([], rewritten)
    else:
        remaps = _records(_read(images_dir, "remap-fpath.img"), _pb()[2].remap_file_path_entry)
        planned = plan(files, remaps, _queued(_read(images_dir, "sk-queues.img")), scratch_dir, reopen)
    if planned is None:
        return None
    ops, files_img = planned
    fds = _as_owner(ops, owner) if ops and owner is not None else []
    try:
        for op, fd in zip(ops, fds, strict=True):
            _restore_common(fd, op.entry)
        os.mkdir(scratch_dir, 0o700)
        os.mkdir(os.path.join(scratch_dir, GHOSTS), 0o700)
        for name in os.listdir(images_dir):
            path = os.path.join(images_dir, name)
            if name != "files.img" and stat.S_ISREG(os.lstat(path).st_mode):
                try:
                    os.link(path, os.path.join(scratch_dir, name))
                except OSError as exc:  # another file system
                    if exc.errno != errno.EXDEV:
                        raise
                    os.symlink(path, os.path.join(scratch_dir, name))
        with open(os.path.join(scratch_dir, "files.img"), "xb") as fh:
            fh.write(files_img)
    except BaseException:
        for fd in fds:
            os.close(fd)
        discard(scratch_dir)
        raise
    return Prepared(
        images_dir=scratch_dir, inherit=tuple((f"socket:[{op.entry.ino}]", fd) for op, fd in zip(ops, fds, strict=True))
    )


def discard(scratch_dir: str) -> None:
    """Remove what :func:`prepare` made in ``scratch_dir`` (links and a copy of one image)."""
    shutil.rmtree(scratch_dir, ignore_errors=True)


def _restore_common(fd: int, u: Any) -> None:
    """What CRIU's ``restore_sk_common`` does for a socket it made: file flags, then socket options."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, u.flags & SETTABLE_FLAGS)
    o = u.opts
    sk = socket.socket(fileno=os.dup(fd))
    try:
        sk.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, o.so_sndbuf // 2)  # the kernel doubles it
        sk.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, o.so_rcvbuf // 2)
        for has, opt, value in (
            (o.HasField("so_priority"), socket.SO_PRIORITY, o.so_priority),
            (o.HasField("so_rcvlowat"), socket.SO_RCVLOWAT, o.so_rcvlowat),
            (o.HasField("so_mark"), getattr(socket, "SO_MARK", 36), o.so_mark),
            (o.so_passcred, socket.SO_PASSCRED, 1),
            (o.so_passsec, SO_PASSSEC, 1),
        ):
            if has:
                sk.setsockopt(socket.SOL_SOCKET, opt, value)
        for opt, sec, usec in (
            (socket.SO_SNDTIMEO, o.so_snd_tmo_sec, o.so_snd_tmo_usec),
            (socket.SO_RCVTIMEO, o.so_rcv_tmo_sec, o.so_rcv_tmo_usec),
        ):
            sk.setsockopt(socket.SOL_SOCKET, opt, struct.pack("@ll", sec, usec))
    finally:
        sk.close()


def _as_owner(ops: list[_Op], owner: Creds) -> list[int]:
    """Run :func:`_make` in a child that is ``owner`` (``drivers.owner_child``); returns its sockets' fds (one per
    op, in order).

    Raises:
        Refused: the first op that failed, with the owner's own error.
    """

    def work() -> list[tuple[owner_child.Outcome, list[int]]]:
        made: list[int] = []
        for op in ops:
            try:
                made.append(_make(op))
            except OSError as exc:  # the sockets before it were made
                return [(owner_child.Outcome.failed(len(made), exc), made)]
        for op in ops:
            if op.deleted:  # its name was gone at the dump: gone again, once everything connected
                os.unlink(_show(op.bind, op.bind_dir))
        return [(owner_child.Outcome(), made)]

    replies, status = owner_child.run_as(owner, work, owner_child.Outcome, max_fds=max(len(ops), 1))
    if len(replies) != 1 or status != 0:
        owner_child.close_all(replies)
        raise Refused(
            f"the unix sockets of the tree could not be made as uid {owner.uid} (helper exit status {status})",
            reason="ACCESS_CHECK_FAILED",
            code="INTERNAL",
        )
    ((failure, fds),) = replies
    if failure.at < 0:
        return fds
    for fd in fds:
        os.close(fd)
    op = ops[failure.at]
    what = "bound" if op.bind else "connected"
    path = _show(op.bind, op.bind_dir) if op.bind else _show(op.connect, op.connect_dir)
    if op.bind and failure.errno == errno.EADDRINUSE:
        raise Refused(
            f"the tree's unix socket {path} cannot be bound again: something else is at that path now; "
            "remove it, or restore the snapshot where the path is free",
            reason="ADDRESS_IN_USE",
            code="FAILED_PRECONDITION",
        )
    raise Refused(
        f"the tree's unix socket {path} cannot be {what} by uid {owner.uid} ({failure.error}); a restore "
        f"makes a non-root snapshot's sockets with its owner's rights: put the directories back as they were "
        "at the dump, or restore as root",
        reason="FILE_NOT_PERMITTED",
        code="PERMISSION_DENIED",
    )


def _make(op: _Op) -> int:
    """In the owner's child: the socket of ``op``, bound, listening and connected as CRIU would; its fd."""
    sk = socket.socket(socket.AF_UNIX, op.entry.type)
    try:
        if op.bind:
            os.chdir(op.bind_dir or "/")
            try:
                if stat.S_ISSOCK(os.lstat(op.bind).st_mode):  # a stale name of an earlier run, as CRIU does
                    os.unlink(op.bind)
            except FileNotFoundError:
                pass
            sk.bind(op.bind)
            if op.mode >= 0:
                os.chmod(op.bind, op.mode)
            if op.gid >= 0 and op.gid != os.getegid():
                try:
                    os.chown(op.bind, -1, op.gid)
                except PermissionError:  # not one of the owner's groups: CRIU ignores EPERM too
                    pass
            if op.listen >= 0:
                sk.listen(op.listen)
        if op.connect:
            os.chdir(op.connect_dir or "/")
            sk.connect(op.connect)
        os.chdir("/")
        return sk.detach()
    except BaseException:
        sk.close()
        raise
