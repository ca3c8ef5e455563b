"""The fault matrix: every phase boundary of capture and restore x {gpusnapd SIGKILL, CRIU SIGKILL, ENOSPC}.

Real gpusnapd, real CRIU, real process trees. Faults come from the daemon's failpoint
(``GPUSNAP_FAILPOINT=<kind>:<phase>:kill|enospc``, gpusnap.daemon.operations.failpoints) or, for CRIU, from
killing ``criu swrk`` mid-run. After a daemon SIGKILL the daemon is started again on the same store and
recovers from its journal. Every cell asserts the same three things:

- nothing half-written is listed (every listed snapshot's images match its manifest; staging is empty);
- the source is never left stopped, or killed before its snapshot is durable;
- no restored tree is left untracked (every running copy of the workload is a tree the daemon reports);

plus: the operation is known after the restart (from the journal) and a retry of its idempotency key gets
the same operation. GPU phases (gpu-lock … gpu-unlock) are covered with the fake CUDA driver in
tests/daemon/operations/test_recovery_gpu.py; agent hang and death in each worker phase (quiesce, offload,
reload, resume, and every other capture and restore phase through the ``hold`` failpoint) in
tests/adapters/test_agent_faults.py, and a daemon killed after offload in
tests/adapters/test_buffers_cpu.py. Set-up is shared where honest: restore cells
restore copies (hard links) of one snapshot made once per module.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from gpusnap.daemon.api.errors import GpusnapError, UnavailableError
from gpusnap.daemon.client import DaemonClient, OperationHandle
from gpusnap.daemon.client import calls as client_module
from gpusnap.daemon.client.values import Operation, OperationState
from gpusnap.daemon.store import checksum, manifest
from tests.adapters.test_agent_roundtrip import Toy
from tests.conftest import DaemonProc, Workload, Workloads, criu_killed, kill_tree, start_daemon, stop_daemon, wait_for
from tests.lanes import LANES

CAPTURE = ["preflight", "dump", "checksum", "publish", "finish"]
RESTORE = ["preflight", "verify", "restore", "criu-started", "pre-resume", "validate"]
"""Phases, and two points inside ``restore``: CRIU told to start (helper and namespace init journaled), and
CRIU's pre-resume (every task restored, none yet running)."""
FAILED, SUCCEEDED = OperationState.FAILED, OperationState.SUCCEEDED


def _faulty_daemon(tmp: Path, spec: str) -> DaemonProc:
    d = start_daemon(tmp, extra_env={"GPUSNAP_FAILPOINT": spec} if spec else None)
    assert d.alive(), d.log.read_text()
    return d


def _nothing_half_written(d: DaemonProc) -> list[str]:
    """Every listed snapshot is complete; staging and staged buffers are empty. Returns the listed ids."""
    listed = [s.id for s in d.client().list_snapshots()]
    for snap_id in listed:
        snap = manifest.read(d.store / "snapshots" / snap_id)
        assert checksum.mismatches(d.store / "snapshots" / snap_id / "images", snap.files, LANES.digest) == [], snap_id
    assert list((d.store / "staging").iterdir()) == [], "staging left behind"
    assert list((d.store / "buffers" / "incoming").iterdir()) == [], "staged buffers left behind"
    return listed


def _source_ok(w: Workload, durable: bool) -> None:
    """Alive and running unless its snapshot is durable (then it may have been stopped by design)."""
    try:
        status = psutil.Process(w.pid).status()
    except psutil.NoSuchProcess:
        assert durable, "the source was killed before its snapshot was durable"
        return
    if status == psutil.STATUS_ZOMBIE:
        assert durable, "the source was killed before its snapshot was durable"
        return
    assert status not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP), "the source was left stopped"
    before = w.last("parent.log")
    wait_for(lambda: w.last("parent.log") > before + 2, 20, "the source does not run")


def _copies(workdir: Path) -> set[int]:
    """PIDs of every running process of a tree.py workload of ``workdir`` (source or restored copies)."""
    out = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if str(workdir) in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.fixture(autouse=True)
