"""Capture preflight for a process tree: what CRIU would refuse, or what could never be restored, found
before anything is touched, each with its cause and fix."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import CheckpointOptions, ProcessFacts, TcpMode, Terminal
from gpusnap.daemon.drivers import host, proc
from gpusnap.daemon.preflight import criu_limits

_PIPE = re.compile(r"^pipe:\[(\d+)\]$")
_IO_URING = "anon_inode:[io_uring]"
_PTMX = ("/dev/ptmx", "/dev/pts/ptmx")


def check_tree(opts: CheckpointOptions, facts: ProcessFacts, *, defer_tcp: bool = False) -> None:
    """Every tree-level capture precondition.

    Args:
        opts: the capture's options.
        facts: the tree.
        defer_tcp: leave the established-TCP check to :func:`check_tcp` after the worker's quiesce (its
            adapter may close connections there, as ranks tearing down their process groups do).

    Raises:
        FailedPreconditionError: reasons ``TCP_ESTABLISHED``, ``CAPABILITY_MISSING`` (any process of the tree
            of another user), ``USER_NAMESPACE``, ``PID_NAMESPACE_INIT``, ``SESSION_OUTSIDE_NAMESPACE``, ``IO_URING``, ``CRIU_UNSUPPORTED`` (see ``criu_limits``), ``EXTERNAL_PIPE``.
    """
    pids = list(facts.tree_pids)
    if not defer_tcp:
        check_tcp(opts, pids)
    foreign = next(((p, uid) for p in pids for uid in [_foreign_uid(p)] if uid is not None), None)
    if foreign is not None and not host.has_capability(host.CAP_SYS_RESOURCE):
        pid, uid = foreign
        raise FailedPreconditionError(
            f"process {pid} of the tree runs as uid {uid}, and gpusnapd lacks CAP_SYS_RESOURCE, without which CRIU "
            "cannot read another user's resource limits; run gpusnapd as root with its full capability set",
            reason="CAPABILITY_MISSING",
        )
    if not proc.same_user_namespace(opts.pid):
        raise FailedPreconditionError(
            f"PID {opts.pid} runs in a user namespace of its own (rootless container, `unshare -U`); gpusnap "
            "captures only trees in the host's user namespace, whose namespaces only root can change",
            reason="USER_NAMESPACE",
        )
    if proc.namespace_pid(opts.pid) == 1 and opts.pid != 1:
        raise FailedPreconditionError(
            f"PID {opts.pid} is the init (PID 1) of its own PID namespace, which gpusnap restores into a namespace "
            "it creates itself; checkpoint the process the init runs instead (its child)",
            reason="PID_NAMESPACE_INIT",
        )
    check_sessions(pids)
    rings = [(p, fd) for p in pids for fd, target in _fds(p) if target == _IO_URING]
    if rings:
        pid, fd = rings[0]
        raise FailedPreconditionError(
            f"fd {fd} of process {pid} is an io_uring instance, which CRIU cannot checkpoint (libuv's event loops, "
            "e.g. uvloop under vLLM's API server, create one); install gpusnap into the worker's Python environment and "
            "start it with GPUSNAP_AGENT_SOCKET set (gpusnap's vLLM plugin blocks io_uring), or make io_uring "
            "unavailable before starting it (sysctl kernel.io_uring_disabled=2)",
            reason="IO_URING",
        )
    unsupported = criu_limits.find(pids)
    if unsupported:
        more = f" (and {len(unsupported) - 1} more)" if len(unsupported) > 1 else ""
        raise FailedPreconditionError(
            f"{unsupported[0]}{more}", reason="CRIU_UNSUPPORTED", metadata={"pid": str(unsupported[0].pid)}
        )
    outside = _external_pipes(pids)
    if outside:
        pid, fd, other = outside[0]
        fix = (
            "Send the worker's output to a file (e.g. `>> worker.log 2>&1 < /dev/null`) instead of a pipe"
            if fd <= 2
            else f"It was most likely inherited from what started the worker (IDE terminals and CI runners pass "
            f"such descriptors on): start the worker with it closed (`CMD {fd}>&-` in bash)"
        )
        raise FailedPreconditionError(
            f"fd {fd} of process {pid} is a pipe whose other end is held by process {other}, outside the tree; "
            f"after a restore that end would be gone. {fix}",
            reason="EXTERNAL_PIPE",
            metadata={"pid": str(pid), "fd": str(fd)},
        )


def check_sessions(pids: Sequence[int]) -> None:
    """Every process of the tree is in a session and process group whose leader gpusnapd's PID namespace sees.

    A process started by ``docker exec``/``kubectl exec`` or by a supervisor in a parent PID namespace,
    without a session of its own, reads session 0 in ``/proc/<pid>/stat``. CRIU refuses to dump it ("A session
    leader of … is outside of its pid namespace", criu/cr-dump.c), after the tree was already frozen.

    Raises:
        FailedPreconditionError: reason ``SESSION_OUTSIDE_NAMESPACE``, naming the first such process.
    """
    for p in pids:
        fields = _stat_fields(p)
        if len(fields) > 3 and "0" in (fields[2], fields[3]):
            raise FailedPreconditionError(
                f"process {p} is in a session or process group whose leader is outside gpusnapd's PID namespace "
                "(started by `docker exec`, `kubectl exec` or a supervisor in a parent namespace without a session "
                "of its own), which CRIU cannot checkpoint; start the worker in a session of its own (`setsid "
                "CMD`, or start_new_session=True) and checkpoint that",
                reason="SESSION_OUTSIDE_NAMESPACE",
                metadata={"pid": str(p)},
            )


def check_tcp(opts: CheckpointOptions, pids: Sequence[int], *, after_quiesce: bool = False) -> None:
    """With ``--tcp refuse`` (the default), no process of the tree has an established TCP connection.

    Raises:
        FailedPreconditionError: reason ``TCP_ESTABLISHED``, naming up to three connections.
    """
    if opts.tcp is not TcpMode.REFUSE:
        return
    conns = proc.established_tcp(list(pids))
    if conns:
        when = " after the worker's quiesce" if after_quiesce else ""
        raise FailedPreconditionError(
            f"the tree has established TCP connections{when} ({'; '.join(conns[:3])}); "
            "close them first (a tensor-parallel worker tears down its process groups at quiesce: "
            "gpusnap.adapters.distributed), or pass --tcp close (restored closed) or --tcp established (needs the "
            "same addresses at restore)",
            reason="TCP_ESTABLISHED",
        )


def _fds(pid: int) -> list[tuple[int, str]]:
    base = Path(f"/proc/{pid}/fd")
    out = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        try:
            out.append((int(name), os.readlink(base / name)))
        except OSError:
            continue
    return out


def _foreign_uid(pid: int) -> int | None:
    """A uid of ``pid`` (real, effective, saved or filesystem) other than gpusnapd's, if any."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return next((int(u) for u in line.split()[1:] if int(u) != os.geteuid()), None)
    except OSError:
        pass
    return None


def _stat_fields(pid: int) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, tty_nr, …"""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _pty_index(pid: int, fd: int) -> int | None:
    """The pty a ``/dev/ptmx`` master fd controls (``tty-index`` in fdinfo, Linux >= 4.14)."""
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("tty-index:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def outside_terminals(pids: Sequence[int]) -> tuple[Terminal, ...]:
    """The terminals of the tree whose other side (terminal emulator, sshd, tmux) stays outside it.

    CRIU restores a pty whose master and slave are both in the tree. A job started from an interactive
    shell has one whose master is outside: as its controlling terminal (the shell's session, led outside
    the tree), and as stdin, stdout or stderr unless they were redirected. With ``shell_job`` CRIU dumps
    it as the tree's link to that outside terminal; a restore cannot reconnect to it (the shell may be
    gone, or elsewhere), so it hands CRIU a file in its place (``inherit_fd``, key ``tty[rdev:dev]`` as
    CRIU's tty.c names it) and the restored tree runs in a session of its own, without a terminal.
    """
    tree = set(pids)
    masters = {
        i for p in pids for fd, target in _fds(p) if target in _PTMX for i in [_pty_index(p, fd)] if i is not None
    }
    found: dict[str, tuple[str, list[str], bool]] = {}  # path -> key, "pid/fd"s, controlling
    for p in pids:
        fields = _stat_fields(p)
        if len(fields) > 4 and int(fields[4]) != 0 and int(fields[3]) not in tree:
            tty_nr = int(fields[4])
            major, minor = (tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
            if 136 <= major <= 143:
                path = f"/dev/pts/{(major - 136) * 256 + minor}"
                key, fds, _ = found.get(path, (_tty_key(path), [], True))
                found[path] = (key, fds, True)
        for fd, target in _fds(p):
            if target.startswith("/dev/pts/") and target.removeprefix("/dev/pts/").isdigit():
                if int(target.removeprefix("/dev/pts/")) not in masters:
                    key, fds, controlling = found.get(target, (_tty_key(f"/proc/{p}/fd/{fd}"), [], False))
                    found[target] = (key or _tty_key(f"/proc/{p}/fd/{fd}"), [*fds, f"{p}/{fd}"], controlling)
    return tuple(
        Terminal(path=path, key=key, fds=tuple(fds), controlling=controlling)
        for path, (key, fds, controlling) in sorted(found.items())
    )


def _tty_key(path: str) -> str:
    """CRIU's ``inherit_fd`` key of the terminal at ``path`` (``tty[rdev:dev]``, hex), ``""`` when gone."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"tty[{st.st_rdev:x}:{st.st_dev:x}]"


def _descends_from(pid: int, tree: set[int]) -> bool:
    """Whether ``pid``'s parent chain reaches a process of ``tree``."""
    seen = 0
    while pid > 1 and seen < 4096:
        fields = _stat_fields(pid)
        if len(fields) < 2:
            return False
        pid = int(fields[1])
        if pid in tree:
            return True
        seen += 1
    return False


def _external_pipes(pids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(pid, fd, outside pid) for pipes of the tree that a process outside it also holds.

    Every other process's descriptors are read (one ``readlink`` each, relative to its open ``fd``
    directory); only a process that holds one of the tree's pipes has its parent chain walked, to tell a
    child forked since the tree was listed (part of the tree CRIU freezes) from an outside holder.
    """
    inside: dict[str, tuple[int, int]] = {}
    for p in pids:
        for fd, target in _fds(p):
            if _PIPE.match(target):
                inside.setdefault(target, (p, fd))
    if not inside:
        return []
    tree = set(pids)
    found = []
    for entry in os.listdir("/proc"):
        if not inside:
            break
        if not entry.isdigit() or int(entry) in tree:
            continue
        held = [t for t in _pipe_targets(int(entry)) if t in inside]
        if not held or _descends_from(int(entry), tree):
            continue  # a child forked since the tree was listed is part of the tree CRIU freezes
        for target in held:
            if target in inside:
                pid, fd = inside.pop(target)
                found.append((pid, fd, int(entry)))
    return found


def _pipe_targets(pid: int) -> list[str]:
    """The ``pipe:[inode]`` targets of ``pid``'s descriptors."""
    try:
        dfd = os.open(f"/proc/{pid}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    out = []
    try:
        for name in os.listdir(dfd):
            try:
                target = os.readlink(name, dir_fd=dfd)
            except OSError:
                continue
            if target.startswith("pipe:["):
                out.append(target)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return out
