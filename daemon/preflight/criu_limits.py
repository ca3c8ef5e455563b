"""What CRIU cannot checkpoint, found in a tree before anything is frozen (docs/criu-limits.md).

The list follows CRIU's own dump code (``criu/files.c`` ``dump_one_file`` and ``dump_chrdev``,
``criu/sockets.c`` ``dump_socket``, ``criu/cr-dump.c`` ``check_sysvipc_map_dump``, ``criu/seize.c``):
CRIU fails a whole dump on the first object it has no dumper for, with a log line such as "Can't dump
file 7 of that type [60000] (chr 10:229)". Here each such object is named with its process, its fd and
the remedy instead:

- an anonymous-inode fd other than eventfd, epoll, inotify, fanotify, signalfd, timerfd, pidfd and
  bpf maps (io_uring, perf events, userfaultfd, KVM, DMA-BUF, …);
- a character device other than the memory devices (``/dev/null``, ``/dev/zero``, …, major 1), a
  terminal, ``/dev/net/tun`` and autofs (the NVIDIA devices are released by the CUDA checkpoint first);
- a socket that is not unix, TCP, UDP, UDP-Lite, raw IP, ping, packet or netlink (AF_ALG, AF_VSOCK,
  SCTP, MPTCP, …), by the protocol name the kernel gives it (bound or not, connected or not);
- a SysV shared-memory mapping in the host's IPC namespace (CRIU dumps SysV segments only with their
  IPC namespace);
- a process traced by a process outside the tree (CRIU must ptrace-seize every task itself).
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from collections.abc import Sequence
from pathlib import Path

SUPPORTED_ANON = frozenset(
    {"[eventfd]", "[eventpoll]", "inotify", "[fanotify]", "[signalfd]", "[timerfd]", "[pidfd]", "bpf-map"}
)
"""``anon_inode:<type>`` link types CRIU dumps (criu/files.c ``dump_one_file``)."""
MEM_MAJOR = 1
MISC_MAJOR = 10
SUPPORTED_MISC_MINORS = frozenset({200, 235})
"""``/dev/net/tun`` (TUN_MINOR) and autofs (AUTOFS_MINOR), the misc devices CRIU dumps."""
TTY_MAJORS = frozenset({4, 5, 136, 137, 138, 139, 140, 141, 142, 143})
"""Virtual consoles/serial (4), /dev/tty, /dev/console, /dev/ptmx (5), pty slaves (136-143): CRIU's ``is_tty``."""
GPU_DEVICE_PREFIX = "/dev/nvidia"
"""Released by the CUDA checkpoint before CRIU runs (checked again after it by the GPU phases)."""
DUMPED_PROTOCOLS = frozenset(
    {
        "UNIX",  # datagram and seqpacket
        "UNIX-STREAM",
        "TCP",
        "TCPv6",
        "UDP",
        "UDPv6",
        "UDP-Lite",
        "UDPLITEv6",
        "RAW",
        "RAWv6",
        "PING",
        "PINGv6",
        "PACKET",
        "NETLINK",
    }
)
"""Protocol names (the kernel's ``struct proto`` ``name``, read as the ``system.sockprotoname`` attribute of
a socket's /proc fd link, socket(7)) of the sockets CRIU dumps: unix, inet (TCP, UDP, UDP-Lite, raw,
ICMP "ping"), packet and netlink (criu/sockets.c ``dump_socket``, criu/sk-inet.c ``can_dump_ipproto``),
bound or not, connected or not (criu/sk-inet.c ``gen_uncon_sk``)."""
PROTOCOL_REMEDIES = {"MPTCP": "close it before the checkpoint (Go programs: GODEBUG=multipathtcp=0 turns MPTCP off)"}
_SOCKET = re.compile(r"^socket:\[(\d+)\]$")


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """One object CRIU cannot checkpoint: who holds it, what it is, and what to do."""

    pid: int
    where: str
    """``fd 7``, ``mapping 7f00…``, or ``tracing``."""
    what: str
    remedy: str

    def __str__(self) -> str:
        return f"{self.where} of process {self.pid} ({_comm(self.pid)}) is {self.what}, which CRIU cannot checkpoint; {self.remedy}"


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _protocol(pid: int, fd: str) -> str | None:
    """The kernel's protocol name of socket ``fd`` of ``pid`` (``TCP``, ``UNIX-STREAM``, …); ``None`` if unread."""
    try:
        return os.getxattr(f"/proc/{pid}/fd/{fd}", "system.sockprotoname").rstrip(b"\0").decode()
    except OSError:
        return None


def _fd_problem(pid: int, fd: str, link: str) -> tuple[str, str] | None:
    """``(what, remedy)`` when CRIU cannot dump fd ``fd`` (``link`` its /proc link)."""
    if link.startswith("anon_inode:"):
        kind = link.removeprefix("anon_inode:")
        if kind not in SUPPORTED_ANON:
            return f"a {kind.strip('[]')} descriptor", "close it before the checkpoint (CRIU has no dumper for it)"
        return None
    if _SOCKET.match(link):
        protocol = _protocol(pid, fd)
        if protocol is not None and protocol not in DUMPED_PROTOCOLS:  # unread: gone, or CRIU's to judge
            return (
                f"{'an' if protocol[:1] in 'AEIOU' else 'a'} {protocol} socket, a protocol CRIU does not dump (it dumps unix, TCP, UDP, UDP-Lite, raw, "
                "ping, packet and netlink sockets)",
                PROTOCOL_REMEDIES.get(protocol, "close it before the checkpoint"),
            )
        return None
    if link.startswith(GPU_DEVICE_PREFIX):
        return None
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    if stat.S_ISCHR(st.st_mode):
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if major == MEM_MAJOR or major in TTY_MAJORS or (major == MISC_MAJOR and minor in SUPPORTED_MISC_MINORS):
            return None
        return f"the character device {link} ({major}:{minor})", "close it before the checkpoint"
    return None


def _tracer(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _in_host_ipc_ns(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/ipc").st_ino == os.stat("/proc/self/ns/ipc").st_ino
    except OSError:
        return True


def find(pids: Sequence[int]) -> list[Unsupported]:
    """Everything of the tree ``pids`` that CRIU would refuse (see the module docstring)."""
    tree = set(pids)
    out: list[Unsupported] = []
    for pid in pids:
        tracer = _tracer(pid)
        if tracer and tracer not in tree:
            out.append(
                Unsupported(
                    pid,
                    "tracing",
                    f"traced by process {tracer} ({_comm(tracer)}), outside the tree",
                    "detach the debugger or tracer (strace, gdb) first",
                )
            )
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        links: list[tuple[str, str]] = []
        for fd in sorted(fds, key=int):
            try:
                links.append((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
            except OSError:
                continue
        for fd, link in links:
            found = _fd_problem(pid, fd, link)
            if found is not None:
                out.append(Unsupported(pid, f"fd {fd}", *found))
        if _in_host_ipc_ns(pid):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:
                maps = []
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/SYSV"):
                    out.append(
                        Unsupported(
                            pid,
                            f"mapping {fields[0].split('-')[0]}",
                            "a SysV shared-memory segment",
                            "use POSIX shared memory (/dev/shm, shm_open) instead: CRIU restores SysV "
                            "segments only together with their IPC namespace",
                        )
                    )
                    break
    return out
