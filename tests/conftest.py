"""Shared fixtures: a real gpusnapd on a temporary socket and store, real CRIU, real workloads."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpusnap.daemon.client import DaemonClient
from tests.shortdirs import remove_all, short_dir
from tests.starts import refused, started_by, starts

REPO = Path(__file__).resolve().parent.parent
WORKLOADS = Path(__file__).resolve().parent / "daemon" / "workloads"


def criu_prefix() -> Path:
    return Path(os.environ.get("GPUSNAP_CRIU_PREFIX", REPO / ".criu"))


needs_pycriu = pytest.mark.skipif(
    not (criu_prefix() / "python" / "pycriu").is_dir(),
    reason=f"pycriu missing under {criu_prefix()}: run `make criu` (make test does)",
)
"""For tests that read CRIU's messages or images through pycriu without running CRIU (``make test-fast`` on a
checkout that has run only ``make venv`` skips them)."""


@dataclass
class DaemonProc:
    """A gpusnapd subprocess; ``run_cli`` drives it through the real CLI."""

    socket: Path
    store: Path
    proc: subprocess.Popen[bytes]
    log: Path
    clients: list[DaemonClient] = field(default_factory=list)
    cli_argv: tuple[str, ...] = (sys.executable, "-m", "gpusnap.daemon.cli")
    env: dict[str, str] | None = None

    def client(self) -> DaemonClient:
        c = DaemonClient(self.socket)
        self.clients.append(c)
        return c

    def cli(
        self,
        *args: str,
        user: int | None = None,
        check: bool = False,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the CLI; ``env`` entries are added to (or, set to "", removed from) its environment."""
        cmd = [*self.cli_argv, "--socket", str(self.socket), *args]
        if user is not None:
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
        full = {k: v for k, v in {**(self.env or _cli_env()), **(env or {})}.items() if v != ""}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)
        if check and res.returncode != 0:
            raise AssertionError(f"{args} exited {res.returncode}: {res.stderr}")
        return res

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def agent_socket(self) -> Path:
        return self.socket.parent / "agent.sock"


def _cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@starts("gpusnapd")
def start_daemon(
    tmp: Path,
    extra_env: dict[str, str] | None = None,
    criu_binary: str | None = None,
    bin_dir: Path | None = None,
    base_env: dict[str, str] | None = None,
    socket_dir: Path | None = None,
    launcher: Path | None = None,
    socket_name: str = "gpusnapd.sock",
) -> DaemonProc:
    """Start gpusnapd with a socket in a world-traversable temp dir and a store under ``tmp``.

    ``launcher``: a script of this checkout that sets fakes up and runs gpusnapd's ``main`` (e.g.
    tests/daemon/prefill_daemon.py).

    ``bin_dir``: run the ``gpusnapd`` and ``gpusnap`` scripts installed there (with ``base_env`` instead
    of this interpreter's environment) rather than this checkout's modules.
    """
    sock_dir = socket_dir or short_dir("gpusnap-sock-")
    socket_path = sock_dir / socket_name
    store = tmp / "store"
    tmp.mkdir(parents=True, exist_ok=True)
    log = tmp / "gpusnapd.log"
    prefix = criu_prefix()
    env = {
        **(base_env or _cli_env()),
        "GPUSNAP_LOG_FORMAT": "json",
        "GPUSNAP_AGENT_SOCKET": str(sock_dir / "agent.sock"),
        **(extra_env or {}),
    }
    daemon_argv = (
        [str(bin_dir / "gpusnapd")]
        if bin_dir
        else [sys.executable, str(launcher)]
        if launcher
        else [sys.executable, "-m", "gpusnap.daemon.main"]
    )
    cmd = [
        *daemon_argv,
        "--socket",
        str(socket_path),
        "--store",
        str(store),
        "--criu",
        criu_binary or str(prefix / "bin" / "criu"),
        "--pycriu-path",
        str(prefix / "python"),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)
    d = DaemonProc(socket=socket_path, store=store, proc=proc, log=log)
    if bin_dir:
        d.cli_argv, d.env = (str(bin_dir / "gpusnap"),), base_env
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return d
        if socket_path.exists() and _healthy(socket_path):
            return d
        time.sleep(0.1)
    raise AssertionError(f"gpusnapd did not become healthy: {log.read_text()}")


def _healthy(socket_path: Path) -> bool:
    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def stop_daemon(d: DaemonProc) -> None:
    for c in d.clients:
        c.close()
    if d.alive():
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
    shutil.rmtree(d.socket.parent, ignore_errors=True)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path)
    assert d.alive(), d.log.read_text()
    yield d
    stop_daemon(d)
    if "Traceback" in d.log.read_text():
        pytest.fail(f"gpusnapd logged a traceback:\n{d.log.read_text()[-4000:]}")


@dataclass
class Workload:
    """A running workloads/tree.py process tree."""

    workdir: Path
    proc: subprocess.Popen[bytes] | None
    pid: int

    def read(self, name: str) -> str:
        return (self.workdir / name).read_text()

    def last(self, name: str) -> int:
        lines = self.read(name).split()
        return int(lines[-1]) if lines else 0


