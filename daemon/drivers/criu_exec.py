"""Runs one CRIU request through pycriu in a short-lived helper process.

gpusnapd never forks CRIU from its own (multi-threaded) process. It starts
``python -m gpusnap.daemon.drivers.criu_exec CRIU-COMMAND…`` (the command that runs CRIU, e.g. the
prefix's ``bin/criu``; ``swrk <fd>`` is appended), writes one JSON request on its stdin and reads JSON
lines from its stdout. The helper is single-threaded, so it may safely fork, enter namespaces and
start ``criu swrk`` (as pycriu's own binary transport does, with the command given). It loads pycriu
and starts a ``criu swrk`` before it reads its request, so gpusnapd can start it ahead of need
(``CriuDriver.keep_spare_helper``): CRIU's start (its ``exec`` and dynamic linking) is then paid between
requests, and that CRIU waits for its request on the socket, doing nothing. A dump in gpusnapd's own
namespaces and a restore into its PID namespace use it; a request that must run CRIU in other namespaces
ends it (at end of stream CRIU exits) and starts its own there. A helper that reads end of file
instead exits at once.

The request is one :class:`~gpusnap.daemon.drivers.criu_protocol.Request` line; the helper answers with
:class:`~gpusnap.daemon.drivers.criu_protocol.Event` lines (``init``, ``start``, ``notify``, then ``result``) and
reads an :class:`~gpusnap.daemon.drivers.criu_protocol.Answer` line after ``start`` and after each ``notify``
(``drivers.criu_protocol`` says what each field means).

With ``new_pidns`` the helper unshares a PID and a mount namespace and forks the namespace's init:
that init (PID 1 inside) makes mounts slaves of the host's, mounts a fresh /proc and starts CRIU
while the daemon journals it, then (once the daemon has answered) sends CRIU its restore request, reports, and then stays as the tree's reaper until the tree ends, so restored PIDs can
never clash with PIDs in use and the tree outlives both the helper and gpusnapd. The recipe is
``unshare --pid --mount --fork --mount-proc`` (util-linux) followed by ``criu restore``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import importlib.util
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from gpusnap.daemon.api.types import Creds, ProcessImage
from gpusnap.daemon.defaults import INSTALL_CRIU
from gpusnap.daemon.drivers import criu_protocol as protocol
from gpusnap.daemon.drivers import criu_userpaths, filecopies, owner_child, privateshm
from gpusnap.daemon.drivers.criu_protocol import (
    Answer,
    CriuOpts,
    Event,
    Notify,
    Request,
    Result,
    Start,
)
from gpusnap.daemon.drivers.pagefill import PageFill, PageFillError
from gpusnap.daemon.store import documents

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 16384
MS_SLAVE = 1 << 19

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def _setns(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({path})")
    finally:
        os.close(fd)


def _mount(source: str | None, target: str, fstype: str | None, flags: int) -> None:
    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), None), f"mount({target})")


def _emit(stream: Any, event: Event) -> None:
    stream.write(protocol.line(event).decode())
    stream.flush()


def _asked() -> bool:
    """gpusnapd's :class:`Answer` on stdin; end of input (gpusnapd died) or a line that is none means no."""
    answer = sys.stdin.readline()
    if not answer:
        return False
    try:
        return documents.decode(answer.encode(), Answer).ok
    except documents.DocumentError:
        return False


def _pycriu() -> tuple[Any, Any]:
    """pycriu's RPC client class and its ``rpc_pb2`` module, loaded without ``pycriu/__init__.py``.

    That file also imports ``pycriu.images``, the decoders of every image type: about 0.4 s of protobuf
    descriptors on a loaded 2-core host (``python -X importtime``), 2/3 of a helper's start, for code
    a helper never runs. The package is registered with its ``__init__`` unrun, so ``pycriu.criu``'s own
    ``import pycriu.rpc_pb2`` resolves. pycriu comes from the CRIU prefix (install-criu.sh).

    Raises:
        ImportError: pycriu is not on the path.
    """
    if "pycriu" not in sys.modules:
        spec = importlib.util.find_spec("pycriu")
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"pycriu is not importable; {INSTALL_CRIU}")
        sys.modules["pycriu"] = importlib.util.module_from_spec(spec)
    # (by module name: a pycriu imported whole binds ``pycriu.criu`` to its class ``criu``, not the module)
    client = importlib.import_module("pycriu.criu")
    rpc_pb2 = importlib.import_module("pycriu.rpc_pb2")

    return client.criu, rpc_pb2


