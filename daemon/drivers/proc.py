"""Facts about live process trees, read from /proc through psutil."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import psutil

from gpusnap.daemon.api.errors import NotFoundError
from gpusnap.daemon.api.types import ProcessFacts


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


@dataclasses.dataclass(frozen=True)
class ProcessTable:
    """Every process at one moment: PID -> (parent PID, ``comm``), read in one pass over ``/proc/<pid>/stat``
    (:meth:`now`; a process that ends meanwhile, or is a zombie, is left out). Callers that need many trees
    build them from this one listing (:meth:`descendants`) instead of a listing per tree, which ``psutil``'s
    ``children`` makes (``gpusnap ls --running`` over 128 trees took 1.0 s: issue 26, item 9)."""

    processes: dict[int, tuple[int, str]]
    children: dict[int, list[int]]

    @classmethod
    def now(cls) -> ProcessTable:
        processes: dict[int, tuple[int, str]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    stat = fh.read()
            except OSError:
                continue
            close = stat.rfind(b")")  # comm may hold spaces and parentheses: it ends at the last ")"
            fields = stat[close + 2 :].split()
            if close < 0 or len(fields) < 2 or fields[0] == b"Z":
                continue
            processes[int(name)] = (int(fields[1]), stat[stat.find(b"(") + 1 : close].decode(errors="replace"))
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in processes.items():
            children.setdefault(ppid, []).append(pid)
        return cls(processes, children)

    def named(self, comm: str) -> list[int]:
        """The PIDs whose ``comm`` is ``comm``."""
        return [pid for pid, (_, c) in self.processes.items() if c == comm]

    def descendants(self, pid: int) -> list[int]:
        """``pid`` (if listed) followed by all its descendants, depth first."""
        out: list[int] = []
        stack = [pid] if pid in self.processes else []
        while stack:
            p = stack.pop()
            out.append(p)
            stack.extend(sorted(self.children.get(p, []), reverse=True))
        return out


def maps_name(pid: int, name: str) -> bool:
    """Whether ``pid`` maps a file whose name starts with ``name`` (``/proc/<pid>/maps``); False once gone."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            return any(line.split(maxsplit=5)[5:6] and line.split(maxsplit=5)[5].startswith(name) for line in fh)
    except OSError:
        return False


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
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children); a thread that ends while they are read
    is skipped (its children, if any, are re-parented to a live one), not taken for the process ending."""
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tasks = list(task_dir.iterdir())
    except (FileNotFoundError, ProcessLookupError):
        return []
    for task in tasks:
        try:
            out.extend(int(x) for x in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def runs_thread(pid: int, name: str) -> bool:
    """Whether a thread of ``pid`` has the kernel name ``name`` (``/proc/<pid>/task/*/comm``); False when gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().rstrip("\n") == name:
                return True
        except OSError:
            continue  # the thread ended meanwhile
    return False


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


def status(pid: int) -> dict[str, list[str]]:
    """``/proc/<pid>/status``, each field's words (``{"Uid": ["1000", "1000", "1000", "1000"], …}``); empty when
    unreadable (gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return {key: value.split() for key, _, value in (line.partition(":") for line in text.splitlines())}


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, its parent's, … up to PID 1; empty when it is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except psutil.Error:
        return []


def real_uid(pid: int) -> int | None:
    """``pid``'s real uid; ``None`` when it is gone."""
    try:
        return int(psutil.Process(pid).uids().real)
    except psutil.NoSuchProcess:
        return None


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
