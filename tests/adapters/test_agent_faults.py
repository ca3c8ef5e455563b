"""Fault matrix, worker rows: the worker's agent hangs or dies in each worker phase (capture: quiesce,
offload; restore: reload, resume), with real CRIU, a real gpusnapd and the PyTorch CPU worker whose weights
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
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import GpusnapError
from tests.adapters import torch_venv
from tests.adapters.test_buffers_cpu import Worker, _blob_bytes
from tests.conftest import kill_tree, start_daemon, stop_daemon, wait_for
from tests.daemon.test_fault_matrix import _copies, _nothing_half_written

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
