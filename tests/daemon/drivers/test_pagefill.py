"""A restored tree's private pages filled by several threads (``daemon/drivers/pagefill.py``), through real CRIU: the
memory comes back equal, holes stay zero, every process of a tree is filled, and a fill that cannot finish
kills the tree before any of it runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import TcpMode
from gpusnap.daemon.drivers import pagefill, proc
from gpusnap.daemon.drivers.criu import CriuDriver, CriuError, RestoredTree
from tests.conftest import criu_prefix, kill_tree, wait_for
from tests.starts import starts

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
MIB = 1 << 20


def _driver(threads: int) -> CriuDriver:
    setting = pagefill.Setting(threads) if threads else pagefill.OFF
    return CriuDriver(str(criu_prefix() / "bin" / "criu"), str(criu_prefix() / "python"), page_fill=setting)


@pytest.fixture
@starts("workload", "criu")
def dumped(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A dumped (and ended) anon_regions.py workload: 3 regions of 16 MiB, a sparse 32 MiB region, and a child
    that forked after the fill (its pages copy-on-write from the parent's until it writes its own);
    yields (images directory, workload directory)."""
    wd = tmp_path / "w"
    wd.mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOADS / "anon_regions.py"), str(wd), "--regions", "3", "--mb", "16"]
        + ["--sparse-mb", "32", "--fork-child"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(lambda: (wd / "ready").exists(), 60, "the workload did not start")
        images = tmp_path / "images"
        images.mkdir()
        _driver(0).dump(
            pid=proc.pid,
            images_dir=images,
            work_dir=tmp_path,
            leave_running=False,
            tcp=TcpMode.REFUSE,
            freeze_timeout_s=10,
            timeout_s=120,
        )
        proc.wait(timeout=30)
        # its child's zombie still holds the session's ID, the parent's PID, until it is reaped
        wait_for(lambda: not _in_session(proc.pid), 30, "the dumped tree's child was not reaped")
        yield images, wd
    finally:
        kill_tree(proc.pid)


def _restore(tmp_path: Path, images: Path, threads: int, new_pidns: bool, **kw: object) -> RestoredTree:
    return _driver(threads).restore(
        images_dir=images,
        work_dir=tmp_path,
        log_name="restore.log",
        new_pidns=new_pidns,
        tcp=TcpMode.REFUSE,
        timeout_s=120,
        criu_dir=tmp_path / "criu-work",
        **kw,  # type: ignore[arg-type]
    )


def _root(tree: RestoredTree) -> int:
    if not tree.init_pid:
        return tree.ns_pid
    children = Path(f"/proc/{tree.init_pid}/task/{tree.init_pid}/children").read_text().split()
    return int(children[0])


def _end(tree: RestoredTree) -> None:
    kill_tree(tree.init_pid or tree.ns_pid)


def _hashes_now(wd: Path, root: int) -> tuple[str, str]:
    """The restored parent's and child's hashes of their memory, as they read it now."""
    for name in ("sha_now", "child_sha_now"):
        (wd / name).unlink(missing_ok=True)
    os.kill(root, signal.SIGUSR1)  # the parent re-hashes, then signals its child to
    wait_for(lambda: (wd / "sha_now").exists() and (wd / "child_sha_now").exists(), 120, "no hash from the tree")
    return (wd / "sha_now").read_text(), (wd / "child_sha_now").read_text()


@pytest.mark.parametrize("new_pidns", [True, False], ids=["own-pidns", "host-pidns"])
def test_filled_memory_is_the_dumped_memory(tmp_path: Path, dumped: tuple[Path, Path], new_pidns: bool) -> None:
    images, wd = dumped
    stopped = []

    def before_resume(t: RestoredTree) -> None:  # the fill is done, the tasks have not run yet
        found = (
            [p for p in proc.tree_pids(t.init_pid) if proc.namespace_pid(p) == t.ns_pid] if t.init_pid else [t.ns_pid]
        )
        stopped.append(Path(f"/proc/{found[0]}/stat").read_text().rsplit(")", 1)[1].split()[0])

    tree = _restore(tmp_path, images, 2, new_pidns, before_resume=before_resume)
    try:
        assert tree.page_fill is not None and tree.page_fill.threads == 2, tree
        assert tree.page_fill.processes == 2  # the parent and its child, each with its own userfaultfd
        assert tree.page_fill.bytes >= 2 * 3 * 16 * MIB  # every region, in both (the child's own copies)
        assert stopped == ["t"], stopped  # traced-stopped: CRIU holds it until pre-resume is answered
        parent, child = _hashes_now(wd, _root(tree))
        assert parent == (wd / "expected_sha").read_text()
        assert child == (wd / "child_expected_sha").read_text()
        assert not (tmp_path / "criu-work").exists()  # CRIU's private directory goes
        assert "lazy" in (tmp_path / "restore.log").read_text()  # the log stays where the caller looks
    finally:
        _end(tree)


def test_without_threads_crius_own_reads_restore_it(tmp_path: Path, dumped: tuple[Path, Path]) -> None:
    """``page_fill_threads = -1`` is plain CRIU: no fill, the same memory."""
    images, wd = dumped
    tree = _restore(tmp_path, images, 0, True)
    try:
        assert tree.page_fill is None
        assert _hashes_now(wd, _root(tree))[0] == (wd / "expected_sha").read_text()
    finally:
        _end(tree)


@pytest.mark.parametrize("new_pidns", [True, False], ids=["own-pidns", "host-pidns"])
def test_a_fill_that_cannot_finish_kills_the_tree_before_it_runs(
    tmp_path: Path, dumped: tuple[Path, Path], new_pidns: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fill's copies fail after the first three (``failing_fill_helper.py`` stands in for the helper): the
    restore fails naming the fill, gpusnapd is never asked to let the tree run, and no process of the tree is
    left (none ran: the tasks are killed while CRIU holds them)."""
    images, wd = dumped
    driver = _driver(2)

    def spawn() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("failing_fill_helper.py")), *driver.command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=driver._env(),
            start_new_session=True,
        )

    monkeypatch.setattr(driver, "_spawn", spawn)
    asked = []
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    with pytest.raises(CriuError, match="filling the restored tree's pages failed: .*injected by the test"):
        driver.restore(
            images_dir=images,
            work_dir=tmp_path,
            log_name="restore.log",
            new_pidns=new_pidns,
            tcp=TcpMode.REFUSE,
            timeout_s=120,
            criu_dir=tmp_path / "criu-work",
            before_resume=asked.append,
        )
    assert asked == []  # the tree was never offered to run
    wait_for(lambda: not _restored(before, wd), 10, f"restored processes left: {_restored(before, wd)}")
    assert not (tmp_path / "criu-work").exists()


def _restored(before: set[str], wd: Path) -> list[str]:
    """Processes of the workload in ``wd`` that were not running at ``before`` (the source was ended by its dump)."""
    return [p for p in os.listdir("/proc") if p.isdigit() and p not in before and str(wd) in _cmdline(p)]


def _in_session(sid: int) -> list[str]:
    """Processes (zombies too) of session ``sid``."""
    found = []
    for p in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if p.isdigit() and int(stat.rsplit(")", 1)[1].split()[3]) == sid:
            found.append(p)
    return found


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_the_probe_says_why_not_or_nothing() -> None:
    """On this host userfaultfd and CRIU's events are there (the CI kernel has them): the probe says nothing."""
    assert pagefill.probe() == ""


def test_a_run_across_adjacent_vmas_is_cut_where_each_ends() -> None:
    """A pagemap entry can span two adjacent VMAs (a thread's stack and the mapping after it); one UFFDIO_COPY
    cannot (ENOENT), so the run is cut at every VMA end inside it, keeping its image offsets."""
    run = pagefill.Run(vaddr=0x1000, offset=0x8000, length=0x5000)
    assert list(pagefill._split(run, [0x2000, 0x3000, 0x9000])) == [
        pagefill.Run(0x1000, 0x8000, 0x1000),
        pagefill.Run(0x2000, 0x9000, 0x1000),
        pagefill.Run(0x3000, 0xA000, 0x3000),
    ]
    assert list(pagefill._split(run, [0x1000, 0x6000])) == [run]