class Swrk:
    """A ``criu swrk`` started by this helper: ``sk`` is this end of its RPC socket pair, ``pid`` its PID.

    The start is pycriu's ``_criu_comm_bin.connect`` (a ``SOCK_SEQPACKET`` pair, CRIU with no stdio and the
    other end as ``swrk <fd>``) with a command of the caller's, which pycriu's transport cannot take.
    ``keep_fds`` stay open in CRIU (the descriptors a request names in ``inherit_fd``).
    """

    def __init__(self, command: list[str], stdin: int = -1, keep_fds: tuple[int, ...] = ()):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                for fd in (theirs.fileno(), *keep_fds):  # keep_fds: CRIU's inherit_fd descriptors
                    os.set_inheritable(fd, True)
                for fd in (0, 1, 2):
                    os.close(fd)
                if stdin >= 0:  # a terminal for a shell job's (CRIU reopens its stdin for it)
                    os.dup2(stdin, 0)
                os.execvp(command[0], [*command, "swrk", str(theirs.fileno())])
            finally:
                os._exit(1)
        theirs.close()
        self.sk, self.pid = ours, pid
        self.reaped = False

    def alive(self) -> bool:
        """Whether this CRIU still runs (one that exited is reaped here)."""
        try:
            self.reaped = os.waitpid(self.pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            self.reaped = True
        return not self.reaped

    def close(self, wait: bool = True) -> None:
        """Close the socket (an idle CRIU exits at end of stream) and, with ``wait``, reap CRIU; a second
        call does nothing. Without ``wait`` an exiting CRIU is left to be reaped when this helper exits."""
        self.sk.close()
        if wait and not self.reaped:
            self.reaped = True
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                pass


def _ready(warm: Swrk, command: list[str]) -> Swrk:
    """``warm`` if it still runs, else a fresh CRIU (one that died while it waited is replaced)."""
    if warm.alive():
        return warm
    warm.close()
    return Swrk(command)


DEFAULT_FILL_TIMEOUT_S = 900.0
"""How long a page fill may take when the request names no timeout."""
ASKED_SCRIPTS = frozenset({"post-dump", "post-restore", "pre-resume"})
"""CRIU notifications the daemon answers itself; all others are acknowledged here at once."""
CRIU_POLL_S = 0.2
"""How often the helper checks that CRIU still runs while it waits for CRIU's next message."""


def _run_criu(
    req: Request,
    swrk: Swrk,
    prepared: criu_userpaths.Prepared | None = None,
    deferred: Sequence[privateshm.Deferred] = (),
) -> Result:
    """Run the request's CRIU action on ``swrk`` (a CRIU this process started); returns the result.

    CRIU's notifications (``notify_scripts``) are relayed: for ``post-dump`` (images complete, tree
    still frozen), ``post-restore`` (tree restored; ``pid`` is the root's PID as CRIU sees it) and
    ``pre-resume`` (every task restored with its credentials and stopped before its first instruction)
    the helper emits a :class:`Notify` (at ``post-dump`` with ``image_bytes``: PID → bytes of pages the images
    hold for it, :mod:`gpusnap.daemon.drivers.criu_pages`; at ``pre-resume`` with a page fill ``page_fill``, its
    :class:`~gpusnap.daemon.drivers.pagefill.Stats`) and waits for gpusnapd's :class:`Answer`; no makes CRIU
    fail the dump and resume the tree, or kill the
    restored tree (at ``post-restore``). At ``pre-resume`` CRIU only logs a refusal and would go on to resume
    the tasks, so this helper kills them first: on ``false``, on end of input (gpusnapd died) and when the page
    fill failed (then without asking gpusnapd). pycriu answers one request with one response and has no
    notification loop, so this loop is written here on pycriu's own ``rpc_pb2`` messages and transport.
    """
    criu_class, rpc = _pycriu()
    c = criu_class()
    images_fd = os.open(prepared.images_dir if prepared else req.images_dir, os.O_DIRECTORY)
    work_fd = os.open(req.work_dir, os.O_DIRECTORY)
    fill: PageFill | None = None
    failure = ""
    try:
        c.opts.images_dir_fd = images_fd
        c.opts.work_dir_fd = work_fd
        _set_opts(c.opts, req.opts)
        for key, fd in prepared.inherit if prepared else ():
            inherited = c.opts.inherit_fd.add()
            inherited.key, inherited.fd = key, fd
        c.opts.notify_scripts = True
        if req.action == "restore" and req.page_fill_threads > 0:
            fill = PageFill(images_fd, work_fd, req.page_fill_threads, files=deferred)
            c.opts.lazy_pages = True
        msg = rpc.criu_req()
        msg.type = {"dump": rpc.DUMP, "restore": rpc.RESTORE}[req.action]
        msg.opts.MergeFrom(c.opts)
        sk = swrk.sk
        reaped = False
        try:
            sk.send(msg.SerializeToString())
            while True:
                resp = rpc.criu_resp()
                size, reaped = _next_size(sk, swrk.pid, fill)
                if size == 0:  # end of stream: criu is gone (killed or crashed) without answering
                    raise ConnectionResetError(
                        errno.ECONNRESET, "criu closed the connection without answering (killed?)"
                    )
                resp.ParseFromString(sk.recv(size))
                if resp.type != rpc.NOTIFY:
                    break
                ok = True
                script = resp.notify.script
                if script in ASKED_SCRIPTS:
                    image_bytes = _image_bytes(images_fd) if script == "post-dump" else ()
                    stats = None
                    if fill is not None and script == "post-restore":
                        fill.start()  # every task forked and mapped: see pagefill, step 4
                    if fill is not None and script == "pre-resume":
                        try:
                            stats = fill.finish(req.timeout_s or DEFAULT_FILL_TIMEOUT_S)
                        except PageFillError as exc:
                            failure = f"filling the restored tree's pages failed: {exc}"
                    if not failure:
                        _emit(sys.stdout, Event(notify=Notify(script, resp.notify.pid, image_bytes, stats)))
                        ok = _asked()
                    if script == "pre-resume" and (failure or not ok):
                        _kill_restored(swrk.pid)  # before CRIU, which only logs the refusal, resumes them
                        ok = False
                ack = rpc.criu_req()
                ack.type = rpc.NOTIFY
                ack.notify_success = ok
                sk.send(ack.SerializeToString())
        except PageFillError as exc:  # a fault could not be served, or CRIU broke the lazy-pages protocol
            failure = f"filling the restored tree's pages failed: {exc}"
            _kill_restored(swrk.pid)
        finally:
            swrk.reaped = swrk.reaped or reaped
            swrk.close()
        if failure:
            return Result(ok=False, error=failure)
        if not resp.success:
            err = resp.cr_errmsg or os.strerror(resp.cr_errno) if resp.cr_errno else resp.cr_errmsg
            return Result(ok=False, error=err or "CRIU reported failure", errno=resp.cr_errno)
        return Result(ok=True, pid=int(resp.restore.pid) if req.action == "restore" else 0)
    except Exception as exc:  # transport errors, a killed criu, OSError, …
        if fill is not None:
            _kill_restored(swrk.pid)  # nothing restored may run with pages left out
        return Result(ok=False, error=failure or f"{type(exc).__name__}: {exc}", errno=getattr(exc, "errno", 0) or 0)
    finally:
        swrk.close()
        if fill is not None:
            fill.close()
        os.close(images_fd)
        os.close(work_fd)


def _kill_restored(criu_pid: int) -> None:
    """Kill every process CRIU restored, none of which has run yet (they are stopped until CRIU resumes them).

    A namespace init (PID 1 of the restore's fresh PID namespace) kills everything else in it, CRIU included;
    a helper in gpusnapd's namespace kills CRIU's descendants (the restored tasks are CRIU's children).
    """
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    from gpusnap.daemon.drivers import proc  # (psutil's import stays off a helper's start)

    for pid in proc.ProcessTable.now().descendants(criu_pid)[1:]:  # CRIU's, from one pass over /proc
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _set_opts(target: Any, opts: CriuOpts) -> None:
    """Set ``opts`` on pycriu's ``criu_opts`` message ``target``: the fields set (``None`` and empty ones are left
    unset: CRIU's defaults)."""
    for field in dataclasses.fields(CriuOpts):
        value = getattr(opts, field.name)
        if value is None or value == ():
            continue
        if field.name == "inherit_fd":
            for key, fd in opts.inherit_fd:
                target.inherit_fd.add(key=key, fd=fd)
        elif field.name == "external":
            target.external.extend(opts.external)
        else:
            setattr(target, field.name, value)


def _image_bytes(images_fd: int) -> tuple[ProcessImage, ...]:
    """Bytes of pages the complete images hold for each process (``criu_pages``); empty if the images cannot be
    read, which never fails the dump."""
    from gpusnap.daemon.drivers import criu_pages

    try:
        return tuple(ProcessImage(pid, n) for pid, n in criu_pages.image_bytes_by_pid(images_fd).items())
    except Exception:  # noqa: BLE001 (a statistic for inspect; the dump goes on without it)
        return ()


def _next_size(sk: socket.socket, criu_pid: int, fill: PageFill | None = None) -> tuple[int, bool]:
    """Size of CRIU's next message, 0 once CRIU is gone; and whether CRIU was reaped here. Meanwhile ``fill``
    (a restore's page fill) takes CRIU's lazy-pages messages and serves page faults.

    A CRIU killed mid-restore can leave a task it forked (stopped, holding its copy of the socket), so the
    socket never reaches end of stream: CRIU's exit is watched as well. CRIU answers and exits at once, so
    an answer may land between a poll that timed out and the exit check: the socket is looked at once more.

    Raises:
        PageFillError: from ``fill``.
    """
    while True:
        watched = [sk.fileno(), *(fill.selectables() if fill is not None else ())]
        ready, _, _ = select.select(watched, [], [], CRIU_POLL_S)
        if fill is not None:
            for fd in ready:
                if fd != sk.fileno():
                    fill.handle(fd)
        if sk.fileno() in ready:
            return len(sk.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK)), False
        if ready:
            continue
        try:
            pid, _ = os.waitpid(criu_pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: gone all the same
            pid = criu_pid
        if pid == criu_pid:
            ready, _, _ = select.select([sk], [], [], 0)
            return (len(sk.recv(1, socket.MSG_TRUNC | socket.MSG_PEEK | socket.MSG_DONTWAIT)) if ready else 0), True


def _prepare_images(req: Request, made: filecopies.Copies) -> criu_userpaths.Prepared | None:
    """The images CRIU restores from: a tree that ran as a user gets its path-named unix sockets made as that
    user (``owner``: criu_userpaths); files whose copies CRIU reopens once per description are marked
    external (``filecopies``)."""
    reopen = made.reopened()
    if req.action != "restore" or not (req.owner or reopen):
        return None
    return criu_userpaths.prepare(req.images_dir, req.scratch_dir, req.owner, reopen)


def _criu_for(inherit: Sequence[tuple[str, int]], command: list[str], stdin: int = -1) -> Swrk:
    """A CRIU that inherits the descriptors of ``inherit`` ((key, fd) pairs); this process's copies are closed
    once it runs."""
    fds = tuple(fd for _, fd in inherit)
    try:
        return Swrk(command, stdin=stdin, keep_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)


def _refused(exc: criu_userpaths.Refused) -> Result:
    return Result(ok=False, error=str(exc), reason=exc.reason, code=exc.code)


def _restore(
    req: Request,
    swrk: Swrk,
    command: list[str],
    stdin: int = -1,
    deferred: Sequence[privateshm.Deferred] = (),
) -> tuple[Result, filecopies.Ledger | None]:
    """CRIU's restore on ``swrk`` (``stdin``: the terminal standing in for a shell job's). First, a non-root
    snapshot's path-named unix sockets, made as its owner (``criu_userpaths``), and copies of the files the tree
    continues writing (``req.file_copies``, ``filecopies``): when there are any, a fresh CRIU inherits them.
    The result lists the copies (``file_copies``); a failed restore removes them. Returns it, and (restored)
    the copies' ledger: it stays in the helper; the namespace init hands it to the reaper (``--copies-fd``),
    which removes the copies with the tree."""
    prepared = None
    made = filecopies.Copies()
    try:
        made = filecopies.make(req.file_copies)
        prepared = _prepare_images(req, made)  # in the tree's namespaces, as its user (criu_userpaths)
        inherit = [*(prepared.inherit if prepared else ()), *made.inherit]
        if inherit:  # CRIU must inherit them: a fresh one
            swrk.close()
            swrk = _criu_for(inherit, command, stdin)
        opts = dataclasses.replace(req.opts, inherit_fd=(*req.opts.inherit_fd, *made.inherit))
        result = _run_criu(dataclasses.replace(req, opts=opts), swrk, prepared, deferred)
    except criu_userpaths.Refused as exc:
        swrk.close()
        result = _refused(exc)
    finally:
        if prepared is not None:
            criu_userpaths.discard(prepared.images_dir)
    if not result.ok:
        made.discard()
        return result, None
    return dataclasses.replace(result, file_copies=tuple(made.copies)), made.ledger()


def _ledger_fd(ledger: filecopies.Ledger | None) -> int:
    """A memfd holding ``ledger`` (the one codec's JSON), inheritable (for the reaper's ``--copies-fd``); -1 when
    there is none or it is empty."""
    if ledger is None or not ledger.copies:
        return -1
    fd = os.memfd_create("gpusnap-copies", 0)
    os.write(fd, documents.encode(ledger))
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


def _reap_forever() -> None:
    """Namespace init: reap children until none is left."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return
        except InterruptedError:
            continue


def _silence_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def _loopback_up() -> None:
    """Bring ``lo`` up in this process's (fresh) network namespace: restored sockets bound to 127.0.0.1 need it."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, siocgifflags, struct.pack("16sH22x", b"lo", 0))
        flags = struct.unpack("16sH", ifr[:18])[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _terminal(req: Request) -> tuple[int, int, int]:
    """For a tree started from a terminal (``req.terminals``): a fresh pty for CRIU's stdin, which CRIU's
    ``shell_job`` restore gives the tree in place of the terminal left behind, and the file its output goes
    to. Returns (slave, master, out), or (-1, -1, -1) when the tree held no terminal.

    ``out`` is ``/dev/null`` by default; a named file is opened (created, appended to) by a child that has
    dropped to the snapshot owner's uid, gid and groups, and handed back over a socket pair, so root never
    resolves a user's path. The namespace init then copies what the tree writes to the pty into it
    (``gpusnap.daemon.drivers.reaper``).
    """
    spec = req.terminals
    if spec is None or not spec.keys:
        return -1, -1, -1
    if spec.path:
        try:
            out = _open_as_owner(spec.path, spec.owner)
        except OSError as exc:  # said as it is (the owner could find it out alone); CRIU never ran: no log
            raise criu_userpaths.Refused(
                f"the restore's --terminal file {spec.path} cannot be opened for appending by uid {spec.owner.uid} "
                f"({os.strerror(exc.errno) if exc.errno else exc}); name a file that uid may create or append to",
                reason="TERMINAL",
                code="FAILED_PRECONDITION",
            ) from None
    else:
        out = os.open(os.devnull, os.O_WRONLY)
    master, slave = os.openpty()
    import fcntl
    import termios

    fcntl.ioctl(slave, termios.TIOCSCTTY, 0)  # this init's session's terminal: CRIU sets the job's group on it
    return slave, master, out


def _open_as_owner(path: str, owner: Creds) -> int:
    """``path`` opened for appending (created 0644 if missing) by a child that is ``owner``
    (``drivers.owner_child``).

    Raises:
        OSError: the child could not open it (its errno and message).
    """

    def work() -> list[tuple[owner_child.Outcome, list[int]]]:
        try:
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOCTTY | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            return [(owner_child.Outcome.failed(0, exc), [])]
        return [(owner_child.Outcome(), [fd])]

    replies, status = owner_child.run_as(owner, work, owner_child.Outcome)
    if status != 0 or len(replies) != 1:
        owner_child.close_all(replies)
        raise OSError(0, f"the snapshot's owner cannot open {path}: its helper exited with status {status}")
    ((opened, fds),) = replies
    if not fds:
        raise OSError(opened.errno, f"the snapshot's owner cannot open {path}: {opened.error}")
    return fds[0]


def _common_dir(req: Request) -> str:
    """The directory that holds every path of the store a restore request names (the store's root)."""
    paths = [req.images_dir, req.work_dir, req.shm_dir or req.images_dir]
    if req.scratch_dir:
        paths.append(req.scratch_dir)
    return str(os.path.commonpath([os.path.realpath(p) for p in paths]))


class NamespaceInit:
    """The init (PID 1) of a fresh PID namespace, in a fresh mount namespace, that will restore a tree there,
    and this helper's end of its pipes: ``requests`` (the request, one line, for an init made ahead; -1 for one
    made with its request), ``go`` (one byte once gpusnapd has journaled it) and ``results`` (the result, one
    line).

    :meth:`ahead` makes one before the request is known (a spare helper does: the init's fork, its mount
    namespace, its ``/proc`` and its CRIU's ``exec`` then happen between requests, not on a restore's path), for a
    restore on the host's network; :meth:`for_request` makes one for a known request (a private network: the
    namespaces are made with it). An init made ahead ends when this helper ends without giving it a request (end
    of file on ``requests``), its namespace and CRIU with it.
    """

    def __init__(self, pid: int, requests: int, go: int, results: int):
        self.pid, self.requests, self.go, self.results = pid, requests, go, results

    @classmethod
    def ahead(cls, command: list[str]) -> NamespaceInit:
        own = os.open("/proc/self/ns/pid", os.O_RDONLY)
        try:
            _unshare(CLONE_NEWPID)  # this helper's next child is the new namespace's init
            return cls._fork(command, None, new_mounts=True)
        finally:  # later children of this helper (a dump's CRIU) stay in its own PID namespace
            _check(_libc.setns(ctypes.c_int(own), ctypes.c_int(CLONE_NEWPID)), "setns(own PID namespace)")
            os.close(own)

    @classmethod
    def for_request(cls, command: list[str], req: Request) -> NamespaceInit:
        _unshare(CLONE_NEWPID | CLONE_NEWNS | (CLONE_NEWNET if req.new_netns else 0))
        if req.new_netns:
            _loopback_up()
        return cls._fork(command, req, new_mounts=False)

    @classmethod
    def _fork(cls, command: list[str], req: Request | None, *, new_mounts: bool) -> NamespaceInit:
        req_r, req_w = os.pipe()
        go_r, go_w = os.pipe()
        res_r, res_w = os.pipe()
        child = os.fork()
        if child == 0:  # PID 1 of the new namespace
            for fd in (req_w, go_w, res_r):
                os.close(fd)
            try:
                _namespace_init(command, req, req_r, go_r, res_w, new_mounts=new_mounts)
            finally:
                os._exit(1)
        for fd in (req_r, go_r, res_w):
            os.close(fd)
        if req is not None:  # the init has its request already
            os.close(req_w)
            req_w = -1
        return cls(child, req_w, go_w, res_r)

    def discard(self) -> None:
        """End an init that got no request (and its CRIU, with its namespace); not waited for."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for fd in (self.requests, self.go, self.results):
            if fd >= 0:
                os.close(fd)

    def restore(self, req: Request, out: Any) -> int:
        """Give the init ``req``, report it to gpusnapd, let it restore once gpusnapd has journaled it, relay the
        result; returns this helper's exit code."""
        if self.requests >= 0:  # made ahead: its request
            os.write(self.requests, protocol.line(req))
            os.close(self.requests)
        _emit(out, Event(init=self.pid))
        go = _may_start(out, self.pid)
        if go:
            os.write(self.go, b"1")
        os.close(self.go)
        if not go:
            os.waitpid(self.pid, 0)
            _emit(out, _NOT_STARTED)
            return 1
        with os.fdopen(self.results, "rb") as fh:
            line = fh.readline()
        try:
            result = documents.decode(line, Result)
        except documents.DocumentError:
            _emit(out, protocol.failed("namespace init died before reporting"))
            return 1
        if not result.ok:
            os.waitpid(self.pid, 0)
        _emit(out, Event(result=result))
        return 0 if result.ok else 1


def _namespace_init(
    command: list[str], req: Request | None, requests: int, go: int, results: int, *, new_mounts: bool
) -> None:
    """The body of :class:`NamespaceInit`'s init: its namespaces and CRIU readied (before the request, when it is
    made ahead), the request's own preparations (a private /dev/shm, a terminal), then the restore once gpusnapd
    said go, then the tree's reaper. Nothing it does before go is seen outside the new namespaces."""
    swrk: Swrk | None = None
    failed: BaseException | None = None
    slave = master = term_out = -1
    carried = ""
    deferred: list[privateshm.Deferred] = []
    try:
        os.setsid()
        if new_mounts:
            _unshare(CLONE_NEWNS)
        _mount(None, "/", None, MS_REC | MS_SLAVE)
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if req is None:
            swrk = Swrk(command)  # on the fresh /proc: CRIU keeps the /proc it first opens
            with os.fdopen(requests, "rb") as fh:
                line = fh.readline()
            if not line:  # the helper ended (or discarded it) without a restore for this init
                os._exit(0)
            req = documents.decode(line, Request)
        else:
            os.close(requests)
        if req.shm_dir:
            carried, deferred = privateshm.mount(req.shm_dir, _common_dir(req), defer=req.page_fill_threads > 0)
        slave, master, term_out = _terminal(req)
        if swrk is None or slave >= 0:  # CRIU gets the stand-in terminal as its stdin when it starts
            if swrk is not None:
                swrk.close()
            swrk = Swrk(command, stdin=slave)
        if req.owner:
            criu_userpaths.warm()
    except BaseException as exc:
        failed = exc
    if os.read(go, 1) != b"1":  # the daemon did not journal this init: restore nothing
        os._exit(1)
    os.close(go)
    ledger = None
    try:
        if failed is not None:
            raise failed
        assert swrk is not None and req is not None
        result, ledger = _restore(req, swrk, command, stdin=slave, deferred=deferred)
    except criu_userpaths.Refused as exc:  # refused before CRIU ran: the daemon's own message and reason
        result = _refused(exc)
    except BaseException as exc:  # report anything, never hang the daemon
        result = Result(ok=False, error=f"namespace init: {exc}", errno=getattr(exc, "errno", 0) or 0)
    if result.ok:
        try:
            privateshm.drop_carried(carried)  # CRIU is done: the tree's /dev/shm holds only its own files
        except OSError as exc:
            _kill_restored(0)
            result = Result(ok=False, error=f"namespace init: {exc}", errno=exc.errno or 0)
    copies = _ledger_fd(ledger if result.ok else None)
    os.write(results, protocol.line(result))
    os.close(results)
    if not result.ok or req is None:
        os._exit(1)
    _silence_stdio()
    pump = [] if copies < 0 else [f"--copies-fd={copies}"]
    if master >= 0:
        os.set_inheritable(master, True)
        os.set_inheritable(term_out, True)
        pump.append(f"--pump={master},{term_out}")
    try:  # the tree's reaper, with a command line naming what it restored
        os.execv(
            sys.executable,
            [sys.executable, "-m", "gpusnap.daemon.drivers.reaper", f"--root={result.pid}", *pump, *req.title],
        )
    except OSError:
        _reap_forever()
    os._exit(0)


_NOT_STARTED = protocol.failed("gpusnapd did not confirm the restore's start")


def _may_start(out: Any, init_pid: int) -> bool:
    """Before a restore's CRIU runs: report this helper's PID and the namespace init's (0: none) and wait
    for the daemon's ``{"ok": true}``, sent once it has journaled them, so that whatever CRIU restores can
    be found again after a daemon crash. End of input (the daemon died) or ``false`` means: restore nothing."""
    _emit(out, Event(start=Start(os.getpid(), init_pid)))
    return _asked()


def _dump_in_ns_of(req: Request, out: Any, command: list[str]) -> int:
    host_pid = req.enter_ns_of
    # Load pycriu while still in gpusnapd's own mount namespace. CRIU itself is then run by path inside
    # the target's, which is safe only because the daemon enters mount namespaces owned by the initial
    # user namespace alone, i.e. made and changeable only by root (checkpoint preflight refuses others).
    _pycriu()
    _setns(f"/proc/{host_pid}/ns/pid", CLONE_NEWPID)
    child = os.fork()  # only children enter the PID namespace
    if child == 0:
        try:
            _setns(f"/proc/{host_pid}/ns/mnt", CLONE_NEWNS)
            result = _run_criu(req, Swrk(command))
        except BaseException as exc:
            result = Result(ok=False, error=f"entering namespaces of {host_pid}: {exc}")
        _emit(out, Event(result=result))
        os._exit(0 if result.ok else 1)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> int:
    # Load pycriu (and protobuf) and start CRIU before the request: a spare helper started ahead
    # (``CriuDriver.keep_spare_helper``) has then paid for both by the time a request comes.
    _pycriu()
    command = sys.argv[1:] or ["criu"]
    warm = Swrk(command)
    ahead = NamespaceInit.ahead(command)  # a restore into a fresh PID namespace (the default) uses it
    line = sys.stdin.readline()
    if not line:  # a spare ended without a request
        ahead.discard()
        warm.close()
        return 0
    req = documents.decode(line.encode(), Request)
    out = sys.stdout
    if req.action == "restore" and req.new_pidns:
        warm.close(wait=False)  # CRIU must start inside the namespaces made for it
        if not req.new_netns:
            return ahead.restore(req, out)
        ahead.discard()
        return NamespaceInit.for_request(command, req).restore(req, out)
    ahead.discard()
    if req.action == "dump" and req.enter_ns_of:
        warm.close(wait=False)
        return _dump_in_ns_of(req, out, command)
    if req.owner:
        criu_userpaths.warm()
    if req.action == "restore" and not _may_start(out, 0):
        warm.close()
        _emit(out, _NOT_STARTED)
        return 1
    if req.terminals is not None and req.terminals.keys:
        warm.close()  # gpusnapd refuses a --host-pidns restore of a tree started from a terminal
        _emit(out, protocol.failed("a terminal needs a restore in a PID namespace of its own"))
        return 1
    if req.action == "restore":  # no init outlives the tree here: its copies stay, named in the result
        result, _ledger = _restore(req, _ready(warm, command), command)
    else:
        result = _run_criu(req, _ready(warm, command))
    _emit(out, Event(result=result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing to clean up: skip the interpreter's teardown (tens of ms of module finalizers)
