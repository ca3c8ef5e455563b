"""The /proc fact readers, over a fake proc tree."""

from __future__ import annotations

from pathlib import Path

from gpusnap.daemon.drivers import procfs
from tests.fakes.cuda import FakeProc


def test_fact_readers(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path / "proc")
    proc.add(
        10, fds=["/dev/nvidia0", "pipe:[77]"], maps=["/dev/gdrdrv", "/dev/shm/x (deleted)"], env={"A": "1", "B": "x=y"}
    )
    paths = procfs.open_paths(10, proc.root)
    assert "/dev/nvidia0" in paths and "pipe:[77]" in paths and "/dev/gdrdrv" in paths and "/dev/shm/x" in paths
    assert procfs.read_environ(10, proc.root) == {"A": "1", "B": "x=y"}
    assert procfs.pid_alive(10, proc.root) and not procfs.pid_alive(11, proc.root)
    assert procfs.open_paths(11, proc.root) == []
    assert not procfs.mps_pipe_dir_exists(10, {}, proc.root)
    (proc.root / "10" / "root" / "tmp" / "nvidia-mps").mkdir(parents=True)
    (proc.root / "10" / "root" / "tmp" / "nvidia-mps" / "control").write_text("")
    assert procfs.mps_pipe_dir_exists(10, {}, proc.root)
    assert not procfs.mps_daemon_running(proc.root)
    proc.add(12, comm="nvidia-cuda-mps")
    assert procfs.mps_daemon_running(proc.root)
    proc.add(13, state="Z")
    assert not procfs.pid_alive(13, proc.root)