def _short_start_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client retries a start while the daemon is unreachable; here the daemon stays dead until restarted."""
    monkeypatch.setattr(client_module, "START_RETRY_S", 0.5)


def _start(d: DaemonProc, start: Callable[[DaemonClient], OperationHandle]) -> str:
    """Start the operation; "" when gpusnapd died before it answered."""
    try:
        return start(d.client()).id
    except UnavailableError:
        return ""


def _after_crash(
    d: DaemonProc, tmp: Path, op_id: str, retry: Callable[[DaemonClient], OperationHandle]
) -> tuple[DaemonProc, Operation]:
    """Wait for the SIGKILLed daemon to be gone and start it again on the same store; a retry with the same
    idempotency key must get the original operation, finished by recovery."""
    assert d.proc.wait(timeout=60) == -9, "the failpoint did not kill gpusnapd"
    for c in d.clients:
        c.close()
    d2 = start_daemon(tmp, socket_dir=d.socket.parent)  # same sockets: workers' agents find it again
    assert d2.alive(), d2.log.read_text()
    again = retry(d2.client())
    assert not op_id or again.id == op_id, "a retry gets the original operation"
    try:
        d2.client().wait(again.id, timeout_s=60)
    except GpusnapError:
        pass
    op = d2.client().get_operation(again.id)
    assert op.state in (FAILED, SUCCEEDED), "a recovered operation is finished"
    return d2, op


def _cell(
    d: DaemonProc,
    tmp: Path,
    fault: str,
    start: Callable[[DaemonClient], OperationHandle],
) -> tuple[DaemonProc, Operation]:
    """Start the operation under the daemon's failpoint; the daemon serving afterwards and the finished operation."""
    op_id = _start(d, start)
    if fault == "kill":
        return _after_crash(d, tmp, op_id, start)
    with pytest.raises(GpusnapError) as err:
        d.client().wait(op_id)
    assert err.value.reason == "STORE_FULL", err.value.message
    return d, d.client().get_operation(op_id)


@pytest.mark.parametrize("fault", ["kill", "enospc"])
@pytest.mark.parametrize("phase", CAPTURE)
def test_capture_cell(tmp_path: Path, workloads: Workloads, phase: str, fault: str) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener")
    d = _faulty_daemon(tmp_path, f"checkpoint:{phase}:{fault}")
    key = str(uuid.uuid4())

    def start(c: DaemonClient) -> OperationHandle:
        return c.checkpoint(w.pid, name="cell", request_id=key)

    try:
        d, done = _cell(d, tmp_path, fault, start)
        listed = _nothing_half_written(d)
        durable = done.state == SUCCEEDED
        assert listed == ([done.snapshot.id] if durable else []), "listed iff the operation succeeded"
        _source_ok(w, durable)
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """A store holding one snapshot of a workload whose source is gone; (store, workdir)."""
    tmp = tmp_path_factory.mktemp("template")
    ws = Workloads(tmp)
    d = start_daemon(tmp)
    try:
        w = ws.start("--mem-mb", "8", "--no-listener")
        d.client().wait(d.client().checkpoint(w.pid, name="base").id)
    finally:
        stop_daemon(d)
        ws.cleanup()
    yield d.store, w.workdir


GONE_AT_RECOVERY = ("was killed", "no restored process was found")
"""What recovery says of a tree CRIU had restored when gpusnapd died at pre-resume: it killed what was left, or the
helper had killed all of it first (whichever came first; the tree never ran either way)."""


def _store_copy(template: Path, tmp: Path) -> None:
    shutil.copytree(template, tmp / "store", copy_function=os.link, ignore=shutil.ignore_patterns(".lock", "journal"))


@pytest.mark.parametrize("fault", ["kill", "enospc"])
@pytest.mark.parametrize("phase", RESTORE)
def test_restore_cell(tmp_path: Path, template: tuple[Path, Path], phase: str, fault: str) -> None:
    store, workdir = template
    _store_copy(store, tmp_path)
    d = _faulty_daemon(tmp_path, f"restore:{phase}:{fault}")
    key = str(uuid.uuid4())
    tracked: set[int] = set()

    def start(c: DaemonClient) -> OperationHandle:
        return c.restore("base", request_id=key)

    try:
        d, done = _cell(d, tmp_path, fault, start)
        assert _nothing_half_written(d) == [s.id for s in d.client().list_snapshots()] != [], "the snapshot is kept"
        if done.state == SUCCEEDED:
            tracked = set(done.restore.pids)
            assert tracked and all(psutil.pid_exists(p) for p in tracked), "an adopted tree runs"
        elif fault == "kill" and phase == "pre-resume":  # CRIU had restored it, stopped: its helper, whose gpusnapd
            # never answered, kills it before CRIU resumes it, and recovery kills what it still finds
            assert any(said in str(done.error) for said in GONE_AT_RECOVERY), done.error
        time.sleep(0.5)
        assert _copies(workdir) <= tracked, "a restored tree runs untracked"
    finally:
        kill_tree(*tracked)
        stop_daemon(d)


