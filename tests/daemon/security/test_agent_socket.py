"""Break 4: the agent socket is open to all local users; floods of idle connections or huge frames must
neither grow the daemon's threads and memory nor keep others' agents out."""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2
from gpusnap.daemon.workers.agents import MAX_AGENTS_PER_UID
from tests.conftest import DaemonProc, _cli_env, wait_for
from tests.users import User

FLOOD = Path(__file__).with_name("flood_agents.py")
STALE = Path(__file__).with_name("stale_agent.py")


def _flood(d: DaemonProc, user: User, mode: str, n: int) -> dict[str, int]:
    res = subprocess.run(
        [*user.argv(), sys.executable, str(FLOOD), str(d.agent_socket), mode, str(n)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_cli_env(),
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_idle_floods_are_bounded_per_user_and_time(daemon: DaemonProc, hostile: tuple[User, User]) -> None:
    a, b = hostile
    threads_before = psutil.Process(daemon.proc.pid).num_threads()
    proc = subprocess.Popen(
        [*a.argv(), sys.executable, str(FLOOD), str(daemon.agent_socket), "idle", "300"],
        stdout=subprocess.PIPE,
        text=True,
        env=_cli_env(),
    )
    wait_for(lambda: psutil.Process(daemon.proc.pid).num_fds() > 40 or proc.poll() is not None, 10, "no flood")
    assert psutil.Process(daemon.proc.pid).num_threads() <= threads_before + 2, "no thread per connection"
    # Another user's agent still gets in while A floods.
    hello = agent_pb2.AgentMessage(
        hello=agent_pb2.AgentHello(
            protocol_version=wire.PROTOCOL_VERSION, engine="torch", instance_id="ab" * 16, wake_dir="/tmp"
        )
    )
    script = (
        "import socket,sys; from gpusnap.adapters.contract import wire; from gpusnap.adapters.contract._proto import agent_pb2;"
        "s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]);"
        "m=agent_pb2.AgentMessage(); m.ParseFromString(bytes.fromhex(sys.argv[2])); wire.send(s, m);"
        "import time; time.sleep(3)"
    )
    subprocess.run(
        [*b.argv(), sys.executable, "-c", script, str(daemon.agent_socket), hello.SerializeToString().hex()],
        check=True,
        timeout=30,
        env=_cli_env(),
    )
    assert '"agent.attached"' in daemon.log.read_text() or "agent.attached" in daemon.log.read_text()
    out, _ = proc.communicate(timeout=60)
    stats = json.loads(out)
    assert stats["closed_early"] >= stats["connected"] - MAX_AGENTS_PER_UID, stats
    assert stats["closed_by_15s"] == stats["connected"], "connections that never say hello are closed"


def test_oversized_frames_are_refused_before_they_are_read(daemon: DaemonProc, hostile: tuple[User, User]) -> None:
    a, _ = hostile
    rss_before = psutil.Process(daemon.proc.pid).memory_info().rss
    stats = _flood(daemon, a, "huge", 20)
    assert stats["closed_early"] == stats["connected"] == 20, stats
    assert psutil.Process(daemon.proc.pid).memory_info().rss < rss_before + (32 << 20)
    assert daemon.alive()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(daemon.agent_socket))  # the listener still serves


def _process_with_pid(pid: int) -> subprocess.Popen[bytes]:
    """A root ``sleep`` given PID ``pid`` (``ns_last_pid``, as CRIU sets PIDs); skips if others keep taking it."""
    last_pid = Path("/proc/sys/kernel/ns_last_pid")
    for _ in range(50):
        last_pid.write_text(str(pid - 1))
        p = subprocess.Popen(
            ["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd="/", start_new_session=True
        )
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    pytest.skip(f"PID {pid} kept being taken by other processes")


def test_a_session_outlived_by_its_pid_is_not_the_agent_of_whoever_gets_the_pid(
    daemon: DaemonProc, hostile: tuple[User, User]
) -> None:
    """Sessions are found by PID. An agent whose process exited while a child kept the connection left a live
    session under a free PID: the next process given that PID (root's here) had the hostile user's "agent",
    which the daemon sent its warm-up to and whose answer it trusted (it could fail the capture, announce
    buffers and get buffer-store descriptors). A session is now bound to its process's start time."""
    a, _ = hostile
    res = subprocess.run(
        [*a.argv(), sys.executable, str(STALE), str(daemon.agent_socket)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_cli_env(),
        check=True,
    )
    stale_pid = int(res.stdout)
    wait_for(lambda: not psutil.pid_exists(stale_pid), 10, "the agent's process did not exit")
    victim = _process_with_pid(stale_pid)
    try:
        out = daemon.cli("-o", "json", "dump", str(victim.pid), "--leave-running")
        assert "hijacked" not in out.stdout + out.stderr, out.stdout
        assert out.returncode == 0, out.stderr
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_refusals_are_logged_a_few_times_per_user_and_minute(daemon: DaemonProc, hostile: tuple[User, User]) -> None:
    """Issue 19 item 4: a user outside the group wrote 27,440 ``agent.refused`` warnings (4.3 MB) in 5 s.
    Now a few per uid and minute are logged, then one that counts what was left out."""
    a, b = hostile
    before = daemon.log.read_text().count("agent.refused")
    _flood(daemon, a, "junk", 500)
    _flood(daemon, b, "junk", 20)
    lines = [ln for ln in daemon.log.read_text().splitlines() if "agent.refused" in ln][before:]
    by_uid = collections.Counter(json.loads(ln)["uid"] for ln in lines)
    assert by_uid[a.uid] <= 5 and by_uid[b.uid] <= 5, by_uid
    assert by_uid[b.uid] >= 1, "another user's refusals are still logged"
