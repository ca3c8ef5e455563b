"""Issue 19 item 3: a caller that sends calls and never reads the answers cannot pin the daemon's memory.

Raw HTTP/2 connections (``h2_flood.py``) advertise the largest flow-control windows and open 16 calls of
``ListSnapshots`` each over 100 label-heavy snapshots (about 2 MiB a page), then never read: before, every
answer stayed queued in gpusnapd (3 such connections took it from 116 MB to 2.46 GB in the attack pass).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.store.manifest import MANIFEST_NAME
from tests.conftest import DaemonProc, Workloads, _cli_env, start_daemon, stop_daemon
from tests.users import User

HERE = Path(__file__).parent
SNAPSHOTS = 100
LABELS = {f"k{i:03d}" + "x" * 120: "v" * 256 for i in range(64)}
CONNECTIONS, STREAMS = 6, 16
GROWTH_LIMIT = 150 << 20
"""What the flood may add to the daemon's RSS: the bound (32 MiB of answers a uid, each held a few times
over by grpc until sent) plus the allocator's slack; unbounded, 2 connections of 100 calls added 1.5 GiB."""


def _snapshot_id() -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz234567"
    return "snap-" + "".join(secrets.choice(alphabet) for _ in range(26))


@pytest.fixture
def crowded(tmp_path: Path, hostile: tuple[User, User], workloads: Workloads) -> Iterator[DaemonProc]:
    """A daemon whose store holds 100 snapshots of user A, each with 64 long labels."""
    a, _ = hostile
    d = start_daemon(tmp_path / "d")
    try:
        w = workloads.start("--mem-mb", "1", "--no-listener")
        snap = json.loads(d.cli("-o", "json", "dump", str(w.pid), check=True).stdout)
    finally:
        stop_daemon(d)
    source = d.store / "snapshots" / snap["id"]
    doc = json.loads((source / MANIFEST_NAME).read_text())
    for _ in range(SNAPSHOTS):
        sid = _snapshot_id()
        target = d.store / "snapshots" / sid  # the manifest alone: listing reads nothing else
        target.mkdir()
        doc.update(id=sid, name="", owner_uid=a.uid, labels=LABELS)
        doc["source"]["uid"] = a.uid
        (target / MANIFEST_NAME).write_text(json.dumps(doc))
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_SOCKET_GROUP": a.group})
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)


def _cli_as(d: DaemonProc, user: User, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*user.argv(), *d.cli_argv, "--socket", str(d.socket), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_cli_env())


def _settled_rss(pid: int, timeout_s: float = 90) -> int:
    """The daemon's RSS once it has stopped growing for 5 s."""
    proc = psutil.Process(pid)
    last, since = proc.memory_info().rss, time.monotonic()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and time.monotonic() - since < 5:
        time.sleep(0.5)
        rss = proc.memory_info().rss
        if rss > last + (4 << 20):
            last, since = rss, time.monotonic()
    return proc.memory_info().rss


def test_answers_a_caller_never_reads_stay_bounded(crowded: DaemonProc, hostile: tuple[User, User]) -> None:
    a, b = hostile
    before = psutil.Process(crowded.proc.pid).memory_info().rss
    flood = subprocess.Popen(
        [*a.argv(), sys.executable, str(HERE / "h2_flood.py"), str(crowded.socket), str(CONNECTIONS), str(STREAMS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_cli_env(),
    )
    try:
        assert flood.stdout is not None and flood.stderr is not None
        line = flood.stdout.readline().strip()
        if line != "sent":  # the flooder ended without flooding: say why
            flood.kill()
            raise AssertionError(f"the flooder said {line!r}: {flood.stderr.read()[-2000:]}")
        grown = _settled_rss(crowded.proc.pid) - before
        print(f"daemon RSS grew by {grown >> 20} MiB")
        assert grown < GROWTH_LIMIT, f"the daemon grew by {grown >> 20} MiB"
        res = _cli_as(crowded, b, "ls")  # another user is answered meanwhile
        assert res.returncode == 0, res.stderr
    finally:
        flood.kill()
        flood.wait()
    # Once the flood's connections close, what they held is let go and the flooder's own calls work.
    assert _cli_as(crowded, a, "ls").returncode == 0
    assert os.path.exists(crowded.socket)