class Workloads:
    """Starts tree.py workloads and kills whatever is left at the end of the test."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.started: list[Workload] = []
        self.extra_pids: list[int] = []

    @starts("workload")
    def start(self, *args: str, user: int | None = None, name: str = "w") -> Workload:
        workdir = self.tmp / f"{name}{len(self.started)}"
        workdir.mkdir()
        cmd = [sys.executable, str(WORKLOADS / "tree.py"), str(workdir), *args]
        if user is not None:
            os.chmod(workdir, 0o777)
            cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        wait_for(lambda: (workdir / "ready").exists(), 60, f"workload {workdir} did not start")
        pid = proc.pid
        if user is not None:  # setpriv execs in place
            pid = proc.pid
        w = Workload(workdir, proc, pid)
        self.started.append(w)
        return w

    def adopt(self, pid: int) -> None:
        """Also kill ``pid`` (e.g. a restored tree) at the end."""
        self.extra_pids.append(pid)

    def spawn(
        self, argv: list[str], cwd: str | Path | None = None, stdout: int = subprocess.DEVNULL
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in a session of its own (stdin and stderr ``/dev/null``; ``stdout`` a descriptor or
        ``/dev/null``), killed with its tree at the end (:meth:`adopt`)."""
        proc = subprocess.Popen(
            argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self.adopt(proc.pid)
        return proc

    def cleanup(self) -> None:
        kill_tree(*self.extra_pids, *(w.pid for w in self.started))
        for w in self.started:
            if w.proc:
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass


@pytest.fixture
def workloads(tmp_path: Path) -> Iterator[Workloads]:
    ws = Workloads(tmp_path)
    yield ws
    ws.cleanup()


@contextlib.contextmanager
def criu_killed(daemon_pid: int, delay_s: float = 0.0, timeout_s: float = 600) -> Iterator[list[int]]:
    """Kill the first ``criu swrk`` under the daemon that serves a request, ``delay_s`` after it is seen;
    yields the PIDs killed. Serving: it has opened its log (a CRIU the spare helper started ahead waits
    for its request with no file open)."""
    import psutil

    killed: list[int] = []

    def killer() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not killed:
            try:
                procs = psutil.Process(daemon_pid).children(recursive=True)
            except psutil.Error:
                return
            for p in procs:
                try:
                    if "swrk" in " ".join(p.cmdline()) and any(f.path.endswith(".log") for f in p.open_files()):
                        time.sleep(delay_s)
                        p.kill()
                        killed.append(p.pid)
                        return
                except psutil.Error:
                    continue
            time.sleep(0.002)

    thread = threading.Thread(target=killer)
    thread.start()
    try:
        yield killed
    finally:
        thread.join()


def kill_tree(*pids: int) -> None:
    """SIGKILL each PID and its descendants, ignoring the ones already gone."""
    import psutil

    for pid in pids:
        if not pid:
            continue
        try:
            p = psutil.Process(pid)
            for c in p.children(recursive=True):
                c.kill()
            p.kill()
        except psutil.Error:
            pass


def phase_seconds(doc: Mapping[str, Any]) -> dict[str, float]:
    """The ``phases`` of a command's ``-o json`` (a list of ``{phase, duration_seconds, bytes}``, in the
    order they ran) as phase -> seconds."""
    return {p["phase"]: p["duration_seconds"] for p in doc["phases"]}


def wait_for(cond: object, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(message)


@pytest.fixture(scope="session")
def hostile() -> Iterator[tuple[Any, Any]]:
    """Two unprivileged users (``tests.users.User``) in one shared group, removed after the session."""
    from tests.users import hostile_users

    with hostile_users() as users:
        yield users


# The whole suite writes about 20 GiB under the temp dir over a run (CRIU images, buffer stores, a vLLM venv's
# server images), and its largest test about 4 GiB at once; pyproject.toml has pytest delete a passed test's
# tmp_path. A disk with less free than this fails every later test with ENOSPC and Ceph's monitor refuses to
# start: say so once, before anything starts.
MIN_FREE_GIB = 10


def pytest_sessionstart(session: pytest.Session) -> None:
    tmp = tempfile.gettempdir()
    free = shutil.disk_usage(tmp).free / (1 << 30)
    if free < MIN_FREE_GIB and not session.config.option.collectonly:
        pytest.exit(
            f"only {free:.1f} GiB free under {tmp}; the tests need about {MIN_FREE_GIB} GiB there (CRIU images, "
            f"buffer stores). Free space, e.g. `rm -rf {tmp}/pytest-of-$(id -un)` (earlier runs' kept "
            "directories), or point TMPDIR at a larger disk",
            returncode=3,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    remove_all()


# `make test-fast` runs `-m "not slow"`: a test is slow when it starts gpusnapd, CRIU, an engine or worker, a
# workload, a pip install, a Ceph gateway or test users, as its code shows (tests/starts.py); and a test that is
# not slow fails if it starts one of the first five all the same.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        what = _started(item)
        if what:
            item.add_marker(pytest.mark.slow(starts=sorted(what)))


def _started(item: pytest.Item) -> frozenset[str]:
    """What ``item`` starts: its own code's and its fixtures' starts."""
    found = started_by(getattr(item, "obj", None))
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixture in info.name2fixturedefs.get(name, ()) if info else ():
            found |= started_by(fixture.func)
    return found


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    if item.get_closest_marker("slow") or item.get_closest_marker("gpu"):
        return (yield)
    real = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        what = refused(shlex.split(args) if isinstance(args, str) else [args] if isinstance(args, bytes) else args)
        if what:
            raise AssertionError(
                f"{item.nodeid} starts {what} ({' '.join(map(str, args))[:160]}) but is not marked slow: mark the "
                "helper, fixture or test that starts it with @starts(...) (tests/starts.py), so that `make test-fast` "
                "leaves it out"
            )
        real(self, args, *rest, **kw)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    try:
        return (yield)
    finally:
        subprocess.Popen._execute_child = real  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def ceph_gateway() -> Iterator[object]:
    """A real Ceph RADOS Gateway for the session (tests/ceph_rgw.py); CI installs it (.ci/run)."""
    from tests import ceph_rgw

    missing = ceph_rgw.available()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    gw = ceph_rgw.start()
    yield gw
    gw.stop()
