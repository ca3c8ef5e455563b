"""Facts about live process trees, read from /proc through psutil."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil

from gpusnap.daemon.api.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from gpusnap.daemon.api.types import Caller, ProcessFacts


def tree_pids(pid: int) -> list[int]:
    """``pid`` followed by all its descendants (depth first).

    Raises:
        NotFoundError: no such process (reason ``PROCESS_NOT_FOUND``).
    """
    proc = _process(pid)
    try:
        return [pid, *(c.pid for c in proc.children(recursive=True))]
    except psutil.NoSuchProcess as exc:
        raise _not_found(pid) from exc


def tree_pids_or_empty(pid: int) -> list[int]:
    """:func:`tree_pids`, or ``[]`` when the root is gone."""
    try:
        return tree_pids(pid)
    except NotFoundError:
        return []


def facts(pid: int) -> ProcessFacts:
    """Describe the tree rooted at ``pid``.

    Raises:
        NotFoundError: the root vanished.
    """
    proc = _process(pid)
    pids = tree_pids(pid)
    try:
        with proc.oneshot():
            uids = proc.uids()
            gids = proc.gids()
            comm = proc.name()
            cmdline = tuple(proc.cmdline())
            try:
                cwd = proc.cwd()
            except psutil.AccessDenied:
                cwd = ""
    except psutil.NoSuchProcess as exc:
        raise _not_found(pid) from exc
    rss = rss_bytes(pids)
    return ProcessFacts(
        pid=pid,
        comm=comm,
        cmdline=cmdline,
        uid=uids.real,
        gid=gids.real,
        tree_pids=tuple(pids),
        rss_bytes=rss,
        cwd=cwd,
        listening=tuple(listening_addresses(pids)),
    )


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of ``pids`` together (bytes; gone ones count 0)."""
    rss = 0
    for p in pids:
        try:
            rss += psutil.Process(p).memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return rss


