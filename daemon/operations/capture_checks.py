"""Capture preflight for a process tree: what CRIU would refuse, or what could never be restored, found
before anything is touched, each with its cause and fix."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.api.types import CheckpointOptions, ProcessFacts, TcpMode
from gpusnap.daemon.drivers import host, proc

_PIPE = re.compile(r"^pipe:\[(\d+)\]$")
_TTY_PREFIXES = ("/dev/pts/", "/dev/tty", "/dev/console")
_IO_URING = "anon_inode:[io_uring]"


def check_tree(opts: CheckpointOptions, facts: ProcessFacts, *, defer_tcp: bool = False) -> None:
    """Every tree-level capture precondition.

    Args:
        opts: the capture's options.
        facts: the tree.
        defer_tcp: leave the established-TCP check to :func:`check_tcp` after the worker's quiesce (its
            adapter may close connections there, as ranks tearing down their process groups do).

    Raises:
        FailedPreconditionError: reasons ``TCP_ESTABLISHED``, ``CAPABILITY_MISSING``, ``USER_NAMESPACE``,
            ``PID_NAMESPACE_INIT``, ``TERMINAL``, ``EXTERNAL_PIPE``, ``IO_URING``.
    """
    pids = list(facts.tree_pids)
    if not defer_tcp:
        check_tcp(opts, pids)
    if facts.uid != os.geteuid() and not host.has_capability(host.CAP_SYS_RESOURCE):
        raise FailedPreconditionError(
            f"PID {opts.pid} belongs to uid {facts.uid}, and gpusnapd lacks CAP_SYS_RESOURCE, without which CRIU "
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
    ttys = _terminal_users(pids)
    if ttys:
        raise FailedPreconditionError(
            f"process {ttys[0][0]} has a terminal open ({ttys[0][1]}); a restored tree cannot get its terminal back. "
            "Start the worker with stdin/stdout/stderr on files or /dev/null, under setsid (as a service does)",
            reason="TERMINAL",
        )
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
    outside = _external_pipes(pids)
    if outside:
        pid, fd, other = outside[0]
        raise FailedPreconditionError(
            f"fd {fd} of process {pid} is a pipe whose other end is held by process {other}, outside the tree; "
            "after a restore that end would be gone. Send the worker's output to a file (e.g. `>> worker.log`) "
            "instead of a pipe",
            reason="EXTERNAL_PIPE",
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


def _terminal_users(pids: Sequence[int]) -> list[tuple[int, str]]:
    return [(p, target) for p in pids for _, target in _fds(p) if target.startswith(_TTY_PREFIXES)]


def _external_pipes(pids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(pid, fd, outside pid) for pipes of the tree that a process outside it also holds."""
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
        if not entry.isdigit() or int(entry) in tree:
            continue
        for _, target in _fds(int(entry)):
            if target in inside:
                pid, fd = inside.pop(target)
                found.append((pid, fd, int(entry)))
    return found
