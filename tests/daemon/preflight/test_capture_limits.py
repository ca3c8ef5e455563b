"""What CRIU can and cannot bring back, decided before anything is frozen (issue 10's findings from
CRIU's zdtm suite run through gpusnap; docs/criu-limits.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.drivers import host
from gpusnap.daemon.preflight import capture as capture_checks
from tests.conftest import WORKLOADS, DaemonProc, Workloads, wait_for
from tests.users import User


def _hold(tmp_path: Path, workloads: Workloads, kind: str, *, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    ready = tmp_path / f"{kind}.ready"
    p = workloads.spawn([*prefix, sys.executable, str(WORKLOADS / "holds.py"), kind, str(ready)], cwd="/")
    wait_for(lambda: ready.exists() or p.poll() is not None, 30, f"{kind} holder did not start")
    assert p.poll() is None, f"{kind} holder exited {p.returncode}"
    return p


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("vsock", "an AF_VSOCK socket, a protocol CRIU does not dump"),
        ("userfaultfd", "a userfaultfd descriptor"),
        ("fuse", "the character device /dev/fuse (10:229)"),
        ("sysv-shm", "a SysV shared-memory segment"),
    ],
)
def test_what_criu_cannot_dump_is_refused_before_the_freeze(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path, kind: str, words: str
) -> None:
    p = _hold(tmp_path, workloads, kind)
    res = daemon.cli("-o", "json", "dump", str(p.pid))
    assert res.returncode == 4, res.stderr
    assert words in res.stderr and f"of process {p.pid}" in res.stderr and "CRIU cannot checkpoint" in res.stderr
    assert json.loads(res.stdout)["error"]["reason"] == "CRIU_UNSUPPORTED"
    assert not (daemon.store / "logs").exists() or not list((daemon.store / "logs").iterdir()), "CRIU never ran"
    assert psutil.Process(p.pid).status() != psutil.STATUS_STOPPED


def test_unbound_and_unconnected_inet_sockets_are_dumped_and_restored(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """Issue 19 item 6: sockets absent from /proc/net (unbound TCP/UDP/UDP-Lite, a TCP socket whose
    connect() was refused) were refused as "not … TCP"; the kernel's own protocol name says they are."""
    p = _hold(tmp_path, workloads, "unconnected-sockets")
    daemon.cli("dump", str(p.pid), "--name", "uncon", check=True)
    restored = json.loads(daemon.cli("-o", "json", "restore", "uncon", check=True).stdout)
    workloads.adopt(restored["pid"])
    fds = Path(f"/proc/{restored['pid']}/fd")
    names = sorted(
        os.getxattr(fd, "system.sockprotoname").rstrip(b"\0").decode()
        for fd in fds.iterdir()
        if os.readlink(fd).startswith("socket:")
    )
    assert names == ["TCP", "TCP", "UDP-Lite", "UDPv6"], names


def test_a_traced_process_is_refused(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> None:
    p = _hold(tmp_path, workloads, "eventfd")
    tracer = subprocess.Popen(["strace", "-f", "-o", "/dev/null", "-p", str(p.pid)], stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: "TracerPid:\t0" not in Path(f"/proc/{p.pid}/status").read_text(), 10, "strace did not attach")
        res = daemon.cli("dump", str(p.pid))
        assert res.returncode == 4 and f"traced by process {tracer.pid} (strace)" in res.stderr, res.stderr
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=10)
    daemon.cli("dump", str(p.pid), "--name", "untraced", check=True)  # eventfds are fine once detached


