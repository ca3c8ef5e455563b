"""Fault matrix, worker rows: the worker's agent hangs or dies in each worker phase (capture: quiesce,
offload; restore: reload, resume), and at every other capture and restore phase, with real CRIU, a real gpusnapd and the PyTorch CPU worker whose weights
are named buffers (tests/adapters/torch_cpu_worker.py, fault from its WORKDIR/fault file). Each cell
asserts what every cell of the matrix does (docs/reliability.md):

- nothing half-written is listed (listed snapshots match their manifests; staging and staged buffers empty);
- the source is never left frozen, locked or killed before its snapshot is durable (a hung worker serves
  its own tokens again once its hang ends; one that died did so by itself);
- no restored tree is left untracked (no copy of the worker runs after a failed restore).

A hang lasts ``HANG_S``, longer than the daemon's bound on that phase (``TIMEOUT_S``).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import GpusnapError
from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import Worker, _blob_bytes
from tests.conftest import DaemonProc, kill_tree, start_daemon, stop_daemon, wait_for
from tests.daemon.test_fault_matrix import _copies, _nothing_half_written, _store_copy

pytestmark = torch_venv.needs_venv

MIB = 64
TIMEOUT_S = "4"
"""quiesce_timeout (capture cells) or resume_timeout (restore cells) of the daemon, seconds."""
HANG_S = 12
"""How long the worker hangs (torch_cpu_worker.py reads it from the fault file)."""


def _fault(w: Worker, phase: str, fault: str) -> None:
    (w.wd / "fault").write_text(f"{phase}:{fault}:{HANG_S}")


@pytest.mark.parametrize("fault", ["hang", "die"])
@pytest.mark.parametrize("phase", ["quiesce", "offload"])
def test_capture_cell(tmp_path: Path, phase: str, fault: str) -> None:
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_QUIESCE_TIMEOUT": TIMEOUT_S})
    w = Worker(d, tmp_path, "w", "--mib", str(MIB))
    try:
        before = w.generate()
        _fault(w, phase, fault)
        op = d.client().checkpoint(w.proc.pid)
        with pytest.raises(GpusnapError) as err:
            d.client().wait(op.id, timeout_s=180)
        assert _nothing_half_written(d) == [], "a failed capture lists nothing"
        if fault == "hang":
            assert err.value.reason == "AGENT_TIMEOUT", err.value.message
            (w.wd / "fault").unlink()
            assert w.generate() == before, "the source serves its own tokens again once its hang ends"
            assert f"resume restored=False resident={MIB << 20}" in w.events(), w.events()
        else:
            assert w.proc.wait(timeout=30) == 3, "the worker died by itself (exit 3), not killed by gpusnapd"
        assert _blob_bytes(d) == 0, "no blob of a failed capture stays"
        d.client().node_info()  # the daemon serves on
    finally:
        kill_tree(w.proc.pid)
        stop_daemon(d)


@pytest.mark.parametrize("fault", ["hang", "die"])
@pytest.mark.parametrize("phase", ["reload", "resume"])
def test_restore_cell(tmp_path: Path, phase: str, fault: str) -> None:
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_RESUME_TIMEOUT": TIMEOUT_S})
    w = Worker(d, tmp_path, "w", "--mib", str(MIB))
    restored: list[int] = []
    try:
        before = w.generate()
        snap = json.loads(d.cli("-o", "json", "dump", str(w.proc.pid), "--name", "w", check=True).stdout)
        assert w.proc.wait(timeout=30) == -9, "the source ends once its snapshot is durable"
        _fault(w, phase, fault)
        op = d.client().restore("w")
        with pytest.raises(GpusnapError) as err:
            d.client().wait(op.id, timeout_s=180)
        assert err.value.reason in ("AGENT_TIMEOUT", "AGENT_LOST", "AGENT_COMMAND_FAILED"), err.value.message
        assert _nothing_half_written(d) == [snap["id"]], "the snapshot is kept, complete"
        wait_for(lambda: not _copies(w.wd), 30, "a restored tree runs untracked")
        (w.wd / "fault").unlink()
        again = json.loads(d.cli("-o", "json", "restore", "w", check=True, timeout=300).stdout)
        restored.append(again["pid"])
        assert w.generate() == before, "the kept snapshot restores with the same tokens"
    finally:
        kill_tree(*restored)
        stop_daemon(d)


# Issue 19 item 8: the same faults crossed with every other capture and restore phase. A daemon failpoint
# (``hold``, gpusnap.daemon.operations.failpoints) stops the operation at the start of the phase, the fault
# is injected there, and the operation goes on. "Dies" is the worker's process ending (SIGKILL, or its own
# exit in a step of its agent); "hangs" is its agent not answering its next step for HANG_S. Where the agent
# takes no further step in a successful capture (dump … finish), the capture is made to fail at that phase
# (ENOSPC), so that its rollback meets the hung agent.

LATER_CAPTURE = ["preflight", "warm-up", "dump", "checksum", "publish", "finish"]
EARLIER_RESTORE = ["preflight", "verify", "restore", "criu-started", "pre-resume", "validate"]


def _held_daemon(tmp: Path, spec: str, socket_dir: Path | None = None) -> tuple[DaemonProc, Path]:
    hold = tmp / "hold"
    hold.mkdir()
    env = {
        "GPUSNAP_FAILPOINT": f"{spec}:hold",
        "GPUSNAP_FAILPOINT_DIR": str(hold),
        "GPUSNAP_WARMUP_TIMEOUT": TIMEOUT_S,
        "GPUSNAP_RESUME_TIMEOUT": TIMEOUT_S,
    }
    d = start_daemon(tmp / "d", extra_env=env, socket_dir=socket_dir)
    assert d.alive(), d.log.read_text()
    return d, hold


def _at(hold: Path, phase: str) -> None:
    wait_for((hold / "held").exists, 120, f"the operation never reached {phase}")


@pytest.mark.parametrize("fault", ["hang", "die"])
@pytest.mark.parametrize("phase", LATER_CAPTURE)
def test_capture_phase_cell(tmp_path: Path, phase: str, fault: str) -> None:
    d, hold = _held_daemon(tmp_path, f"checkpoint:{phase}")
    w = Worker(d, tmp_path, "w", "--mib", str(MIB))
    try:
        before = w.generate()
        op = d.client().checkpoint(w.proc.pid)
        _at(hold, phase)
        if phase in ("preflight", "warm-up"):
            _fault(w, "warm_up", fault)  # the agent's first step: it hangs (past warmup_timeout) or dies in it
        elif fault == "die":
            w.proc.kill()
        else:
            _fault(w, "resume", fault)
            (hold / "enospc").touch()
        (hold / "held").unlink()
        error: GpusnapError | None = None
        try:
            d.client().wait(op.id, timeout_s=180)
        except GpusnapError as exc:
            error = exc
        listed = _nothing_half_written(d)
        assert (error is None) == (listed != []), "listed iff the capture succeeded"
        assert _blob_bytes(d) == (MIB << 20 if listed else 0), "no blob of a failed capture stays"
        if fault == "die":
            assert w.proc.wait(timeout=30) in (3, -9), "it died by its own exit or our SIGKILL"
        else:
            assert error is not None, f"a hang at {phase} with the capture failing there"
            (w.wd / "fault").unlink()
            assert w.generate() == before, "the source serves its own tokens again once its hang ends"
            if phase not in ("preflight", "warm-up"):  # it was quiesced and offloaded: its weights came back
                assert f"resume restored=False resident={MIB << 20}" in w.events(), w.events()
        d.client().node_info()  # the daemon serves on
    finally:
        kill_tree(w.proc.pid)
        stop_daemon(d)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Worker, Path]]:
    """One snapshot ``w`` of the worker, its source gone; (store, worker, socket directory), so each restore
    cell restores a copy of the store with a daemon on the same sockets (the restored agent dials them)."""
    tmp = tmp_path_factory.mktemp("agent-template")
    sockets = tmp / "sockets"
    sockets.mkdir(mode=0o755)
    d = start_daemon(tmp / "d", socket_dir=sockets)
    try:
        w = Worker(d, tmp, "w", "--mib", str(MIB))
        d.cli("dump", str(w.proc.pid), "--name", "w", check=True)
        assert w.proc.wait(timeout=30) == -9
    finally:
        stop_daemon(d)
    yield d.store, w, sockets


@pytest.mark.parametrize("fault", ["hang", "die"])
@pytest.mark.parametrize("phase", EARLIER_RESTORE)
def test_restore_phase_cell(tmp_path: Path, template: tuple[Path, Worker, Path], phase: str, fault: str) -> None:
    store, w, sockets = template
    (tmp_path / "d").mkdir()
    _store_copy(store, tmp_path / "d")
    sockets.mkdir(mode=0o755, exist_ok=True)
    d, hold = _held_daemon(tmp_path, f"restore:{phase}", socket_dir=sockets)
    try:
        op = d.client().restore("w")
        _at(hold, phase)
        if fault == "die" and phase in ("pre-resume", "validate"):  # the restored tree exists: it dies now
            for pid in _copies(w.wd):
                os.kill(pid, signal.SIGKILL)
        else:  # no tree yet, or a hang: the restored agent hangs or dies in its first step
            _fault(w, "reload", fault)
        (hold / "held").unlink()
        with pytest.raises(GpusnapError) as err:
            d.client().wait(op.id, timeout_s=180)
        # Killed at pre-resume, the tree fails CRIU's own detach or gpusnapd's look at what CRIU restored first.
        expected = {"AGENT_TIMEOUT", "AGENT_LOST", "RESTORE_INCOMPLETE", "CRIU_RESTORE_FAILED"}
        assert err.value.reason in expected and "ps -p" not in err.value.message, err.value.message
        wait_for(lambda: not _copies(w.wd), 30, "a restored tree runs half-started and untracked")
        assert len(_nothing_half_written(d)) == 1, "the snapshot is kept, complete"
    finally:
        (w.wd / "fault").unlink(missing_ok=True)
        kill_tree(*_copies(w.wd))
        stop_daemon(d)
