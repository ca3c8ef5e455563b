"""The daemon's one executor (``gpusnap.daemon.executor``): each lane holds its bound, a task waiting on
another lane cannot deadlock it, and its shutdown leaves no thread behind -- also as a daemon's stop."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.executor import MAY_WAIT_ON, Executor, LaneSizes, current_lane
from gpusnap.daemon.server import build_daemon
from gpusnap.daemon.store import checksum, durable
from tests.conftest import criu_prefix
from tests.starts import starts

WAIT_S = 10.0


def _lane_threads(besides: set[threading.Thread]) -> list[str]:
    """The names of this process's live threads of any executor's lanes, but those in ``besides`` (the
    tests' own executor, ``tests.lanes``, may run in this process too)."""
    lanes = tuple(f"gpusnap-{name.replace('_', '-')}_" for name in MAY_WAIT_ON)
    return [t.name for t in threading.enumerate() if t.name.startswith(lanes) and t not in besides]


def test_every_lane_runs_at_most_its_bound_at_once() -> None:
    sizes = LaneSizes(rpc=3, buffer_jobs=2, buffer_io=2, digest=3, fsync=2, prefill=1)
    executor = Executor(sizes)
    try:
        for name, pool in executor.lanes().items():
            bound = getattr(sizes, name)
            running, peak, lock, go = [0], [0], threading.Lock(), threading.Event()

            def task(
                running: list[int] = running,
                peak: list[int] = peak,
                lock: threading.Lock = lock,
                go: threading.Event = go,
            ) -> None:
                with lock:
                    running[0] += 1
                    peak[0] = max(peak[0], running[0])
                go.wait(WAIT_S)
                with lock:
                    running[0] -= 1

            futures = [pool.submit(task) for _ in range(bound + 2)]
            deadline = time.monotonic() + WAIT_S
            while peak[0] < bound and time.monotonic() < deadline:  # the bound's threads start
                time.sleep(0.01)
            time.sleep(0.1)  # room for a thread over the bound to start, were there one
            assert peak[0] == bound, name
            go.set()
            for f in futures:
                f.result(WAIT_S)
            assert peak[0] == bound, name
    finally:
        assert executor.shutdown(WAIT_S) == []


def test_the_wait_graph_has_no_cycle_and_names_every_lane() -> None:
    executor = Executor()
    try:
        assert set(MAY_WAIT_ON) == set(executor.lanes())
        for lane, waits in MAY_WAIT_ON.items():
            assert set(waits) <= set(MAY_WAIT_ON), lane
            seen, todo = set(), list(waits)
            while todo:  # every lane reachable from ``lane`` by waits
                nxt = todo.pop()
                assert nxt != lane, f"{lane} may end up waiting on itself"
                if nxt not in seen:
                    seen.add(nxt)
                    todo.extend(MAY_WAIT_ON[nxt])
    finally:
        executor.shutdown(WAIT_S)


def test_a_full_lane_of_waiters_still_gets_its_work_done_on_the_other_lane() -> None:
    """Every ``buffer_jobs`` thread waits on ``buffer_io`` tasks (a capture's digest job, a verify); with more
    waiters queued than threads, all finish: the lane they wait on is never one of them. And a saturated
    ``buffer_io`` lane holds up no other lane."""
    executor = Executor(LaneSizes(buffer_jobs=2, buffer_io=1))
    try:

        def job(n: int) -> int:  # as BufferStore's digest job: submit to buffer_io, wait for it
            parts = [executor.buffer_io.submit(lambda i=i: n * 10 + i) for i in range(3)]
            return sum(p.result(WAIT_S) for p in parts)

        jobs = [executor.buffer_jobs.submit(job, n) for n in range(6)]
        assert [j.result(WAIT_S) for j in jobs] == [n * 30 + 3 for n in range(6)]

        release = threading.Event()
        held = [executor.buffer_io.submit(release.wait, WAIT_S) for _ in range(3)]  # buffer_io: full and queued
        others: list[Future[str]] = [
            executor.digest.submit(lambda: "digest"),
            executor.fsync.submit(lambda: "fsync"),
            executor.rpc.submit(lambda: "rpc"),
            executor.prefill.submit(lambda: "prefill"),
            executor.buffer_jobs.submit(lambda: "buffer_jobs"),
        ]
        assert [f.result(WAIT_S) for f in others] == ["digest", "fsync", "rpc", "prefill", "buffer_jobs"]
        assert not any(h.done() for h in held)
        release.set()
        assert all(h.result(WAIT_S) for h in held)
    finally:
        assert executor.shutdown(WAIT_S) == []


def test_shutdown_ends_every_lane_thread_and_refuses_new_work() -> None:
    executor = Executor(LaneSizes(rpc=2, buffer_jobs=2, buffer_io=2, digest=2, fsync=2, prefill=1))
    started = threading.Barrier(len(executor.lanes()) + 1)
    for pool in executor.lanes().values():
        pool.submit(started.wait, WAIT_S)
    started.wait(WAIT_S)  # one thread of every lane is running
    assert len(executor.threads()) >= len(executor.lanes())
    assert executor.shutdown(WAIT_S) == []
    assert executor.threads() == []
    with pytest.raises(RuntimeError):
        executor.digest.submit(time.sleep, 0)
    assert executor.shutdown(WAIT_S) == [], "idempotent"


def test_shutdown_waits_a_bounded_time_for_a_task_that_does_not_end() -> None:
    executor = Executor(LaneSizes(digest=1))
    stuck = threading.Event()
    executor.digest.submit(stuck.wait, WAIT_S)
    dropped = executor.digest.submit(time.sleep, 0)  # queued behind it: dropped by the shutdown
    start = time.monotonic()
    left = executor.shutdown(0.2)
    assert time.monotonic() - start < 2
    assert len(left) == 1 and left[0].startswith("gpusnap-digest_")
    assert dropped.cancelled()
    stuck.set()
    assert executor.shutdown(WAIT_S) == []


def test_a_lane_of_no_threads_is_refused() -> None:
    with pytest.raises(ValueError, match="fsync"):
        LaneSizes(fsync=0)


def test_a_task_about_to_wait_on_a_lane_it_may_not_fails_at_once_rather_than_hang(tmp_path: Path) -> None:
    """``check_wait`` enforces MAY_WAIT_ON where tasks wait: a digest task hashing on its own lane, or an
    fsync task fsyncing a tree on the fsync lane, raises instead of queueing behind itself."""
    (tmp_path / "f").write_bytes(b"x" * 4096)
    executor = Executor(LaneSizes(digest=1, fsync=1))
    try:
        own = executor.digest.submit(checksum.file_digests, [tmp_path / "f"], executor.digest)
        with pytest.raises(RuntimeError, match="'digest' lane is about to wait on its 'digest' lane"):
            own.result(WAIT_S)
        fsync = executor.fsync.submit(durable.fsync_tree, tmp_path, executor.fsync)
        with pytest.raises(RuntimeError, match="'fsync' lane is about to wait on its 'fsync' lane"):
            fsync.result(WAIT_S)
        allowed = executor.buffer_jobs.submit(checksum.file_digests, [tmp_path / "f"], executor.buffer_io)
        assert allowed.result(WAIT_S) == checksum.file_digests([tmp_path / "f"], executor.buffer_io)
        assert executor.rpc.submit(current_lane).result(WAIT_S) == "rpc" and current_lane() is None
    finally:
        executor.shutdown()


def test_fsync_tree_on_a_shut_down_lane_raises_and_leaves_nothing_running(tmp_path: Path) -> None:
    for i in range(20):
        (tmp_path / f"f{i}").write_bytes(b"x")
    executor = Executor()
    durable.fsync_tree(tmp_path, executor.fsync)
    executor.shutdown()
    with pytest.raises(RuntimeError):
        durable.fsync_tree(tmp_path, executor.fsync)
    assert executor.threads() == []


@starts("gpusnapd")
def test_the_daemons_stop_joins_every_lane_thread(tmp_path: Path) -> None:
    """A daemon built in this process: once its lanes have run work, :meth:`Running.stop` leaves none of
    their threads (nor its server's) alive."""
    before = set(threading.enumerate())
    sock_dir = Path(tempfile.mkdtemp(prefix="gpusnap-sock-"))
    prefix = criu_prefix()
    config = DaemonConfig(
        socket=sock_dir / "gpusnapd.sock",
        agent_socket=sock_dir / "agent.sock",
        store=tmp_path / "store",
        criu_binary=str(prefix / "bin" / "criu"),
        pycriu_path=str(prefix / "python"),
    )
    running = build_daemon(config)
    images = tmp_path / "images"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"x" * (3 << 20))
    store = running.daemon.deps.store
    assert [f.size_bytes for f in store.describe_images(images)] == [3 << 20]  # the digest lane
    for pool in running.executor.lanes().values():
        pool.submit(time.sleep, 0).result(WAIT_S)
    assert len(running.executor.threads()) >= len(MAY_WAIT_ON)
    running.stop(grace=1)
    shutil.rmtree(sock_dir, ignore_errors=True)
    assert running.executor.threads() == []
    assert _lane_threads(before) == []
    assert not any(t.name == "gpusnap-grpc" for t in threading.enumerate() if t not in before)
