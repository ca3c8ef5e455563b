"""The README's quick start typed into real terminals, and a worker started with ``&`` from an interactive shell
(a real pty, job control) is captured and restored:
its terminal is left behind at dump, and a restore gives the tree a terminal of its own whose output goes to
a file (or /dev/null), in a session of its own, under an init whose command line names the snapshot."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, DaemonProc, _cli_env, _healthy, criu_prefix, kill_tree, wait_for
from tests.pty_shell import Shell
from tests.starts import starts

COUNTER = "python3 -c 'import time,itertools; [print(i, flush=True) or time.sleep(1) for i in itertools.count()]'"


def quick_start() -> list[list[str]]:
    """The shell blocks of the README's quick start (before its first section), each as the lines a person types
    (continued lines joined)."""
    text = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in text.split("```sh\n")[1:]]
    return [b.replace("\\\n", " ").splitlines() for b in blocks]


@pytest.fixture
def checkout() -> Iterator[Path]:
    """A directory laid out as a checkout after `make venv criu`: this checkout's Makefile, scripts and CRIU prefix,
    and a .venv whose bin is this interpreter's (its stamp new, so make installs nothing). Short: the socket's
    path must fit a sockaddr_un."""
    home = Path(tempfile.mkdtemp(prefix="gsq-"))
    for name in ("Makefile", "pyproject.toml", "scripts"):
        (home / name).symlink_to(REPO / name)
    (home / ".criu").symlink_to(criu_prefix())
    (home / ".venv").mkdir()
    (home / ".venv" / "bin").symlink_to(Path(sys.executable).parent)
    (home / ".venv" / ".installed").touch()
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def shell(daemon: DaemonProc, tmp_path: Path) -> Iterator[Shell]:
    """An interactive bash in a directory laid out as a checkout after `make run`: build/run/gpusnapd.sock is
    the test daemon's socket, .venv this interpreter's environment (its `gpusnap` runs this checkout)."""
    home = tmp_path / "checkout"
    (home / "build" / "run").mkdir(parents=True)
    (home / "build" / "run" / "gpusnapd.sock").symlink_to(daemon.socket)
    (home / ".venv").symlink_to(Path(sys.executable).parent.parent)
    sh = Shell(home, {k: v for k, v in _cli_env().items() if k != "GPUSNAP_SOCKET"})
    yield sh
    sh.close()


def _inits(snapshot_id: str) -> list[psutil.Process]:
    """The namespace inits holding restored trees of ``snapshot_id`` (found by their command line)."""
    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if "gpusnap.daemon.drivers.reaper" in (p.info["cmdline"] or [])
        and f"snapshot={snapshot_id}" in p.info["cmdline"]
    ]


@starts("gpusnapd")  # `make run`, typed into a terminal
def test_the_readme_quick_start_as_typed_in_two_terminals(checkout: Path) -> None:
    """`make run` in one terminal, the example in another, each line as typed; then Ctrl-C stops gpusnapd."""
    [[run, test], example] = quick_start()
    assert run.split("#")[0].strip() == "make run" and test.split("#")[0].strip() == "make test"
    Path("/tmp/w.log").unlink(missing_ok=True)
    env = {k: v for k, v in _cli_env().items() if k != "GPUSNAP_SOCKET"}
    server, sh = Shell(checkout, env), Shell(checkout, env)
    try:
        server.start(run)
        socket = checkout / "build" / "run" / "gpusnapd.sock"
        wait_for(lambda: socket.exists() and _healthy(socket), 120, "`make run` did not start serving")
        *typed, stop = example
        out = [sh.run(line) for line in typed]
        dumped = re.search(r"^(snap-[a-z2-7]{26})$", out[2], re.M)
        assert dumped, f"dump printed no snapshot id:\n{sh.transcript}"
        assert "terminal /dev/pts/" in out[2] and "controlling terminal" in out[2], "the dump says what it left behind"
        before, after = out[3].split()
        assert before == after, f"the worker still counts after its dump:\n{sh.transcript}"
        assert "my-worker" in out[4] and dumped[1] in out[4]
        pid = int(re.search(r"^(\d+)$", out[5], re.M)[1])  # type: ignore[index]
        counted = [int(n) for n in out[6].split()]
        assert len(counted) == 3 and counted[0] > int(before) and counted == sorted(counted), sh.transcript
        [init] = _inits(dumped[1])
        assert psutil.Process(pid).ppid() == init.pid and init.name() == "gpusnap-init"
        assert os.getsid(pid) == init.pid != os.getsid(sh.pid), "the restored tree runs in a session of its own"
        assert f"snapshot={dumped[1]}" in init.cmdline() and "name=my-worker" in init.cmdline()
        assert re.search(rf"^ {pid} +my-worker", out[7], re.M), f"ls --running lists it:\n{out[7]}"
        assert re.search(rf"^ *{init.pid} .*snapshot={dumped[1]} name=my-worker operation=op-", out[8], re.M), out[8]
        assert f"stopped PID {pid} " in sh.run(stop), sh.transcript
        assert not init.is_running() or init.status() == psutil.STATUS_ZOMBIE, "stop returned before the tree ended"
        shown = server.interrupt()
        assert "daemon.started" in shown and not socket.exists(), f"Ctrl-C did not stop gpusnapd:\n{shown}"
    finally:
        server.close()
        sh.close()
        Path("/tmp/w.log").unlink(missing_ok=True)


def test_a_job_with_its_output_on_the_terminal_restores_with_a_file(
    shell: Shell, daemon: DaemonProc, tmp_path: Path
) -> None:
    shell.run(f"{COUNTER} &")  # stdin, stdout and stderr on the terminal
    shell.run("W=$!")
    out = shell.run(".venv/bin/gpusnap --socket build/run/gpusnapd.sock dump $W --name on-tty")
    snap = re.search(r"^(snap-[a-z2-7]{26})$", out, re.M)
    assert snap, shell.transcript
    assert re.search(r"terminal /dev/pts/\d+ \(controlling terminal, fds \d+/0, \d+/1, \d+/2", out), out
    inspected = json.loads(daemon.cli("-o", "json", "inspect", "on-tty", check=True).stdout)
    [term] = inspected["terminals"]
    assert term["controlling"] and len(term["fds"]) == 3 and term["path"].startswith("/dev/pts/"), term

    res = daemon.cli("restore", "on-tty", "--host-pidns")
    assert res.returncode == 4 and "without --host-pidns" in res.stderr, res.stderr
    # Issue 26, item 9: a --terminal the owner cannot open names itself and why, and no log CRIU never wrote.
    res = daemon.cli("-o", "json", "restore", "on-tty", "--terminal", str(tmp_path / "no-such-dir" / "out"))
    error = json.loads(res.stdout)["error"]
    assert res.returncode == 4 and error["reason"] == "TERMINAL", res.stderr
    assert "no-such-dir/out" in error["message"] and "No such file or directory" in error["message"], error
    assert "log" not in error["message"], error
    log = tmp_path / "worker.out"
    restored = json.loads(daemon.cli("-o", "json", "restore", "on-tty", "--terminal", str(log), check=True).stdout)
    wait_for(lambda: log.exists() and len(log.read_text().split()) >= 2, 30, "no output reached --terminal's file")
    first = [int(n) for n in log.read_text().split()]
    assert first == list(range(first[0], first[0] + len(first))), "it counts on from where it was dumped"
    assert os.stat(log).st_uid == inspected["owner_uid"], "the file is the snapshot owner's"
    [init] = _inits(snap[1])
    assert f"operation={restored['operation']}" in init.cmdline() and "name=on-tty" in init.cmdline()
    assert os.readlink(f"/proc/{restored['pid']}/fd/1").startswith("/dev/pts/")
    again = json.loads(daemon.cli("-o", "json", "restore", "on-tty", check=True).stdout)  # /dev/null by default
    assert psutil.Process(again["pid"]).is_running()
    for i in _inits(snap[1]):
        kill_tree(i.pid)


def readme_block(after: str) -> list[str]:
    """The lines a person types of the README's first ``sh`` block after the text ``after``."""
    text = (REPO / "README.md").read_text().split(after, 1)[1]
    return text.split("```sh\n", 1)[1].split("```", 1)[0].replace("\\\n", " ").splitlines()


