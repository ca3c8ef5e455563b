"""CancelOperation and Ctrl-C in the CLI: the operation rolls back and ends CANCELLED; idempotency keys."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.api.errors import CancelledError, Code, FailedPreconditionError, InvalidArgumentError
from gpusnap.daemon.client import DaemonClient
from gpusnap.daemon.client.values import Operation, OperationState
from tests.conftest import DaemonProc, Workloads, _cli_env, wait_for
from tests.pty_shell import Shell


def _waiting(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> tuple[int, Path]:
    cdir = tmp_path / "ctl"
    cdir.mkdir()
    return workloads.start("--mem-mb", "1", "--no-listener", "--no-child").pid, cdir


def test_cancel_rolls_back_a_waiting_checkpoint(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> None:
    pid, cdir = _waiting(daemon, workloads, tmp_path)
    client = daemon.client()
    op = client.checkpoint(pid, control_dir=str(cdir), name="never")
    wait_for(lambda: client.get_operation(op.id).phase == "wait-ready", 30, "not waiting")
    res = daemon.cli("cancel", op.id)
    assert res.returncode == 0 and "cancelled" in res.stdout, res.stderr
    with pytest.raises(CancelledError):
        client.wait(op.id)
    assert getattr(client.get_operation(op.id).error, "code", None) == Code.CANCELLED
    assert client.list_snapshots() == [] and psutil.Process(pid).status() != psutil.STATUS_STOPPED
    again = daemon.cli("cancel", op.id)  # cancelling again is harmless and says the same
    assert again.returncode == 0 and "cancelled" in again.stdout, again.stderr


def test_ctrl_c_cancels(daemon: DaemonProc, workloads: Workloads, tmp_path: Path) -> None:
    pid, cdir = _waiting(daemon, workloads, tmp_path)
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpusnap.daemon.cli",
            "--socket",
            str(daemon.socket),
            "dump",
            str(pid),
            "--control-dir",
            str(cdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_cli_env(),
        # Ctrl-C as at a terminal, even where this suite runs as a background job (SIGINT ignored, inherited)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    running = OperationState.RUNNING  # an earlier test's cancelled op also ended in wait-ready
    wait_for(
        lambda: any(o.phase == "wait-ready" and o.state is running for o in daemon.client().list_operations()),
        30,
        "not waiting",
    )
    cli.send_signal(signal.SIGINT)
    _, err = cli.communicate(timeout=60)
    assert cli.returncode == 130 and "interrupted: stopping wait-ready now" in err, err
    assert "cancelled during wait-ready, which stopped" in err, err
    [op] = daemon.client().list_operations()
    assert op.state is OperationState.CANCELLED and op.error is not None and op.error.code == Code.CANCELLED
    listed = json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)
    assert listed[0]["state"] == "cancelled" and listed[0]["error"]["code"] == "CANCELLED", listed[0]


def test_idempotency_key(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    client = daemon.client()
    first = client.checkpoint(w.pid, request_id="job-42")
    snap = client.wait(first.id).snapshot
    time.sleep(0.2)
    again = client.checkpoint(w.pid, request_id="job-42")  # the source is gone: only the key answers
    assert again.id == first.id and client.wait(again.id).snapshot.id == snap.id
    assert len(client.list_snapshots()) == 1
    with pytest.raises(InvalidArgumentError) as err:
        client.checkpoint(w.pid, request_id="bad key/../" + "x" * 300)
    assert err.value.reason == "INVALID_REQUEST_ID" and "x" * 50 not in err.value.message
    assert json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)[0]["id"] == first.id
    w2 = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    for start in (client.suspend, client.resume):  # no GPU here: each fails, and its key still answers
        op = start(w2.pid, request_id=f"{start.__name__}-7")
        with pytest.raises(FailedPreconditionError):
            client.wait(op.id)
        assert start(w2.pid, request_id=f"{start.__name__}-7").id == op.id
        other = start(w2.pid, request_id=f"{start.__name__}-8")
        assert other.id != op.id, "another key is another request"
        with pytest.raises(FailedPreconditionError):
            client.wait(other.id)


def _running_phase(client: DaemonClient, phase: str) -> Operation | None:
    return next((o for o in client.list_operations() if o.phase == phase and o.state is OperationState.RUNNING), None)


def test_ctrl_c_during_a_dump_and_cancel_during_a_restore_say_what_happens(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """Ctrl-C while CRIU writes the images, typed in a terminal: the CLI says at once that the dump cannot be stopped
    safely and what happens when it ends; it then ends exit 130, the source running on and nothing published, and
    says that, not "cancelled before dump ended". `gpusnap cancel` during CRIU's restore stops it at once."""
    w = workloads.start("--mem-mb", "1536", "--random", "--no-listener", "--no-child")
    client = daemon.client()
    daemon.cli("dump", str(w.pid), "--name", "kept", "--leave-running", check=True)
    sh = Shell(tmp_path, {**_cli_env(), "GPUSNAP_SOCKET": str(daemon.socket)})
    try:
        sh.start(f"{sys.executable} -m gpusnap.daemon.cli dump {w.pid} --name never")
        wait_for(lambda: _running_phase(client, "dump"), 120, "the dump did not start")
        shown = sh.interrupt(timeout=120)
        assert sh.run("echo $?").strip() == "130", shown
    finally:
        sh.close()
    said = (
        "interrupted: CRIU is writing the frozen tree's images and cannot be stopped safely before it has; the "
        "checkpoint stops when dump ends and rolls back: then the source is resumed, before anything is published, "
        "and the images are dropped (Ctrl-C again to stop waiting)"
    )
    assert said in shown, shown
    assert (
        "cancelled during dump, which CRIU could not stop safely before it had written the images: the source was "
        "resumed then, before anything was published" in shown
    ), shown
    assert "before dump ended" not in shown
    [op] = [o for o in client.list_operations() if o.state is OperationState.CANCELLED]
    events = list(client.watch(op.id))
    kinds = [(e.type.value, e.phase) for e in events]
    asked = kinds.index(("cancel_requested", "dump"))
    assert asked < kinds.index(("phase_finished", "dump")), "said while CRIU still wrote the images"
    assert not any(p in ("checksum", "publish", "finish") for _, p in kinds), "nothing was published"
    assert [s.name for s in client.list_snapshots()] == ["kept"]
    assert psutil.Process(w.pid).status() not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

    handle = client.restore("kept")
    wait_for(lambda: client.get_operation(handle.id).phase == "restore", 60, "the restore did not start")
    res = daemon.cli("cancel", handle.id)
    assert res.returncode == 0, res.stderr
    assert f"cancelling {handle.id}: stopping restore now; then the restore rolls back what it did" in res.stderr
    assert (
        f"{handle.id} cancelled: operation {handle.id} was cancelled during restore, which stopped: CRIU was "
        "killed" in res.stdout
    ), res.stdout
    restored = [p for p in psutil.process_iter(["cmdline"]) if f"operation={handle.id}" in (p.info["cmdline"] or [])]
    assert not restored, "nothing of the restored tree is left"
