"""Issue 26, item 4: gpusnapd SIGKILLed inside the dump of a large worker and restarted at once.

The dump's CRIU (in the helper's session: it does not die with gpusnapd) goes on, the source frozen and
ptraced, its parasite in the task, until its ``post-dump`` notification, where it finds no daemon and resumes
the source. Before, the restarted daemon reported the source running ("nothing of the source needed
undoing") and deleted the staging directory at once, while that CRIU still dumped into it. Now the recovered
checkpoint runs on, holding the tree, until that CRIU is gone (``gpusnap.daemon.operations.leftover_criu``).

The old CRIU is paused (SIGSTOP) from the kill until 1 s after the restarted daemon answers, as a slower
disk would make it: on this 2-core host a 1 GiB dump can end before a daemon has restarted. Each run asserts,
polling every 20 ms from the restart on: while the old CRIU lives, the operation is not finished and its
staging directory (and every image CRIU holds open) exists; once the operation is finished, CRIU is gone, the
source is neither traced nor stopped and holds no parasite mapping; the source moves on within 5 s of that.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.client.values import OperationState
from tests.conftest import Workloads, start_daemon, stop_daemon, wait_for

MOVES_WITHIN_S = 5.0
"""The source moves on within this of the operation's end (docs/reliability.md)."""


def _serving_criu(daemon_pid: int, timeout_s: float = 30) -> psutil.Process:
    """The ``criu swrk`` under the daemon that serves a request (it has its log open)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in psutil.Process(daemon_pid).children(recursive=True):
            try:
                if "swrk" in " ".join(p.cmdline()) and any(f.path.endswith("dump.log") for f in p.open_files()):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.002)
    raise AssertionError("CRIU was never seen dumping")


def _status(pid: int) -> dict[str, str]:
    fields = (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {k: v.strip() for k, _, v in fields}


def _deleted_images(criu: psutil.Process) -> list[str]:
    """Files CRIU holds open that are deleted (an image written into a removed staging directory); none once it
    has exited (it may between the caller's look and this one)."""
    out = []
    try:
        fds = os.listdir(f"/proc/{criu.pid}/fd")
    except FileNotFoundError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{criu.pid}/fd/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and "/staging/" in target:
            out.append(target)
    return out


@pytest.mark.parametrize("delay_s", [0.0, 0.4, 1.2])
def test_a_daemon_killed_mid_dump_waits_for_its_criu_before_reporting_the_source(
    tmp_path: Path, workloads: Workloads, delay_s: float
) -> None:
    w = workloads.start("--mem-mb", "1024", "--no-child", "--no-listener")
    d = start_daemon(tmp_path)
    d2 = None
    criu: psutil.Process | None = None
    try:
        op = d.client().checkpoint(w.pid, name="big", leave_running=True)
        criu = _serving_criu(d.proc.pid)
        time.sleep(delay_s)
        d.proc.kill()
        criu.suspend()
        d.proc.wait()
        assert criu.status() != psutil.STATUS_ZOMBIE, f"the dump ended within {delay_s} s"
        killed_at = time.monotonic()
        d2 = start_daemon(tmp_path)
        assert d2.alive(), d2.log.read_text()
        answered_at = time.monotonic()
        client = d2.client()
        staging = d2.store / "staging"
        while True:
            if criu.is_running() and criu.status() == psutil.STATUS_STOPPED and time.monotonic() > answered_at + 1:
                criu.resume()
            criu_alive = criu.is_running() and criu.status() != psutil.STATUS_ZOMBIE
            record = client.get_operation(op.id)
            done = record.state in (OperationState.SUCCEEDED, OperationState.FAILED)
            if criu_alive:
                assert not done, f"the operation ended while the old CRIU still ran: {record.error}"
                assert list(staging.iterdir()), "the staging directory was removed while CRIU wrote into it"
                assert _deleted_images(criu) == [], "CRIU writes into a deleted staging directory"
            if done:
                assert not criu_alive
                ended_at = time.monotonic()
                break
            time.sleep(0.02)
        status = _status(w.pid)
        assert status["TracerPid"] == "0" and status["State"][0] not in "tT", status
        assert "CRIUMFD" not in Path(f"/proc/{w.pid}/maps").read_text(), "CRIU's parasite is left in the source"
        before = w.last("parent.log")
        wait_for(lambda: w.last("parent.log") > before + 2, MOVES_WITHIN_S, "the source does not move on")
        assert record.state is OperationState.FAILED and record.error is not None, record
        assert record.error.reason == "DAEMON_RESTARTED", record.error
        assert "keeps running" in record.error.message and "CRIU ended" in record.error.message, record.error
        assert list(staging.iterdir()) == [] and json.loads(d2.cli("-o", "json", "ls", check=True).stdout) == []
        print(
            f"killed {delay_s} s into the dump: restarted daemon answered after {answered_at - killed_at:.2f} s, "
            f"CRIU (paused until 1 s after that) gone and the operation ended {ended_at - answered_at:.2f} s after it "
            "answered"
        )
    finally:
        if criu is not None and criu.is_running():  # a failed assertion must not leave it paused
            criu.resume()
        if d2 is not None:
            stop_daemon(d2)
        stop_daemon(d)
