"""The worker agent end to end: warm-up, quiesce, real CRIU dump, restore, resume with context, canary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from tests.conftest import DaemonProc, criu_killed, kill_tree, phase_seconds, wait_for
from tests.starts import starts

WORKER = Path(__file__).resolve().parent / "toy_worker.py"


class Toy:
    def __init__(self, workdir: Path, proc: subprocess.Popen[bytes]):
        self.workdir = workdir
        self.proc = proc
        self.n = 0

    def generate(self) -> object:
        self.n += 1
        (self.workdir / f"go-{self.n}").write_text("")
        out = self.workdir / f"tokens-{self.n}"
        wait_for(out.exists, 20, f"worker did not answer request {self.n}")
        return json.loads(out.read_text())

    def events(self) -> list[str]:
        return (self.workdir / "events").read_text().split("\n")[:-1]


@starts("engine")
def _start(daemon: DaemonProc, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Toy:
    """The toy worker, its agent dialing ``daemon``'s socket (``env`` entries added; "" removes one)."""
    wd = tmp_path / "toy"
    wd.mkdir()
    env = {
        k: v
        for k, v in {
            **os.environ,
            "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),
            "GPUSNAP_WAKE_DIR": str(tmp_path / "wake"),
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            **(env or {}),
        }.items()
        if v != ""
    }
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(wd), *args],
        stdin=subprocess.DEVNULL,
        stdout=open(wd / "out", "wb"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 30, "toy worker did not start")
    assert proc.poll() is None, (wd / "out").read_text()
    return Toy(wd, proc)


def test_agent_warm_up_quiesce_dump_restore_resume(daemon: DaemonProc, tmp_path: Path) -> None:
    toy = _start(daemon, tmp_path)
    try:
        before = toy.generate()
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(toy.proc.pid), "--name", "toy", check=True).stdout)
        assert list(phase_seconds(dumped))[:3] == ["preflight", "warm-up", "quiesce"]
        assert toy.proc.wait(timeout=10) == -9
        assert toy.events() == ["warm_up", "quiesce"]
        snap = json.loads(daemon.cli("-o", "json", "inspect", "toy", check=True).stdout)
        assert snap["worker"]["engine"] == "toy" and snap["worker"]["canary_tokens"]

        restored = json.loads(
            daemon.cli(
                "-o",
                "json",
                "restore",
                "toy",
                "--env",
                "TOY_PORT=9000",
                "--unset-env",
                "TOY_GONE",
                "--set",
                "node=n2",
                check=True,
            ).stdout
        )
        try:
            assert "resume-worker" in phase_seconds(restored)
            assert toy.events()[-2:] == ["resume restored=True", "warm_up"], "resume, then the canary"
            ctx = json.loads((toy.workdir / "context.json").read_text())
            assert ctx == {"values": {"node": "n2"}, "TOY_PORT": "9000", "TOY_GONE": None}
            assert toy.generate() == before, "same tokens after restore: the engine's memory came back"
            assert toy.generate() == before, "and it keeps serving"
        finally:
            kill_tree(restored["pid"])
    finally:
        kill_tree(toy.proc.pid)


def test_failed_capture_resumes_the_source(daemon: DaemonProc, tmp_path: Path) -> None:
    """CRIU is killed in the middle of the dump, after quiesce: the agent resumes the source."""
    toy = _start(daemon, tmp_path)
    try:
        before = toy.generate()
        with criu_killed(daemon.proc.pid) as killed:
            res = daemon.cli("dump", str(toy.proc.pid))
        assert killed and res.returncode != 0, res.stderr
        assert toy.proc.poll() is None
        assert toy.events() == ["warm_up", "quiesce", "resume restored=False", "warm_up"]
        assert toy.generate() == before, "the source serves again after the failed capture"
    finally:
        kill_tree(toy.proc.pid)


def test_failed_quiesce_leaves_the_worker_serving(daemon: DaemonProc, tmp_path: Path) -> None:
    toy = _start(daemon, tmp_path, "--fail-quiesce")
    try:
        before = toy.generate()
        res = daemon.cli("dump", str(toy.proc.pid))
        assert res.returncode == 4 and "could not quiesce" in res.stderr and "injected" in res.stderr
        assert toy.proc.poll() is None
        assert toy.events() == ["warm_up", "quiesce", "resume restored=False"]
        assert toy.generate() == before
        assert json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == []
    finally:
        kill_tree(toy.proc.pid)


def test_no_quiesce_is_refused_while_an_agent_is_attached(daemon: DaemonProc, tmp_path: Path) -> None:
    toy = _start(daemon, tmp_path)
    try:
        res = daemon.cli("dump", str(toy.proc.pid), "--no-quiesce")
        assert res.returncode == 4 and "agent attached" in res.stderr
        assert not (toy.workdir / "events").exists() and toy.proc.poll() is None
    finally:
        kill_tree(toy.proc.pid)