def test_a_fork_heavy_tree_restores(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> None:
    """zdtm transition/fork: counted against what CRIU restored, not a live count after it resumed."""
    p = _hold(tmp_path, workloads, "fork-churn")
    count = tmp_path / "fork-churn.ready.count"
    wait_for(lambda: count.exists() and int(count.read_text() or 0) > 3, 10, "no churn")
    daemon.cli("dump", str(p.pid), "--name", "churn", check=True)
    frozen = int(count.read_text() or 0)
    restored = json.loads(daemon.cli("-o", "json", "restore", "churn", check=True).stdout)
    workloads.adopt(restored["pid"])
    wait_for(lambda: int(count.read_text() or 0) > frozen + 5, 10, "the restored tree does not fork on")


def test_a_pty_pair_inside_the_tree_restores(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> None:
    """zdtm pty tests: both ends in the tree, in its own session, stdio on files: CRIU restores it."""
    p = _hold(tmp_path, workloads, "pty-pair")
    daemon.cli("dump", str(p.pid), "--name", "pty", check=True)
    restored = json.loads(daemon.cli("-o", "json", "restore", "pty", check=True).stdout)
    workloads.adopt(restored["pid"])
    links = [os.readlink(f"/proc/{restored['pid']}/fd/{fd}") for fd in os.listdir(f"/proc/{restored['pid']}/fd")]
    assert any(link.startswith("/dev/pts/") for link in links) and any("ptmx" in link for link in links), links


def test_a_terminal_whose_master_is_outside_is_replaced_at_restore(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """stdout on a pty whose master stays outside (no controlling terminal: a session of its own): the dump
    leaves it behind and names it; the restore gives the tree a pty of its own, its output to --terminal."""
    master, slave = os.openpty()
    try:
        code = "import itertools,time\nfor i in itertools.count():\n    print(i, flush=True)\n    time.sleep(0.2)"
        p = workloads.spawn([sys.executable, "-c", code], stdout=slave)
        os.read(master, 100)  # it has printed
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(p.pid), "--name", "on-pty", check=True).stdout)
        snap = json.loads(daemon.cli("-o", "json", "inspect", dumped["id"], check=True).stdout)
        assert [t["fds"] for t in snap["terminals"]] == [[f"{p.pid}/1"]] and not snap["terminals"][0].get("controlling")
    finally:
        os.close(master)
        os.close(slave)
    out = tmp_path / "out"
    restored = json.loads(daemon.cli("-o", "json", "restore", "on-pty", "--terminal", str(out), check=True).stdout)
    workloads.adopt(restored["pid"])
    wait_for(lambda: out.exists() and len(out.read_text().split()) > 3, 30, "no output in the --terminal file")


def test_a_pipe_to_a_child_forked_after_the_listing_is_inside(workloads: Workloads, tmp_path: Path) -> None:
    """zdtm: a child forked after the preflight's listing is part of the tree CRIU freezes."""
    w = workloads.start("--mem-mb", "1", "--no-listener")  # parent and child share a pipe
    assert capture_checks._external_pipes([w.pid]) == [], "the child is a descendant, not an outsider"


@pytest.mark.skipif(host.has_capability(host.CAP_SYS_RESOURCE), reason="needs a root without CAP_SYS_RESOURCE")
def test_a_child_of_another_user_gets_the_capability_message(
    daemon: DaemonProc, workloads: Workloads, hostile: tuple[User, User]
) -> None:
    a, _ = hostile
    code = f"import os,time\nif os.fork() == 0:\n    os.setuid({a.uid})\n    time.sleep(600)\ntime.sleep(600)"
    p = workloads.spawn([sys.executable, "-c", code], cwd="/")
    wait_for(lambda: any(c.uids().real == a.uid for c in psutil.Process(p.pid).children()), 10, "no child of A")
    child = psutil.Process(p.pid).children()[0].pid
    res = daemon.cli("dump", str(p.pid))
    assert res.returncode == 4 and f"process {child} of the tree runs as uid {a.uid}" in res.stderr, res.stderr
    assert "rlimit" not in res.stderr


_SESSION_PROBE = """
import json, subprocess, sys
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.preflight.capture import check_sessions
out = {}
for name, own in (("inherited", False), ("own", True)):
    p = subprocess.Popen(["sleep", "60"], start_new_session=own)
    try:
        check_sessions([p.pid])
        out[name] = ""
    except FailedPreconditionError as e:
        out[name] = e.reason + ": " + str(e)
    p.kill()
print(json.dumps(out))
"""


def test_a_session_led_outside_the_pid_namespace_is_refused() -> None:
    """A process run by ``docker exec`` (CI's case) inherits a session whose leader its PID namespace cannot
    see: /proc says session 0 and CRIU refuses the dump after the freeze. Here the session leader is this test
    runner, outside a fresh PID namespace in which the check runs against its own /proc."""
    res = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", _SESSION_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["inherited"].startswith("SESSION_OUTSIDE_NAMESPACE: process "), out
    assert "setsid" in out["inherited"]
    assert out["own"] == "", out
