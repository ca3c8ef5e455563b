"""Hostile input (issue 10, item 6): per-owner names, process names that are rich markup or escape
codes, out-of-range Durations and enums, huge names, CUDA errors mapped to their gRPC codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from google.protobuf import duration_pb2

from gpusnap.daemon._proto import operations_pb2, operations_pb2_grpc
from gpusnap.daemon.api.errors import Code
from gpusnap.daemon.drivers.cuda import CudaError, CudaResult
from tests.conftest import DaemonProc, Workloads, start_daemon, stop_daemon, wait_for
from tests.reown import reown
from tests.users import User

HOSTILE_COMM = "[/]\x1b[2J"  # rich markup that crashed `gpusnap ls`, then "clear screen" (15 bytes max)


def _named_sleeper(comm: str) -> subprocess.Popen[bytes]:
    code = (
        "import ctypes,time,sys; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0);"
        "open(sys.argv[2], 'w').close(); time.sleep(600)"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, comm, "/dev/null"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def test_hostile_process_names_are_shown_escaped(daemon: DaemonProc, workloads: Workloads) -> None:
    p = _named_sleeper(HOSTILE_COMM)
    workloads.adopt(p.pid)
    wait_for(lambda: Path(f"/proc/{p.pid}/comm").read_text().startswith("[/]"), 10, "name not set")
    daemon.cli("dump", str(p.pid), "--name", "odd", check=True)
    for args in (["ls"], ["inspect", "odd"]):
        res = daemon.cli(*args, env={"COLUMNS": "200"})  # wide: the escaped name is not folded across lines
        assert res.returncode == 0, res.stderr
        assert "[/]" in res.stdout and "\x1b" not in res.stdout, repr(res.stdout)
        assert "\\x1b[2J" in res.stdout


def _stub(d: DaemonProc) -> tuple[grpc.Channel, operations_pb2_grpc.OperationServiceStub]:
    ch = grpc.insecure_channel(f"unix:{d.socket}")
    return ch, operations_pb2_grpc.OperationServiceStub(ch)


@pytest.mark.parametrize(
    "request_fields",
    [
        {"timeout": duration_pb2.Duration(seconds=2**62)},
        {"timeout": duration_pb2.Duration(seconds=1, nanos=-5)},
        {"timeout": duration_pb2.Duration(seconds=0, nanos=2_000_000_000)},
        {"gpu_lock_timeout": duration_pb2.Duration(seconds=-3)},
        {"tcp": 99},
        {"name": "x" * 1_000_000},
    ],
)
def test_invalid_requests_are_invalid_argument(
    daemon: DaemonProc, workloads: Workloads, request_fields: dict[str, object]
) -> None:
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    ch, stub = _stub(daemon)
    with ch, pytest.raises(grpc.RpcError) as info:
        stub.Checkpoint(operations_pb2.CheckpointRequest(pid=w.pid, **request_fields), timeout=30)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert len(info.value.details() or "") < 400, "huge input is not echoed back"
    assert w.proc is not None and w.proc.poll() is None
    assert daemon.alive()


def test_a_label_selector_no_label_set_could_match_is_refused(daemon: DaemonProc) -> None:
    """Issue 26, item 9: a 10,000-pair label selector was accepted (and matched against every snapshot)."""
    from gpusnap.daemon.api.errors import InvalidArgumentError

    client = daemon.client()
    with pytest.raises(InvalidArgumentError) as err:
        client.list_snapshots({f"k{i}": "v" for i in range(10_000)})
    assert err.value.reason == "INVALID_LABEL" and "at most 64" in err.value.message
    assert client.list_snapshots({"gpusnap.dev/tcp": "established", "team": "search"}) == []


def test_cuda_errors_carry_the_code_a_client_can_act_on() -> None:
    assert CudaError("cuCheckpointProcessLock", 1, CudaResult.CUDA_ERROR_TIMEOUT).code is Code.DEADLINE_EXCEEDED
    assert CudaError("cuCheckpointProcessLock", 1, CudaResult.CUDA_ERROR_ILLEGAL_STATE).code is Code.FAILED_PRECONDITION
    assert (
        CudaError("cuCheckpointProcessCheckpoint", 1, CudaResult.CUDA_ERROR_OUT_OF_MEMORY).code
        is Code.RESOURCE_EXHAUSTED
    )
    assert CudaError("cuCheckpointProcessLock", 1, CudaResult.CUDA_ERROR_NOT_SUPPORTED).code is Code.FAILED_PRECONDITION
    assert CudaError("cuCheckpointProcessLock", 1, CudaResult.CUDA_ERROR_INVALID_VALUE).code is Code.INTERNAL


def test_names_are_per_owner(tmp_path: Path, hostile: tuple[User, User], workloads: Workloads) -> None:
    """A user who takes `prod-worker` does not get root's `restore prod-worker` to start their tree."""
    a, _ = hostile
    d = start_daemon(tmp_path / "d")
    try:
        w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        theirs = json.loads(d.cli("-o", "json", "dump", str(w.pid), "--name", "prod-worker", check=True).stdout)
    finally:
        stop_daemon(d)
    reown(d.store / "snapshots" / theirs["id"], a)  # as if user A had dumped it (tests/reown.py)
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_SOCKET_GROUP": a.group})
    try:
        res = d.cli("restore", "prod-worker")
        assert res.returncode == 3 and "no snapshot 'prod-worker'" in res.stderr, res.stderr
        assert (
            json.loads(d.cli("-o", "json", "inspect", f"{a.uid}/prod-worker", check=True).stdout)["id"] == theirs["id"]
        )
        w2 = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        mine = json.loads(d.cli("-o", "json", "dump", str(w2.pid), "--name", "prod-worker", check=True).stdout)
        assert mine["id"] != theirs["id"], "root has its own prod-worker now"
        assert json.loads(d.cli("-o", "json", "inspect", "prod-worker", check=True).stdout)["id"] == mine["id"]
        res = subprocess.run(
            [*a.argv(), *d.cli_argv, "--socket", str(d.socket), "-o", "json", "inspect", "prod-worker"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0 and json.loads(res.stdout)["id"] == theirs["id"], res.stderr
    finally:
        stop_daemon(d)


def test_failed_criu_operations_leave_no_descriptors_behind(daemon: DaemonProc, workloads: Workloads) -> None:
    """A restore CRIU refuses (the source still holds its PIDs, --host-pidns) keeps no helper pipe open."""
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    daemon.cli("dump", str(w.pid), "--name", "busy", "--leave-running", check=True)
    daemon_proc = psutil.Process(daemon.proc.pid)

    def fail_once() -> None:
        res = daemon.cli("restore", "busy", "--host-pidns")
        assert res.returncode != 0 and "CRIU" in res.stderr, res.stderr
        assert "restore without --host-pidns" in res.stderr, res.stderr  # CRIU's cr_errno EEXIST, named

    def idle_fds() -> int:  # the spare CRIU helper is refilled in the background: wait for the count to settle
        last = -1
        for _ in range(50):
            n = daemon_proc.num_fds()
            if n == last:
                return n
            last = n
            time.sleep(0.2)
        return last

    fail_once()  # warm-up: the first call opens the daemon's lasting descriptors (logs, channels)
    before = idle_fds()
    for _ in range(3):
        fail_once()
    wait_for(lambda: daemon_proc.num_fds() <= before, 10, "each failed CRIU request leaked descriptors")
