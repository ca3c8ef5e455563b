"""Bad input gets a specific error and exit code; the daemon keeps serving; nothing is lost."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import DataLossError, GpusnapError, InvalidArgumentError, NotFoundError
from gpusnap.daemon.store import checksum
from tests.conftest import DaemonProc, Workloads, _cli_env


def _still_serving(daemon: DaemonProc) -> None:
    assert daemon.alive()
    assert json.loads(daemon.cli("-o", "json", "node", check=True).stdout)["host"]["criu_version"].startswith("4.")


def _error(res: object) -> dict[str, object]:
    """The ``-o json`` error document of a failed CLI call (docs/errors.md)."""
    err = json.loads(res.stdout)["error"]  # type: ignore[attr-defined]
    assert isinstance(err, dict)
    return err


def _snapshot(daemon: DaemonProc, workloads: Workloads, name: str) -> dict[str, object]:
    w = workloads.start("--mem-mb", "4", "--no-listener", "--no-child")
    return json.loads(daemon.cli("-o", "json", "dump", str(w.pid), "--name", name, check=True).stdout)


@pytest.mark.parametrize(
    ("args", "code", "words", "reason", "action"),
    [
        (["dump", "4000000"], 3, "no process with PID 4000000", "PROCESS_NOT_FOUND", "fix"),
        (["dump", "1"], 2, "PID 1 is the init process", "INVALID_PID", "fix"),
        (["dump", "0"], 2, "not a valid PID", "INVALID_PID", "fix"),
        (["dump", "--", "-5"], 2, "not a valid PID", "INVALID_PID", "fix"),
        (["restore", "snap-aaaaaaaaaaaaaaaaaaaaaaaaaa"], 3, "no snapshot", "SNAPSHOT_NOT_FOUND", "fall_back"),
        (["inspect", "no-such-name"], 3, "no snapshot", "SNAPSHOT_NOT_FOUND", "fall_back"),
        (["restore", "../../etc/passwd"], 2, "neither a snapshot id", "INVALID_SNAPSHOT_REF", "fix"),
        (["inspect", "UPPER"], 2, "neither a snapshot id", "INVALID_SNAPSHOT_REF", "fix"),
        (["wait", "op-zzz"], 2, "invalid operation id", "INVALID_OPERATION_ID", "fix"),
        # echoed arguments are cut: a 100 kB one must not push the status past gRPC's metadata limit
        (["inspect", "A" * 100_000], 2, "neither a snapshot id", "INVALID_SNAPSHOT_REF", "fix"),
        (["wait", "op-" + "a" * 100_000], 2, "invalid operation id", "INVALID_OPERATION_ID", "fix"),
    ],
)
def test_bad_references(daemon: DaemonProc, args: list[str], code: int, words: str, reason: str, action: str) -> None:
    res = daemon.cli(*args)
    assert res.returncode == code, res.stderr
    assert words in res.stderr
    assert res.stderr.count("\n") == 1, "errors are one line"
    as_json = daemon.cli("-o", "json", *args)
    assert as_json.returncode == code
    err = _error(as_json)
    assert (err["reason"], err["action"]) == (reason, action), err
    _still_serving(daemon)


def test_rm_of_an_unknown_name(daemon: DaemonProc) -> None:
    res = daemon.cli("rm", "no-such-name")
    assert res.returncode == 3 and "no snapshot" in res.stderr
    assert res.stdout == "", "nothing deleted: no (empty) line on stdout"
    _still_serving(daemon)


def test_daemon_refuses_to_dump_itself(daemon: DaemonProc) -> None:
    res = daemon.cli("dump", str(daemon.proc.pid))
    assert res.returncode == 2 and "gpusnapd itself" in res.stderr
    res = daemon.cli("dump", str(os.getpid()))  # pytest is the daemon's ancestor
    assert res.returncode == 2
    _still_serving(daemon)


@pytest.mark.parametrize("name", ["Bad Name", "-dash", "x" * 64, "snap-aaaaaaaaaaaaaaaaaaaaaaaaaa", "a/b", ""])
def test_invalid_names(daemon: DaemonProc, workloads: Workloads, name: str) -> None:
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    res = daemon.cli("-o", "json", "dump", str(w.pid), "--name", name)
    if name == "":
        assert res.returncode == 0, "an empty name means unnamed"
        return
    assert res.returncode == 2 and "invalid snapshot name" in res.stderr
    assert _error(res)["reason"] == "INVALID_NAME"
    assert w.proc is not None and w.proc.poll() is None, "the source is untouched"


def test_invalid_label(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    res = daemon.cli("-o", "json", "dump", str(w.pid), "--label", "bad key=v")
    assert res.returncode == 2 and "invalid label key" in res.stderr
    assert _error(res)["reason"] == "INVALID_LABEL"
    assert daemon.cli("dump", str(w.pid), "--label", "novalue").returncode == 2
    for control in ("\x1b[31m", "\x7f", "\x9b31m", "\u202e"):  # ESC, DEL, 8-bit CSI, bidi override
        res = daemon.cli("-o", "json", "dump", str(w.pid), "--label", f"k=a{control}b")
        assert res.returncode == 2 and _error(res)["reason"] == "INVALID_LABEL", control


def test_duplicate_name_is_refused(daemon: DaemonProc, workloads: Workloads) -> None:
    _snapshot(daemon, workloads, "dup")
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    res = daemon.cli("-o", "json", "dump", str(w.pid), "--name", "dup")
    assert res.returncode == 5 and "already exists" in res.stderr
    assert _error(res)["reason"] == "NAME_TAKEN" and _error(res)["metadata"] == {"name": "dup"}
    assert w.proc is not None and w.proc.poll() is None


def test_corrupted_manifest(daemon: DaemonProc, workloads: Workloads) -> None:
    snap = _snapshot(daemon, workloads, "corrupt")
    manifest = daemon.store / "snapshots" / str(snap["id"]) / "manifest.json"
    manifest.write_text("{not json")
    res = daemon.cli("inspect", str(snap["id"]))
    assert res.returncode == 4 and "damaged" in res.stderr
    assert daemon.cli("restore", str(snap["id"])).returncode == 4
    assert json.loads(daemon.cli("-o", "json", "ls", check=True).stdout) == [], "a damaged snapshot is not listed"
    with pytest.raises(DataLossError) as err:
        daemon.client().get_snapshot(str(snap["id"]))
    assert err.value.reason == "MANIFEST_CORRUPT"
    assert err.value.metadata == {"snapshot": snap["id"], "file": "manifest.json"}
    assert err.value.action.value == "fall_back"
    assert daemon.cli("rm", str(snap["id"])).returncode == 0, "root can delete a damaged snapshot"
    _still_serving(daemon)


def _largest_image(daemon: DaemonProc, snap_id: str) -> Path:
    images = daemon.store / "snapshots" / snap_id / "images"
    return max(images.iterdir(), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_damaged_image_is_refused_before_restore(daemon: DaemonProc, workloads: Workloads, damage: str) -> None:
    snap = _snapshot(daemon, workloads, f"damaged-{damage}")
    image = _largest_image(daemon, str(snap["id"]))
    if damage == "truncate":
        os.truncate(image, image.stat().st_size // 2)
    elif damage == "delete":
        image.unlink()
    else:
        with open(image, "r+b") as fh:
            fh.seek(image.stat().st_size // 2)
            byte = fh.read(1)
            fh.seek(-1, os.SEEK_CUR)
            fh.write(bytes([byte[0] ^ 0xFF]))
    res = daemon.cli("-o", "json", "restore", str(snap["id"]))
    assert res.returncode == 4, res.stderr
    assert "damaged" in res.stderr and image.name in res.stderr
    err = _error(res)
    assert (err["reason"], err["action"]) == ("IMAGE_CHECKSUM", "fall_back")
    assert err["metadata"] == {"snapshot": snap["id"], "files": image.name, "damaged_count": "1"}
    ops = json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)
    failed = [o for o in ops if o["kind"] == "restore"][-1]
    # A page image's bytes are checked while CRIU restores, the tasks held at its pre-resume
    # (tests/daemon/test_restore_verify.py); a missing or cut file is refused before CRIU runs.
    page_data = damage == "flip" and checksum.RAW_PAGES.fullmatch(image.name)
    assert failed["state"] == "failed" and failed["phase"] == ("restore" if page_data else "verify")
    _still_serving(daemon)


def test_python_client_raises_domain_errors(daemon: DaemonProc) -> None:
    client = daemon.client()
    with pytest.raises(NotFoundError) as nf:
        client.checkpoint(4000000)
    assert nf.value.reason == "PROCESS_NOT_FOUND" and nf.value.metadata["pid"] == "4000000"
    with pytest.raises(InvalidArgumentError):
        client.restore("Not Valid")


_BAD_CONTEXTS: list[tuple[dict[str, object], str]] = [
    ({"env": {"1ABC": "x"}}, "environment variable name '1ABC'"),
    ({"env": {"A=B": "x"}}, "environment variable name 'A=B'"),
    ({"unset_env": ["PATH\0x"]}, "environment variable name"),
    ({"env": {"OK": "a\0b"}}, "no NUL byte"),
    ({"env": {"BIG": "x" * (33 << 10)}}, "at most 32 KiB"),
    ({"values": {"../port": "1"}}, "value key '../port'"),
    ({"env": {f"V{i}": "1" for i in range(300)}}, "more than 256 entries"),
]


def test_a_bad_restore_context_is_refused_before_anything_is_restored(daemon: DaemonProc, workloads: Workloads) -> None:
    """The worker applies its context only at resume, after CRIU and the GPU restore: a name
    ``os.environ`` refuses failed the whole restore there, at its end."""
    snap = _snapshot(daemon, workloads, "ctx")
    for context, words in _BAD_CONTEXTS:
        with pytest.raises(InvalidArgumentError, match="invalid restore context") as e:
            daemon.client().restore(str(snap["id"]), **context)  # type: ignore[arg-type]
        assert e.value.reason == "INVALID_RESTORE_CONTEXT" and words in str(e.value), str(e.value)
    res = daemon.cli("-o", "json", "restore", "ctx", "--env", "9=x")
    assert res.returncode == 2 and _error(res)["reason"] == "INVALID_RESTORE_CONTEXT", res.stderr
    ops = json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)
    assert not [o for o in ops if o["kind"] == "restore"], "no restore started"


def test_a_malformed_gpu_map_is_refused_on_a_node_without_gpus(daemon: DaemonProc, workloads: Workloads) -> None:
    """Issue 19 item 7: on a node without GPUs (this one) a GPU map was checked only against NVML inside
    the operation, so junk started an operation (journaled) before it failed, and a GPU node refused it at
    once. Its form is now checked before anything starts, on every node."""
    _snapshot(daemon, workloads, "cpu")
    junk = [{"junk": "x"}, {"0": "GPU-zz"}, {"1" * 5000: "0"}, {str(i): "0" for i in range(65)}]
    for gpu_map in junk:
        with pytest.raises(InvalidArgumentError) as e:
            daemon.client().restore("cpu", gpu_map=gpu_map)
        assert e.value.reason in ("INVALID_GPU_MAP", "INVALID_GPU_UUID") and len(str(e.value)) < 400, str(e.value)
        with pytest.raises(InvalidArgumentError):
            daemon.client().resume(os.getpid(), gpu_map=gpu_map)
    ops = json.loads(daemon.cli("-o", "json", "ops", check=True).stdout)
    assert not [o for o in ops if o["kind"] in ("restore", "resume")], "no operation started"
    with pytest.raises(GpusnapError) as e:  # well formed: the snapshot is then what says no
        daemon.client().restore("cpu", gpu_map={"0": "GPU-5d0f3b7c-1a2b-3c4d-5e6f-0123456789ab"}).wait()
    assert e.value.reason == "GPU_MAP_UNEXPECTED"


def test_unreachable_daemon_exit_code(tmp_path: Path) -> None:
    """No daemon: exit 7, the cause in words (not gRPC's "failed to connect to all addresses"), and, run in a
    checkout whose `make run` serves build/run/gpusnapd.sock without --socket, that socket named."""
    import socket
    import subprocess
    import sys

    def ls(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "gpusnap.daemon.cli", *args, "ls"]
        env = {k: v for k, v in _cli_env().items() if k != "GPUSNAP_SOCKET"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)

    res = ls("--socket", str(tmp_path / "none.sock"))
    assert res.returncode == 7, res
    assert f"cannot reach gpusnapd at {tmp_path / 'none.sock'}: there is no socket there" in res.stderr, res.stderr
    assert "failed to connect" not in res.stderr and "`make run` serves build/run/gpusnapd.sock" in res.stderr
    (tmp_path / "build" / "run").mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as served:  # a checkout's `make run` socket; --socket forgotten
        served.bind(str(tmp_path / "build" / "run" / "gpusnapd.sock"))
        served.listen()
        res = ls("--socket", "/run/gpusnap-none/gpusnapd.sock")
    said = " ".join(res.stderr.split())
    assert res.returncode == 7 and (
        "this checkout's `make run` serves build/run/gpusnapd.sock: pass --socket build/run/gpusnapd.sock" in said
    ), said


def test_tree_in_a_user_namespace_is_refused(daemon: DaemonProc) -> None:
    import subprocess

    proc = subprocess.Popen(
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "sleep", "600"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        import psutil

        from tests.conftest import wait_for

        wait_for(
            lambda: any(c.name() == "sleep" for c in psutil.Process(proc.pid).children(recursive=True)),
            10,
            "unshare did not start",
        )
        inner = next(c.pid for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "sleep")
        res = daemon.cli("-o", "json", "dump", str(inner))
        assert res.returncode == 4 and "user namespace" in res.stderr, res.stderr
        assert (_error(res)["reason"], _error(res)["action"]) == ("USER_NAMESPACE", "fix")
        assert psutil.Process(inner).is_running()
    finally:
        proc.kill()
        proc.wait()


def test_non_positive_timeouts_are_refused(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
    for flag in ("--timeout", "--gpu-lock-timeout"):
        for value in ("-1", "0", "nan", "inf"):
            res = daemon.cli("dump", str(w.pid), flag, value)
            assert res.returncode == 2 and "positive number of seconds" in res.stderr, res.stderr
    with pytest.raises(InvalidArgumentError, match="positive duration"):
        daemon.client().checkpoint(w.pid, timeout_s=-1)  # the daemon checks too
    assert w.proc is not None and w.proc.poll() is None


def test_trees_that_could_never_be_restored_are_refused(daemon: DaemonProc, tmp_path: Path) -> None:
    """A terminal, a pipe read outside the tree, a PID-namespace init, a thread, a kernel thread, a reserved label."""
    import subprocess
    import threading

    import psutil

    from tests.conftest import kill_tree, wait_for

    procs = []
    try:
        reader = subprocess.Popen(
            ["sh", "-c", "sleep 600 | cat > /dev/null"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(reader.pid)
        # (both children exist before each has exec'd its program: wait for the names, not the count)
        wait_for(
            lambda: sorted(c.name() for c in psutil.Process(reader.pid).children()) == ["cat", "sleep"],
            10,
            "pipeline did not start",
        )
        writer = next(c.pid for c in psutil.Process(reader.pid).children() if c.name() == "sleep")
        res = daemon.cli("-o", "json", "dump", str(writer))
        assert res.returncode == 4 and "pipe whose other end" in res.stderr, res.stderr
        assert _error(res)["reason"] == "EXTERNAL_PIPE"
        assert psutil.Process(writer).is_running()

        nsinit = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "setsid", "sleep", "600"],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(nsinit.pid)
        wait_for(lambda: bool(psutil.Process(nsinit.pid).children()), 10, "unshare did not start")
        init = psutil.Process(nsinit.pid).children()[0].pid
        res = daemon.cli("-o", "json", "dump", str(init))
        assert res.returncode == 4 and "init (PID 1) of its own PID namespace" in res.stderr, res.stderr
        assert _error(res)["reason"] == "PID_NAMESPACE_INIT"

        res = daemon.cli("dump", "2")
        assert res.returncode == 2 and "kernel thread" in res.stderr

        tid = threading.get_native_id()
        if tid != os.getpid():
            res = daemon.cli("dump", str(tid))
            assert res.returncode == 2, res.stderr
        other_thread = next((t.id for t in psutil.Process(daemon.proc.pid).threads() if t.id != daemon.proc.pid), None)
        if other_thread:
            res = daemon.cli("dump", str(other_thread))
            assert res.returncode == 2 and "is a thread of process" in res.stderr, res.stderr

        sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
        procs.append(sleeper.pid)
        res = daemon.cli("dump", str(sleeper.pid), "--label", "gpusnap.dev/tcp=bogus")
        assert res.returncode == 2 and "reserves" in res.stderr
    finally:
        kill_tree(*procs)


def test_json_errors_reach_stdout(daemon: DaemonProc) -> None:
    res = daemon.cli("-o", "json", "inspect", "no-such-snapshot")
    assert res.returncode == 3
    assert json.loads(res.stdout)["error"]["reason"] == "SNAPSHOT_NOT_FOUND"
    assert json.loads(res.stdout)["error"]["action"] == "fall_back"


def test_arguments_that_are_not_utf8(daemon: DaemonProc) -> None:
    """Bytes that are not UTF-8 in an argument (a label value from a Latin-1 script, a byte pasted from a
    binary) are a usage error naming the argument, not a Python traceback (exit 1)."""
    for args in (["inspect", "\udcff"], ["dump", "1", "--label", "k=\udc9b"]):  # raw 0xff / 0x9b bytes on argv
        res = daemon.cli(*args)
        assert res.returncode == 2, res.stderr
        assert "Traceback" not in res.stderr and "not valid UTF-8" in res.stderr, res.stderr
        assert "\\xff" in res.stderr or "\\x9b" in res.stderr, "the offending byte is shown escaped"
        assert res.stderr.count("\n") == 1
    _still_serving(daemon)
