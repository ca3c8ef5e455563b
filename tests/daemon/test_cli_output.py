"""What the CLI prints for people: tables that fit 80 columns off a terminal, truthful phases and errors,
and a daemon whose agent socket follows --socket (or --agent-socket) and cleans up after itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from gpusnap.daemon.cli.output import moved
from tests.conftest import DaemonProc, Workloads, _cli_env, _healthy, criu_prefix, wait_for
from tests.shortdirs import short_dir
from tests.starts import starts

LONG_NAME = "a-rather-long-snapshot-name-for-a-warmed-up-inference-worker-01"


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def test_tables_fit_80_columns_off_a_terminal(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "4", "--no-listener")
    daemon.cli(
        "dump",
        str(w.pid),
        "--name",
        LONG_NAME,
        "--label",
        "model=llama-3.1-8b-instruct",
        "--label",
        "team=inference-platform",
        "--leave-running",
        check=True,
    )
    restored = json.loads(daemon.cli("-o", "json", "restore", LONG_NAME, "--private-net", check=True).stdout)
    workloads.adopt(restored["pid"])
    for args in (["ls"], ["inspect", LONG_NAME], ["ops"], ["node"], ["store"]):
        out = daemon.cli(*args, check=True, env={"COLUMNS": ""}).stdout  # no $COLUMNS, not a terminal
        assert out.strip() and _widest(out) <= 80, f"{args}: {_widest(out)} columns:\n{out}"
        assert "…" not in out and "..." not in out, f"{args}: a value was cut:\n{out}"
        wide = daemon.cli(*args, check=True, env={"COLUMNS": "200"}).stdout
        assert _widest(wide) <= 200
    listed = daemon.cli("ls", check=True, env={"COLUMNS": "200"}).stdout
    assert LONG_NAME in listed, "with room, the name is shown whole"
    snap = json.loads(daemon.cli("-o", "json", "inspect", LONG_NAME, check=True).stdout)
    narrow = daemon.cli("ls", check=True, env={"COLUMNS": ""}).stdout
    row = next(line for line in narrow.splitlines() if snap["id"] in line)  # the id is never folded
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", row), f"the created time is split:\n{narrow}"
    assert "SOURCE" not in narrow and "SOURCE" in listed, "at 80 columns NAME gets the room SOURCE/GPUS took"
    # 80 - ID 31 - CREATED 16 - SIZE 8 - padding leaves NAME 17 columns: a long name folds into few whole lines
    lines = narrow.splitlines()
    start, end = lines[0].index("NAME"), lines[0].index("CREATED")
    folded = "".join(line[start:end].strip() for line in lines[1 : 1 + (len(LONG_NAME) + 16) // 17])
    assert folded == LONG_NAME, f"the name is not intact:\n{narrow}"
    ops = daemon.cli("ops", check=True, env={"COLUMNS": ""}).stdout
    assert any(line.split()[:2] == [snap["id"], "validate"] for line in ops.splitlines()), (
        f"the target is split:\n{ops}"
    )
    assert re.search(r"op-[a-z2-7]{26} +restore +succeeded", ops), f"an operation's row is split:\n{ops}"
    store = daemon.cli("store", check=True, env={"COLUMNS": ""}).stdout
    assert str(daemon.store) in store and "1 snapshot," in store, store


def test_phase_bytes_column() -> None:
    assert moved(0, 0) == "", "a phase that moves no bytes shows none (not '1/1 bytes')"
    assert moved(2048, 2048) == "2.0 KiB"
    assert moved(512, 2048) == "512 B of 2.0 KiB"
    assert moved(512, 2048, 300 << 20) == "512 B of 2.0 KiB at 300.0 MiB/s", "the rate while a phase runs"
    assert moved(3 << 20, 0, 1 << 20) == "3.0 MiB at 1.0 MiB/s", "no total where none is known"
    assert moved(3 << 20, 0) == "3.0 MiB"


def test_wait_on_a_malformed_id_says_what_an_id_looks_like(daemon: DaemonProc) -> None:
    res = daemon.cli("wait", "12345")
    assert res.returncode == 2
    assert "invalid operation id '12345'" in res.stderr and "op- and 26 characters a-z and 2-7" in res.stderr
    assert res.stderr.count("\n") == 1


@starts("gpusnapd")
def _gpusnapd(tmp: Path, *flags: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in _cli_env().items() if k != "GPUSNAP_AGENT_SOCKET"}
    prefix = criu_prefix()
    cmd = [
        sys.executable,
        "-m",
        "gpusnap.daemon.main",
        "--store",
        str(tmp / "store"),
        "--criu",
        str(prefix / "bin" / "criu"),
        "--pycriu-path",
        str(prefix / "python"),
        "--log-format",
        "json",
        *flags,
    ]
    return subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=open(tmp / "log", "ab"), stderr=subprocess.STDOUT, env=env
    )


def test_agent_socket_follows_socket_and_the_flag(tmp_path: Path) -> None:
    default_agent = Path("/run/gpusnap/agent.sock")
    existed = default_agent.exists()
    run_dir = short_dir("gpusnap-run-")
    socket = run_dir / "api.sock"
    proc = _gpusnapd(tmp_path, "--socket", str(socket))
    try:
        wait_for(lambda: (socket.exists() and _healthy(socket)) or proc.poll() is not None, 60, "did not start")
        assert proc.poll() is None, (tmp_path / "log").read_text()
        assert (run_dir / "agent.sock").is_socket(), "the agent socket goes beside --socket"
        assert (run_dir / "wake").is_dir()
        assert default_agent.exists() == existed, "nothing bound in /run/gpusnap"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not (run_dir / "agent.sock").exists() and not (run_dir / "wake").exists(), "nothing left behind"

    agent_dir = short_dir("gpusnap-agent-")
    proc = _gpusnapd(tmp_path, "--socket", str(socket), "--agent-socket", str(agent_dir / "a.sock"))
    try:
        wait_for(lambda: (socket.exists() and _healthy(socket)) or proc.poll() is not None, 60, "did not start")
        assert proc.poll() is None, (tmp_path / "log").read_text()
        assert (agent_dir / "a.sock").is_socket() and not (run_dir / "agent.sock").exists()
        started = [json.loads(x) for x in (tmp_path / "log").read_text().splitlines() if '"daemon.started"' in x]
        assert started[-1]["agent_socket"] == str(agent_dir / "a.sock")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert not (agent_dir / "wake").exists()


def test_dump_dry_run_and_socket_after_the_command(daemon: DaemonProc, workloads: Workloads) -> None:
    """`dump --dry-run` runs the preflight only; `--socket` may follow the command, as `-o` may."""
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    env = {k: v for k, v in _cli_env().items() if k != "GPUSNAP_SOCKET"}
    argv = [sys.executable, "-m", "gpusnap.daemon.cli"]
    res = subprocess.run(
        [*argv, "dump", str(w.pid), "--dry-run", "--socket", str(daemon.socket)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert res.returncode == 0 and f"PID {w.pid} can be captured" in res.stdout, res.stderr
    assert os.path.exists(f"/proc/{w.pid}") and json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == []
    refused = daemon.cli("dump", str(os.getpid()), "--dry-run")
    assert refused.returncode != 0 and "gpusnap: error:" in refused.stderr, "a dry run meets the same refusals"
    listed = subprocess.run(
        [*argv, "ls", "-o", "json", "--socket", str(daemon.socket)], capture_output=True, text=True, env=env
    )
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr


def test_a_missing_criu_names_the_installer_a_wheel_brings(tmp_path: Path) -> None:
    """No Makefile in a wheel: the fix is `gpusnap-install-criu` and the flags that use what it installs."""
    from gpusnap.daemon.install_criu import DEFAULT_PREFIX, flags

    proc = _gpusnapd(tmp_path, "--socket", str(tmp_path / "s.sock"), "--criu", str(tmp_path / "no-criu"))
    assert proc.wait(timeout=60) == 3
    log = (tmp_path / "log").read_text()
    assert "`gpusnap-install-criu`" in log and flags(DEFAULT_PREFIX) in log, log


def test_ops_store_errors_and_wait_as_a_person_sees_them(
    daemon: DaemonProc, workloads: Workloads, tmp_path: Path
) -> None:
    """A dry run is listed as one, not as a succeeded checkpoint; `store -o json` leaves out a budget there is not,
    and an error without facts its metadata; `wait` on an ended operation shows what each phase took, not the
    0:00:00 of its replay (in a terminal)."""
    from tests.pty_shell import Shell

    w = workloads.start("--mem-mb", "64", "--no-listener", "--no-child")
    dry = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), "--dry-run", check=True).stdout)
    assert dry["dry_run"] is True and dry["kind"] == "checkpoint", dry
    op = json.loads(daemon.cli("-o", "json", "dump", str(w.pid), "--name", "big", check=True).stdout)["operation"]
    ops = daemon.cli("ops", check=True, env={"COLUMNS": ""}).stdout
    assert re.search(rf"^ {dry['id']} +dry-run +succeeded", ops, re.M), ops
    assert re.search(rf"^ {op} +checkpoint +succeeded", ops, re.M), ops
    tiers = json.loads(daemon.cli("-o", "json", "store", check=True).stdout)["tiers"]
    assert tiers and all("budget_bytes" not in t for t in tiers), f"no budget is left out, not 0: {tiers}"
    err = json.loads(daemon.cli("-o", "json", "wait", "op-" + "a" * 26).stdout)["error"]
    assert err["reason"] == "OPERATION_NOT_FOUND" and "metadata" not in err, err

    sh = Shell(tmp_path, {**_cli_env(), "GPUSNAP_SOCKET": str(daemon.socket)})
    try:
        shown = sh.run(f"{sys.executable} -m gpusnap.daemon.cli wait {op}")
    finally:
        sh.close()
    took = {
        p["phase"]: p["duration_seconds"] for p in json.loads(daemon.cli("-o", "json", "wait", op).stdout)["phases"]
    }
    assert "0:00:00" not in shown, shown
    assert re.search(rf"dump .* {took['dump']:.2f}s", shown), f"the dump's own {took['dump']:.2f} s:\n{shown}"