def test_daemon_killed_inside_host_pidns_restore(tmp_path: Path, template: tuple[Path, Path]) -> None:
    """A restore into gpusnapd's own PID namespace has no namespace init to take the tree along: the helper,
    whose gpusnapd died while CRIU held the restored tasks at pre-resume, kills CRIU's children itself before CRIU
    resumes them, and recovery kills what it still finds by the journaled helper (with their old PIDs)."""
    store, workdir = template
    _store_copy(store, tmp_path)
    d = _faulty_daemon(tmp_path, "restore:pre-resume:kill")
    key = str(uuid.uuid4())

    def start(c: DaemonClient) -> OperationHandle:
        return c.restore("base", host_pid_namespace=True, request_id=key)

    try:
        d, done = _after_crash(d, tmp_path, _start(d, start), start)
        assert done.state == FAILED and any(said in str(done.error) for said in GONE_AT_RECOVERY), done.error
        wait_for(lambda: not _copies(workdir), 15, "a restored tree runs untracked")
        _nothing_half_written(d)
    finally:
        stop_daemon(d)


def test_criu_killed_mid_restore(tmp_path: Path, template: tuple[Path, Path]) -> None:
    store, workdir = template
    _store_copy(store, tmp_path)
    d = _faulty_daemon(tmp_path, "")
    try:
        with criu_killed(d.proc.pid, delay_s=0.05) as killed:
            op = d.client().restore("base")
            with pytest.raises(GpusnapError):
                d.client().wait(op.id)
        assert killed, "CRIU was never seen running"
        assert d.client().get_operation(op.id).state == FAILED
        _nothing_half_written(d)
        wait_for(lambda: not _copies(workdir), 15, "a half-restored tree was left running")
    finally:
        stop_daemon(d)


def _toy(d: DaemonProc, tmp: Path, *args: str) -> Toy:
    from tests.adapters.test_agent_roundtrip import _start as start_toy  # the same toy worker as there

    return start_toy(d, tmp, *args)


def test_agent_death_mid_quiesce(tmp_path: Path) -> None:
    """The worker dies while it quiesces: the capture fails, nothing is listed, the daemon serves on."""
    d = _faulty_daemon(tmp_path, "")
    toy = _toy(d, tmp_path, "--slow-quiesce", "30")
    try:
        op = d.client().checkpoint(toy.proc.pid)
        wait_for(
            lambda: (toy.workdir / "events").exists() and "quiesce" in toy.events(),
            30,
            "the worker never started to quiesce",
        )
        toy.proc.kill()
        with pytest.raises(GpusnapError):
            d.client().wait(op.id, timeout_s=60)
        assert _nothing_half_written(d) == []
        d.client().node_info()
    finally:
        kill_tree(toy.proc.pid)
        stop_daemon(d)


def test_daemon_killed_with_a_quiesced_worker(tmp_path: Path) -> None:
    """gpusnapd dies after the worker quiesced (at the `dump` boundary): recovery wakes and resumes it."""
    d = _faulty_daemon(tmp_path, "checkpoint:dump:kill")
    toy = _toy(d, tmp_path)
    try:
        before = toy.generate()
        key = str(uuid.uuid4())

        def start(c: DaemonClient) -> OperationHandle:
            return c.checkpoint(toy.proc.pid, offload=False, request_id=key)

        d, done = _after_crash(d, tmp_path, _start(d, start), start)
        assert done.state == FAILED and "resumed the worker" in str(done.error), done.error
        events = toy.events()
        assert events[events.index("quiesce") + 1] == "resume restored=False", events
        assert toy.generate() == before, "the worker serves again"
        assert _nothing_half_written(d) == []
    finally:
        kill_tree(toy.proc.pid)
        stop_daemon(d)
