"""A worker started with ``&`` from an interactive shell (a real pty, job control) is captured and restored:
its terminal is left behind at dump, and a restore gives the tree a terminal of its own whose output goes to
a file (or /dev/null), in a session of its own, under an init whose command line names the snapshot."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, DaemonProc, _cli_env, kill_tree, wait_for
from tests.pty_shell import Shell

COUNTER = "python3 -c 'import time,itertools; [print(i, flush=True) or time.sleep(1) for i in itertools.count()]'"


def readme_first_example() -> list[str]:
    """The README's first shell block after "In another shell:", continued lines joined: the lines a person
    types."""
    text = (REPO / "README.md").read_text()
    block = text.split("In another shell:", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return block.replace("\\\n", " ").splitlines()


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


def test_the_readme_first_example_as_typed_in_a_terminal(shell: Shell, daemon: DaemonProc) -> None:
    Path("/tmp/w.log").unlink(missing_ok=True)
    out = [shell.run(line) for line in readme_first_example()]
    dumped = re.search(r"^(snap-[a-z2-7]{26})$", out[2], re.M)
    assert dumped, f"dump printed no snapshot id:\n{shell.transcript}"
    assert "terminal /dev/pts/" in out[2] and "controlling terminal" in out[2], "the dump says what it left behind"
    before, after = out[3].split()
    assert before == after, f"the worker still counts after its dump:\n{shell.transcript}"
    assert "my-worker" in out[4] and dumped[1] in out[4]
    pid = int(re.search(r"^(\d+)$", out[5], re.M)[1])  # type: ignore[index]
    counted = [int(n) for n in out[6].split()]
    assert len(counted) == 3 and counted[0] > int(before) and counted == sorted(counted), shell.transcript
    [init] = _inits(dumped[1])
    assert psutil.Process(pid).ppid() == init.pid and init.name() == "gpusnap-init"
    assert os.getsid(pid) == init.pid != os.getsid(shell.pid), "the restored tree runs in a session of its own"
    assert f"snapshot={dumped[1]}" in init.cmdline() and "name=my-worker" in init.cmdline()
    shell.run(f"kill {pid}")  # the README's way to stop a restored tree: its root's PID, as restore printed it
    wait_for(lambda: not psutil.pid_exists(init.pid), 20, "the restored tree's init outlived its root")


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
