"""Named buffers kept out of the image, end to end with real CRIU: a PyTorch worker on CPU names its
weights; the capture writes them to the buffer store and frees them, so the image does not hold them; a
restore reads them back before resume and the worker gives identical tokens. Identical weights are stored
once; a failed capture and ``--leave-running`` hand the source its weights back."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.sizes import human_size
from gpusnap.daemon.client.values import OperationState
from tests.adapters import torch_venv
from tests.conftest import DaemonProc, criu_killed, kill_tree, phase_seconds, start_daemon, stop_daemon, wait_for

WORKER = Path(__file__).resolve().parent / "torch_cpu_worker.py"
MIB = 256
WEIGHT_BYTES = MIB << 20

pytestmark = torch_venv.needs_venv


class Worker:
    def __init__(self, daemon: DaemonProc, tmp: Path, name: str, *args: str):
        self.wd = tmp / name
        self.wd.mkdir()
        env = torch_venv.worker_env(daemon, tmp)
        self.proc: subprocess.Popen[bytes] = torch_venv.start(
            WORKER, [str(self.wd), "--mib", str(MIB), *args], env, self.wd / "out"
        )
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 120, "worker did not start")
        assert self.proc.poll() is None, (self.wd / "out").read_text()[-3000:]
        self.n = 0

    def generate(self) -> dict[str, object]:
        self.n += 1
        (self.wd / f"go-{self.n}").write_text("")
        out = self.wd / f"tokens-{self.n}"
        wait_for(out.exists, 60, f"worker did not answer request {self.n}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]

    def events(self) -> list[str]:
        return (self.wd / "events").read_text().split("\n")[:-1]


def _blobs(daemon: DaemonProc) -> list[Path]:
    return [p for p in (daemon.store / "buffers" / "sha256").rglob("*") if p.is_file()]


def _blob_bytes(daemon: DaemonProc) -> int:
    return sum(p.stat().st_size for p in _blobs(daemon))


@pytest.fixture
def worker(daemon: DaemonProc, tmp_path: Path):  # type: ignore[no-untyped-def]
    w = Worker(daemon, tmp_path, "w")
    yield w
    kill_tree(w.proc.pid)


def test_weights_leave_the_image_and_come_back(daemon: DaemonProc, tmp_path: Path, worker: Worker) -> None:
    before = worker.generate()
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(worker.proc.pid), "--name", "w", check=True).stdout)
    assert list(phase_seconds(dumped))[:4] == ["preflight", "warm-up", "quiesce", "offload"]
    assert dumped["buffer_bytes"] == WEIGHT_BYTES, "the tied view is stored once, with its storage"
    assert worker.proc.wait(timeout=30) == -9
    snap = json.loads(daemon.cli("-o", "json", "inspect", "w", check=True).stdout)
    assert [b["name"] for b in snap["buffers"]] == ["w"]
    no_offload_image = WEIGHT_BYTES  # at least: the weights themselves are anonymous memory
    assert dumped["size_bytes"] < no_offload_image, f"image {dumped['size_bytes']} holds the weights"
    assert _blob_bytes(daemon) == WEIGHT_BYTES
    row = next(line for line in daemon.cli("ls", check=True).stdout.splitlines() if snap["id"] in line)
    assert human_size(dumped["size_bytes"] + dumped["buffer_bytes"]) in row, f"ls SIZE counts the weights: {row}"

    pids = []
    try:
        for _ in range(2):  # two copies from one snapshot, both read the same blob
            restored = json.loads(daemon.cli("-o", "json", "restore", "w", check=True, timeout=300).stdout)
            pids.append(restored["pid"])
            assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"]
        after = worker.generate()
        assert after == before, "identical tokens and weights from the restored worker"
        assert worker.events()[-2:] == [f"resume restored=True resident={WEIGHT_BYTES}", "warm_up"]
        ops = daemon.cli("ops", check=True, env={"COLUMNS": ""}).stdout  # 80 columns, off a terminal
        assert re.search(r"^ .*\bresume-worker\b", ops, re.M) and max(map(len, ops.splitlines())) <= 80, ops
    finally:
        kill_tree(*pids)


def test_identical_weights_are_stored_once(daemon: DaemonProc, tmp_path: Path, worker: Worker) -> None:
    other = Worker(daemon, tmp_path, "other")  # same seed: same weights
    third = Worker(daemon, tmp_path, "third", "--seed", "1")
    try:
        daemon.cli("dump", str(worker.proc.pid), "--name", "a", check=True)
        daemon.cli("dump", str(other.proc.pid), "--name", "b", check=True)
        assert _blob_bytes(daemon) == WEIGHT_BYTES, "the second snapshot added only its CPU state"
        daemon.cli("dump", str(third.proc.pid), "--name", "c", check=True)
        assert _blob_bytes(daemon) == 2 * WEIGHT_BYTES
        daemon.cli("rm", "a", "c", check=True)
        assert _blob_bytes(daemon) == WEIGHT_BYTES, "b still needs the shared blob; c's went with it"
        restored = json.loads(daemon.cli("-o", "json", "restore", "b", check=True, timeout=300).stdout)
        kill_tree(restored["pid"])
        daemon.cli("rm", "b", check=True)
        assert _blob_bytes(daemon) == 0
    finally:
        kill_tree(other.proc.pid, third.proc.pid)


def test_failed_capture_gives_the_source_its_weights_back(daemon: DaemonProc, worker: Worker) -> None:
    before = worker.generate()
    with criu_killed(daemon.proc.pid) as killed:
        res = daemon.cli("dump", str(worker.proc.pid))
    assert killed and res.returncode != 0, res.stderr
    assert worker.proc.poll() is None
    assert worker.events()[-2:] == [f"resume restored=False resident={WEIGHT_BYTES}", "warm_up"]
    assert worker.generate() == before, "the source serves with its own weights again"
    assert _blob_bytes(daemon) == 0 and not list((daemon.store / "buffers" / "incoming").iterdir())


def test_leave_running_reloads_the_source(daemon: DaemonProc, worker: Worker) -> None:
    before = worker.generate()
    daemon.cli("dump", str(worker.proc.pid), "--leave-running", check=True)
    assert worker.generate() == before
    assert _blob_bytes(daemon) == WEIGHT_BYTES


def test_no_offload_keeps_weights_in_the_image(daemon: DaemonProc, worker: Worker) -> None:
    before = worker.generate()
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(worker.proc.pid), "--no-offload", check=True).stdout)
    assert "offload" not in phase_seconds(dumped) and dumped["buffer_bytes"] == 0
    assert dumped["size_bytes"] > WEIGHT_BYTES
    restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=300).stdout)
    try:
        assert "reload-buffers" not in phase_seconds(restored)
        assert worker.generate() == before
    finally:
        kill_tree(restored["pid"])


def test_damaged_or_missing_buffers_are_named(daemon: DaemonProc, worker: Worker) -> None:
    daemon.cli("dump", str(worker.proc.pid), "--name", "w", check=True)
    (blob,) = _blobs(daemon)
    with open(blob, "r+b") as fh:  # same size, other bytes: only a digest tells
        fh.seek(1 << 20)
        fh.write(b"\xff" * 4096)
    res = daemon.cli("restore", "w", "--verify-buffers")
    assert res.returncode == 4 and "buffer w: checksum mismatch" in res.stderr, res.stderr
    blob.unlink()
    res = daemon.cli("restore", "w")
    assert res.returncode == 4 and "needs buffer 'w'" in res.stderr and "missing" in res.stderr, res.stderr


def test_a_full_buffer_store_refuses_the_capture_and_the_worker_serves_on(tmp_path: Path) -> None:
    """The worker is quiesced and still connected when staging fails: the rollback must detach and resume it."""
    from tests.conftest import start_daemon, stop_daemon

    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    # The disk tier below the RAM tier would take the weights: a budget keeps it from doing so.
    d = start_daemon(
        tmp_path,
        extra_env={
            "GPUSNAP_BUFFER_DIR": str(small / "buffers"),
            "GPUSNAP_RESUME_TIMEOUT": "30",
            "GPUSNAP_DISK_TIER_BYTES": str(32 << 20),
        },
    )
    w = Worker(d, tmp_path, "w")
    try:
        before = w.generate()
        res = d.cli("dump", str(w.proc.pid))
        assert res.returncode == 9 and "GiB free" in res.stderr, res.stderr
        assert "rollback" not in res.stderr, res.stderr
        assert w.generate() == before, "the source serves again, weights in place"
        assert w.events()[-2:] == [f"resume restored=False resident={WEIGHT_BYTES}", "warm_up"]
        assert json.loads(d.cli("-o", "json", "ls", check=True).stdout) == []
    finally:
        kill_tree(w.proc.pid)
        stop_daemon(d)
        subprocess.run(["umount", "-l", str(small)])


def test_address_stable_weights_survive_criu_at_the_same_address(daemon: DaemonProc, tmp_path: Path) -> None:
    """Weights in a VMM arena (fake driver: the arena is a host mapping): the capture releases the arena's
    memory and leaves its range reserved (PROT_NONE, so the image holds no weight pages); after CRIU
    restores the process, the arena is re-mapped at the same address and filled from the buffer store."""
    w = Worker(daemon, tmp_path, "stable", "--stable-fake")
    restored_pid = 0
    try:
        before = w.generate()
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(w.proc.pid), check=True).stdout)
        assert dumped["buffer_bytes"] == WEIGHT_BYTES
        assert dumped["size_bytes"] < WEIGHT_BYTES, f"image {dumped['size_bytes']} holds the released arena's pages"
        assert w.proc.wait(timeout=30) == -9
        restored_pid = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=300).stdout)[
            "pid"
        ]
        after = w.generate()
        assert after["ptr"] == before["ptr"], "the weights came back at the same address"
        assert after == before, "identical tokens and weights"
        assert "resume restored=True resident=268435456 mapped=True" in w.events()
    finally:
        kill_tree(w.proc.pid, restored_pid)


@pytest.mark.parametrize("phase", ["offload-free", "dump", "publish", "finish"])
def test_daemon_killed_after_offload_gives_the_worker_its_weights_back(tmp_path: Path, phase: str) -> None:
    """gpusnapd is SIGKILLed once the worker's weights were copied out: before the worker freed them (inside
    `offload`, at `offload-free`: they are still in the worker, and staged), staged files (at `dump`),
    committed blobs of an unpublished snapshot (at `publish`), a published snapshot (at `finish`). The restarted daemon's
    recovery hands the worker its weights back and resumes it; it serves the same tokens."""
    mib = 64
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_FAILPOINT": f"checkpoint:{phase}:kill"})
    w = Worker(d, tmp_path, "w", "--mib", str(mib))
    try:
        before = w.generate()
        op = d.client().checkpoint(w.proc.pid, request_id=f"offload-{phase}")
        assert d.proc.wait(timeout=120) == -9, "the failpoint did not kill gpusnapd"
        for c in d.clients:
            c.close()
        d = start_daemon(tmp_path / "d", socket_dir=d.socket.parent)  # same agent socket: the worker finds it
        with contextlib.suppress(GpusnapError):
            d.client().wait(op.id, timeout_s=120)
        done = d.client().get_operation(op.id)
        durable = phase == "finish"
        assert done.state is (OperationState.SUCCEEDED if durable else OperationState.FAILED), done
        if not durable:
            assert re.search(r"resumed the worker \(PID \d+\), with 1 buffers read back", str(done.error)), done
        assert f"resume restored=False resident={mib << 20}" in w.events(), w.events()
        assert w.generate() == before, "the source serves with its own weights again"
        assert [s.id for s in d.client().list_snapshots()] == ([done.snapshot.id] if durable else [])
        assert _blob_bytes(d) == (mib << 20 if durable else 0), "blobs of no snapshot are collected"
        assert not list((d.store / "buffers" / "incoming").iterdir()), "staged files are removed once handed back"
    finally:
        kill_tree(w.proc.pid)
        stop_daemon(d)