def check_may_checkpoint(pid: int, caller: Caller) -> list[int]:
    """Refuse targets no caller may checkpoint, and other users' processes for non-root callers.

    Returns:
        The tree's PIDs, root first (as :func:`tree_pids`).

    Raises:
        InvalidArgumentError: the daemon itself or one of its ancestors.
        PermissionDeniedError: a non-root caller names a process it does not own.
        NotFoundError: no such process.
    """
    status = _status(pid)
    if status.get("Tgid", str(pid)) != str(pid):
        raise InvalidArgumentError(
            f"{pid} is a thread of process {status['Tgid']}; checkpoint the process (or its tree's root) instead",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    if pid == 2 or status.get("PPid") == "2":
        raise InvalidArgumentError(
            f"PID {pid} is a kernel thread; only user processes can be checkpointed",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    own = os.getpid()
    ancestors = {own}
    try:
        ancestors.update(p.pid for p in psutil.Process(own).parents())
    except psutil.Error:
        pass
    if pid in ancestors:
        raise InvalidArgumentError(
            f"PID {pid} is gpusnapd itself or one of its ancestors; name the worker's process tree instead",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    owners = set()
    tree = tree_pids(pid)
    if caller.pid and caller.pid in tree:
        raise InvalidArgumentError(
            f"the tree of PID {pid} contains the calling process ({caller.pid}), whose connection to gpusnapd "
            "cannot be captured; call gpusnap from outside the tree",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    for p in tree:
        if p == own:
            raise InvalidArgumentError(
                f"the tree of PID {pid} contains gpusnapd itself", reason="INVALID_PID", metadata={"pid": str(pid)}
            )
        try:
            owners.add(psutil.Process(p).uids().real)
        except psutil.NoSuchProcess:
            continue
    if not caller.is_root and owners != {caller.uid}:
        raise PermissionDeniedError(
            f"PID {pid} (or a process of its tree) does not belong to uid {caller.uid}; "
            "only root may checkpoint other users' processes",
            reason="NOT_OWNER",
            metadata={"pid": str(pid)},
        )
    if not caller.is_root:
        check_plain_rights(tree, caller.uid)
    return tree


def check_plain_rights(pids: list[int], uid: int) -> None:
    """Refuse a non-root caller's tree with a process that holds more than uid ``uid``'s own rights.

    Checked at preflight and again on the frozen tree (a process may exec a set-user-ID program between).

    Raises:
        PermissionDeniedError: reason ``NOT_OWNER``, naming the process and what it holds.
    """
    for p in pids:
        extra = _rights_beyond(p, uid)
        if extra:
            raise PermissionDeniedError(
                f"process {p} of the tree runs with rights beyond uid {uid}'s own ({extra}): a set-user-ID or "
                "set-group-ID program, or one with file capabilities, whose restore would bring them back; end it "
                "before the capture, or have root checkpoint the tree",
                reason="NOT_OWNER",
                metadata={"pid": str(p)},
            )


def _rights_beyond(pid: int, uid: int) -> str:
    """What ``pid`` holds beyond a plain process of ``uid`` (``/proc/<pid>/status``: every uid ``uid``, its
    effective, saved and filesystem gids its real one, no permitted, effective or ambient capability); ``""``
    when nothing or gone. CRIU restores all of these from the images (``creds`` of ``core-*.img``)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    fields = {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}
    uids, gids = fields.get("Uid", []), fields.get("Gid", [])
    names = ("real", "effective", "saved", "filesystem")
    for name, value in zip(names, uids, strict=False):
        if int(value) != uid:
            return f"{name} uid {value}"
    for name, value in zip(names[1:], gids[1:], strict=False):
        if gids and value != gids[0]:
            return f"{name} gid {value}, real gid {gids[0]}"
    for key in ("CapPrm", "CapEff", "CapAmb"):
        if int((fields.get(key) or ["0"])[0], 16):
            return f"capabilities {key}={fields[key][0]}"
    return ""


def established_tcp(pids: list[int]) -> list[str]:
    """Established TCP connections of the tree, as ``"pid: laddr -> raddr"`` lines."""
    out = []
    for p in pids:
        try:
            conns = psutil.Process(p).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_ESTABLISHED and c.raddr:
                out.append(f"{p}: {c.laddr.ip}:{c.laddr.port} -> {c.raddr.ip}:{c.raddr.port}")
    return out


def listening_addresses(pids: list[int]) -> list[str]:
    """TCP addresses ``"ip:port"`` that ``pids`` listen on, sorted."""
    out: set[str] = set()
    for p in pids:
        try:
            conns = psutil.Process(p).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        out.update(f"{c.laddr.ip}:{c.laddr.port}" for c in conns if c.status == psutil.CONN_LISTEN)
    return sorted(out)


def ports_in_use(addresses: list[str]) -> list[str]:
    """Those of ``addresses`` (``"ip:port"``) on whose port something listens on this host now."""
    wanted = {int(a.rsplit(":", 1)[1]): a for a in addresses}
    if not wanted:  # psutil.net_connections reads every process's descriptors: skip it when it can find nothing
        return []
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return []
    busy = set()
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port in wanted:
            busy.add(wanted[c.laddr.port])
    return sorted(busy)


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stopped(pid: int) -> bool:
    """True if ``pid`` is stopped or traced (e.g. left frozen by a dead CRIU)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:
        return False


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children)."""
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            out.extend(int(x) for x in (task / "children").read_text().split())
    except (FileNotFoundError, ProcessLookupError):
        return []
    return out


def same_user_namespace(pid: int) -> bool:
    """Whether ``pid`` shares gpusnapd's user namespace (``/proc/<pid>/ns/user``)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user")
    except OSError:
        return False


def group_members(pgid: int, started_since: float) -> list[int]:
    """Live processes of process group ``pgid`` started at or after ``started_since`` (epoch seconds): the
    start time tells a group's members from a later group that reuses the number."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.create_time() >= started_since and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def start_time(pid: int) -> float:
    """When ``pid`` started (seconds since the epoch, as psutil reports it); 0 if it is gone. With the PID,
    it names one process even after the PID is reused."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def _status(pid: int) -> dict[str, str]:
    """``/proc/<pid>/status`` as a dict (first word of each value); empty when unreadable."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.split()[0] if value.split() else ""
    return out


def title(pid: int) -> str:
    """``pid``'s title for messages: the first word of its command line (``VLLM::Worker``…), or ``""``."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.split(b"\0")[0].decode(errors="replace")[:80]


def namespace_pid(pid: int) -> int:
    """``pid``'s PID inside its innermost PID namespace (last NSpid field)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def _process(pid: int) -> psutil.Process:
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            raise _not_found(pid)
        return proc
    except psutil.NoSuchProcess as exc:
        raise _not_found(pid) from exc


def _not_found(pid: int) -> NotFoundError:
    return NotFoundError(
        f"no process with PID {pid} (in gpusnapd's PID namespace); check the PID with `ps -p {pid}`",
        reason="PROCESS_NOT_FOUND",
        metadata={"pid": str(pid)},
    )


def kill_tree(pids: list[int]) -> None:
    """SIGKILL every PID of ``pids`` (gone ones are skipped)."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            continue


def ensure_no_frozen(pids: list[int]) -> list[int]:
    """Send SIGCONT to any process of ``pids`` left stopped (after a killed CRIU); returns those resumed."""
    resumed = []
    for p in pids:
        if stopped(p):
            try:
                os.kill(p, signal.SIGCONT)
                resumed.append(p)
            except ProcessLookupError:
                continue
    return resumed