def test_leave_running_resumes_the_source(daemon: DaemonProc, tmp_path: Path) -> None:
    toy = _start(daemon, tmp_path)
    try:
        before = toy.generate()
        daemon.cli("dump", str(toy.proc.pid), "--leave-running", check=True)
        assert toy.events() == ["warm_up", "quiesce", "resume restored=False", "warm_up"]
        assert toy.generate() == before, "the source serves on after a --leave-running capture"
    finally:
        kill_tree(toy.proc.pid)


def test_quiesce_timeout_still_resumes_the_worker(tmp_path: Path) -> None:
    from tests.conftest import start_daemon, stop_daemon

    d = start_daemon(tmp_path, extra_env={"GPUSNAP_QUIESCE_TIMEOUT": "1"})
    toy = _start(d, tmp_path, "--slow-quiesce", "3")
    try:
        before = toy.generate()
        res = d.cli("dump", str(toy.proc.pid))
        assert res.returncode == 8 and "did not finish quiesce" in res.stderr, res.stderr
        assert toy.events()[-2:] == ["resume restored=False", "warm_up"], toy.events()
        assert toy.generate() == before
    finally:
        kill_tree(toy.proc.pid)
        stop_daemon(d)


def test_engine_process_without_agent_is_refused_by_name(tmp_path: Path) -> None:
    from tests.conftest import start_daemon, stop_daemon

    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_AGENT_WAIT": "1.5"})  # agent_wait: 15 s by default
    toy = _start(d, tmp_path, "--child-without-agent")
    try:
        child = psutil.Process(toy.proc.pid).children()[0].pid
        res = d.cli("dump", str(toy.proc.pid), "--name", "toy")
        assert res.returncode == 4, res.stderr
        assert f"PID {child} (" in res.stderr and "has no gpusnap agent after 1.5 s" in res.stderr, res.stderr
        assert not (toy.workdir / "events").exists(), "refused before anything was touched"
        assert isinstance(toy.generate(), list), "the worker serves on"
    finally:
        kill_tree(toy.proc.pid)
        stop_daemon(d)


def test_an_agent_dialing_another_socket_is_said_and_refused(daemon: DaemonProc, tmp_path: Path) -> None:
    """A worker started with the service's socket under a daemon that serves another (`make run`): the worker
    says so in its log at once, and `dump` (and its dry run) refuses the slow path it would take, naming both
    sockets and the two ways on; `--no-quiesce` captures it as it is."""
    wrong = "/run/gpusnap-nowhere/agent.sock"
    toy = _start(daemon, tmp_path, "--attach-wait", "0", env={"GPUSNAP_AGENT_SOCKET": wrong})
    try:
        out = toy.workdir / "out"
        wait_for(lambda: "cannot reach" in out.read_text(), 10, "the worker did not say it cannot reach gpusnapd")
        said = out.read_text()
        assert f"PID {toy.proc.pid} cannot reach gpusnapd at {wrong} (GPUSNAP_AGENT_SOCKET)" in said, said
        assert "No such file or directory" in said and "build/run/agent.sock" in said, said
        assert said.count("cannot reach") == 1, f"said once, not at every retry:\n{said}"
        for dry in (["--dry-run"], []):
            res = daemon.cli("dump", str(toy.proc.pid), "--name", "toy", *dry)
            assert res.returncode == 4, res
            assert f"PID {toy.proc.pid} (" in res.stderr and "runs a gpusnap agent that is not attached" in res.stderr
            assert f"its GPUSNAP_AGENT_SOCKET is {wrong}" in res.stderr, res.stderr
            assert f"GPUSNAP_AGENT_SOCKET={daemon.agent_socket}" in res.stderr and "--no-quiesce" in res.stderr
            assert "slow path" in res.stderr, res.stderr
        error = json.loads(daemon.cli("-o", "json", "dump", str(toy.proc.pid), "--dry-run").stdout)["error"]
        assert error["reason"] == "AGENT_NOT_ATTACHED" and error["metadata"]["dials"] == wrong, error
        assert toy.proc.poll() is None and isinstance(toy.generate(), list), "refused before anything was touched"
        dumped = daemon.cli("dump", str(toy.proc.pid), "--no-quiesce", "--name", "as-is")
        assert dumped.returncode == 0 and dumped.stdout.startswith("snap-"), dumped.stderr
    finally:
        kill_tree(toy.proc.pid)


def test_the_wake_directory_follows_the_agent_socket(daemon: DaemonProc, tmp_path: Path) -> None:
    """Without GPUSNAP_WAKE_DIR an agent waits in `wake` beside the socket it dials, where gpusnapd makes it."""
    toy = _start(daemon, tmp_path, env={"GPUSNAP_WAKE_DIR": ""})
    try:
        before = toy.generate()
        daemon.cli("dump", str(toy.proc.pid), "--name", "toy", check=True)
        doc = json.loads(daemon.cli("-o", "json", "inspect", "toy", check=True).stdout)
        assert doc["worker"]["wake_dir"] == str(daemon.agent_socket.parent / "wake"), doc["worker"]
        pid = json.loads(daemon.cli("-o", "json", "restore", "toy", check=True).stdout)["pid"]
        try:
            assert toy.generate() == before, "the restored copy was woken in that directory and serves"
        finally:
            kill_tree(pid)
    finally:
        kill_tree(toy.proc.pid)
