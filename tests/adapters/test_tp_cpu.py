"""A two-rank tensor-parallel torch.distributed worker (gloo on CPU), captured and restored with real CRIU.

The ranks tear their process groups down before the capture (``gpusnap.adapters.distributed``), so the
image holds no TCP connection between them and the default ``--tcp refuse`` capture succeeds; after the
restore they rendezvous again and every collective gives what it gave before (same greedy tokens from the
sharded MLP, which also equal the unsharded reference; same all-reduce sums). Why teardown and not
``--tcp established``: NCCL communicators cannot cross a checkpoint either unless suspended, and a
re-created group does not tie the restored copy to the source's ports, so several copies of one snapshot
run side by side (docs/tensor-parallel.md).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.adapters import torch_venv
from tests.conftest import DaemonProc, criu_killed, kill_tree, phase_seconds, wait_for

WORKER = Path(__file__).resolve().parent / "tp_worker.py"
WORLD = 2

pytestmark = torch_venv.needs_venv


class TpWorker:
    def __init__(self, daemon: DaemonProc, tmp: Path, name: str = "tp", *args: str):
        self.wd = tmp / name
        self.wd.mkdir()
        env = torch_venv.worker_env(daemon, tmp)
        self.proc: subprocess.Popen[bytes] = torch_venv.start(
            WORKER, [str(self.wd), "--world", str(WORLD), *args], env, self.wd / "out"
        )
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 180, "TP worker did not start")
        assert self.proc.poll() is None, (self.wd / "out").read_text()[-3000:]
        self.n = 0

    def generate(self) -> dict[str, Any]:
        self.n += 1
        (self.wd / f"go-{self.n}").write_text("")
        out = self.wd / f"tokens-{self.n}"
        wait_for(out.exists, 120, f"TP worker did not answer request {self.n}: {self.log()}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    def events(self) -> list[str]:
        return (self.wd / "events").read_text().split("\n")[:-1]

    def log(self) -> str:
        return (self.wd / "out").read_text()[-3000:]


def _check(result: dict[str, Any]) -> list[int]:
    """Every rank gave the same tokens, equal to the unsharded reference; the all-reduce summed all ranks."""
    tokens = result["ranks"][0]
    assert len(tokens) == 8 and all(r == tokens for r in result["ranks"]), result
    assert tokens == result["reference"], result
    assert result["all_reduce"] == [[float(sum(range(1, WORLD + 1)))] * 4] * WORLD, result
    return list(tokens)


@pytest.fixture
def worker(daemon: DaemonProc, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = TpWorker(daemon, tmp_path)
    yield w
    kill_tree(w.proc.pid)


def test_two_ranks_dump_restore_same_collectives(daemon: DaemonProc, worker: TpWorker) -> None:
    before = _check(worker.generate())
    dumped = json.loads(
        daemon.cli("-o", "json", "dump", str(worker.proc.pid), "--name", "tp", check=True, timeout=600).stdout
    )
    assert list(phase_seconds(dumped))[:3] == ["preflight", "warm-up", "quiesce"]
    assert worker.proc.wait(timeout=60) == -9
    assert worker.events()[-1] == "quiesce " + ",".join(["recreate:False"] * WORLD), "groups torn down first"
    for _ in range(2):  # one snapshot restored twice: each copy has its own rendezvous
        restored = json.loads(daemon.cli("-o", "json", "restore", "tp", check=True, timeout=600).stdout)
        try:
            assert "resume-worker" in phase_seconds(restored)
            assert worker.events()[-2] == "resume restored=True True,True", worker.events()
            after = _check(worker.generate())
            assert after == before, "same greedy tokens and all-reduce results after restore"
        finally:
            kill_tree(restored["pid"])


def test_failed_capture_brings_the_groups_back(daemon: DaemonProc, worker: TpWorker) -> None:
    before = _check(worker.generate())
    with criu_killed(daemon.proc.pid) as killed:
        res = daemon.cli("dump", str(worker.proc.pid), timeout=600)
    assert killed and res.returncode != 0, res.stderr
    assert worker.proc.poll() is None
    assert worker.events()[-2] == "resume restored=False True,True", worker.events()
    assert _check(worker.generate()) == before, "the source's ranks serve again over re-created groups"


def test_groups_left_up_are_refused_after_quiesce_and_the_source_resumes(daemon: DaemonProc, tmp_path: Path) -> None:
    """The established-TCP check of a capture with an agent runs after quiesce; connections still open then
    are refused by name, and the worker is resumed."""
    w = TpWorker(daemon, tmp_path, "keep", "--mode", "keep")
    try:
        before = _check(w.generate())
        res = daemon.cli("dump", str(w.proc.pid), timeout=600)
        assert res.returncode == 4, res.stderr
        assert "established TCP connections after the worker's quiesce" in res.stderr, res.stderr
        assert w.proc.poll() is None
        assert w.events()[-3:-1] == ["quiesce keep:True,keep:True", "resume restored=False True,True"], w.events()
        assert _check(w.generate()) == before
    finally:
        kill_tree(w.proc.pid)