def test_the_readme_fan_out_block_reaches_a_copys_port_from_the_host(shell: Shell, daemon: DaemonProc) -> None:
    """The Fan-out section's block, typed line by line: a copy of `--replicas` keeps its port on its own loopback,
    and `nsenter` into its network namespace reaches it from the host."""
    lines = readme_block("### Fan-out")
    assert any(line.startswith("nsenter --target $P --net ") for line in lines), lines
    for leftover in ("/tmp/web.log", "/tmp/copies"):
        Path(leftover).unlink(missing_ok=True)
    try:
        out = [shell.run(line) for line in lines]
        assert re.search(r"^snap-[a-z2-7]{26}$", out[2], re.M), shell.transcript
        assert out[5].strip() == "200", f"the copy did not answer on its port:\n{shell.transcript}"
        assert out[6].count("stopped PID") == 2, shell.transcript
        assert not [p for p in psutil.process_iter(["cmdline"]) if "name=web" in (p.info["cmdline"] or [])]
    finally:
        for i in [p for p in psutil.process_iter(["cmdline"]) if "name=web" in (p.info["cmdline"] or [])]:
            kill_tree(i.pid)
        for leftover in ("/tmp/web.log", "/tmp/copies"):
            Path(leftover).unlink(missing_ok=True)
