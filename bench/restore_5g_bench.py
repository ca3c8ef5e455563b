"""make bench-restore-5g: a multi-GB CPU worker restored by gpusnap, by plain CRIU and copied, in one run.

The worker is tests/daemon/workloads/anon_regions.py with ``--anon-mb`` MiB of dirty private anonymous memory
(256 MiB regions, as a Python/torch heap's large allocations) and a ``--shm-mb`` MiB POSIX shared-memory segment
in /dev/shm (as vLLM's queues), 4 GiB + 1 GiB by default. gpusnapd's store is on a tmpfs (a RAM tier for images:
plain CRIU gets the same images from the same tmpfs). The worker is checkpointed once by gpusnap (a default dump,
which ends it); then, round by round, in an order rotated each round so that load drifts hit all alike, each
step after 1.25 times the worker's bytes of fresh memory were touched and freed (``--pretouch``; this VM hands
freed memory back to its host, whose next touch is slow: bench/fresh_memory.py):

- ``criu``: plain ``criu restore -d`` of those images into this PID namespace, with the options gpusnapd gives
  CRIU; the segment is put back at its path first (untimed: plain CRIU reopens it by name, it copies nothing);
- ``gpusnap``: gpusnap's restore through its Python client (a fresh PID namespace, a private /dev/shm with its
  own copy of the segment: what ``gpusnap restore`` does), with gpusnapd's page fill as configured
  (``page_fill_threads``; ``--no-fill`` runs a second block with it off, ``-1``);
- ``copy``: the same bytes copied into fresh memory by this process, as fast as it can: the pages images
  ``preadv``-ed into a fresh anonymous mapping on one thread (what CRIU does per process) and on ``--threads``
  threads, and the segment copied into a fresh tmpfs file (``copy_file_range``).

Each restore is timed from its request to the worker's first answer (SIGUSR2 → WORKDIR/answer: a request that
touches almost no memory), and every restored worker's memory is hashed and compared with the source's
(untimed). The page leg's rate: for plain CRIU, the pages' bytes over its restore (an upper bound on its page
time: a lower bound on the rate); for gpusnap, what its page fill reported (the pages' bytes and the private
/dev/shm files' it copied with them, over its own seconds); for ``copy``, the bytes over the copy. Results: ``bench/results/restore-5g-[<label>-]<date>.json`` with every sample,
min and median, ``gpusnap_over_criu`` (median restore → first request, gpusnap over plain CRIU) and the rates.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fresh_memory, results_file, vllm_runs  # noqa: E402
from bench.overhead_bench import _become_subreaper, _reap  # noqa: E402
from bench.plain_criu import OPTS as CRIU_OPTS  # noqa: E402
from bench.plain_criu import log_seconds as _criu_log_seconds  # noqa: E402
from tests.conftest import DaemonProc, criu_prefix, kill_tree, start_daemon, stop_daemon, wait_for  # noqa: E402

WORKLOAD = REPO / "tests" / "daemon" / "workloads" / "anon_regions.py"
REGION_MB = 256
MIB = 1 << 20


def _start_worker(wd: Path, anon_mb: int, shm_mb: int) -> subprocess.Popen[bytes]:
    wd.mkdir(parents=True)
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOAD), str(wd), "--regions", str(anon_mb // REGION_MB), "--mb", str(REGION_MB)]
        + ["--sparse-mb", "0", "--shm-mb", str(shm_mb), "--shm-name", f"gpusnap-bench-{os.getpid()}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "the worker did not fill its memory")
    if proc.poll() is not None:
        raise SystemExit(f"the worker exited with {proc.returncode}")
    return proc


def _reap_session(sid: int) -> None:
    """Reap until no process of session ``sid`` is left (a dumped worker's children, zombies too, keep its PID,
    the session's ID, in use: plain CRIU's restore into this PID namespace needs it)."""

    def members() -> list[int]:
        found = []
        for name in os.listdir("/proc"):
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if name.isdigit() and int(stat.rsplit(")", 1)[1].split()[3]) == sid:
                found.append(int(name))
        return found

    _reap(members())


def _first_answer(wd: Path, pid: int) -> None:
    """Send the worker its first request and wait for the answer."""
    os.kill(pid, signal.SIGUSR2)
    wait_for(lambda: (wd / "answer").exists(), 120, "the restored worker did not answer")


def _same_memory(wd: Path, pid: int) -> bool:
    (wd / "sha_now").unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    wait_for(lambda: (wd / "sha_now").exists(), 600, "the restored worker did not hash its memory")
    return (wd / "sha_now").read_text() == (wd / "expected_sha").read_text()


def _restore_criu(images: Path, wd: Path, segment: tuple[Path, Path]) -> dict[str, Any]:
    saved, path = segment
    shutil.copyfile(saved, path)  # plain CRIU reopens the segment by its name (untimed), checking its mode
    os.chmod(path, 0o600)  # as the worker made it
    pidfile = images.parent / "criu-restore.pid"
    pidfile.unlink(missing_ok=True)
    (wd / "answer").unlink(missing_ok=True)
    log = "criu-restore-bench.log"
    t = time.perf_counter()
    res = subprocess.run(
        [str(criu_prefix() / "bin" / "criu"), "restore", "-d", "-D", str(images), "-W", str(images.parent)]
        + ["-o", log, "--pidfile", str(pidfile), *CRIU_OPTS],
        capture_output=True,
    )
    if res.returncode != 0:
        raise SystemExit(f"plain CRIU's restore failed: {(images.parent / log).read_text()[-2000:]}")
    restored = time.perf_counter() - t
    pid = int(pidfile.read_text())
    try:
        _first_answer(wd, pid)
        total = time.perf_counter() - t
        same = _same_memory(wd, pid)
    finally:
        kill_tree(pid)
        _reap_session(pid)  # the worker leads its session: its children's zombies keep the PID too
        path.unlink(missing_ok=True)
    return {
        "restore_to_first_request_s": total,
        "restore_s": restored,
        "criu_log_s": _criu_log_seconds(images.parent / log),
        "same_memory": same,
    }


def _restore_gpusnap(daemon: DaemonProc, client: Any, snap: str, wd: Path) -> dict[str, Any]:
    (wd / "answer").unlink(missing_ok=True)
    t = time.perf_counter()
    op = client.wait(client.restore(snap).id)
    restored = time.perf_counter() - t
    if op.error or op.restore is None:
        raise SystemExit(f"gpusnap's restore failed: {op.error}")
    pid = op.restore.pid
    try:
        _first_answer(wd, pid)
        total = time.perf_counter() - t
        same = _same_memory(wd, pid)
    finally:
        client.stop_restored_tree(operation_id=op.id)
    phases = {p.phase: p.duration_seconds for p in op.phases}
    filled = vllm_runs.page_fill(vllm_runs.messages(daemon, op.id))
    out: dict[str, Any] = {
        "restore_to_first_request_s": total,
        "restore_s": restored,
        "phases": phases,
        "same_memory": same,
    }
    if filled:
        out["page_fill"] = filled
    return out


def _copy_pages(pages: list[Path], threads: int) -> float:
    """Seconds to ``preadv`` every pages image into one fresh anonymous mapping, split over ``threads``."""
    total = sum(p.stat().st_size for p in pages)
    dst = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    jobs: list[tuple[Path, int, int, int]] = []  # (file, file offset, destination offset, bytes)
    at = 0
    for p in pages:
        size = p.stat().st_size
        share = -(-size // threads)
        jobs.extend((p, off, at + off, min(share, size - off)) for off in range(0, size, share))
        at += size
    view = memoryview(dst)

    def read(job: tuple[Path, int, int, int]) -> None:
        path, off, into, n = job
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                step = min(n - done, 64 * MIB)
                done += os.preadv(fd, [view[into + done : into + done + step]], off + done)
        finally:
            os.close(fd)

    def read_all(share: list[tuple[Path, int, int, int]]) -> None:
        for job in share:
            read(job)

    t = time.perf_counter()
    workers = [threading.Thread(target=read_all, args=(share,)) for share in _split(jobs, threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    view.release()
    dst.close()
    return seconds


def _split(jobs: list[Any], n: int) -> list[list[Any]]:
    return [jobs[i::n] for i in range(n)]


def _copy_segment(saved: Path, into: Path) -> float:
    """Seconds to copy the segment into a fresh file on the tmpfs ``into`` is on (``copy_file_range``)."""
    t = time.perf_counter()
    with open(saved, "rb") as src, open(into, "wb") as dst:
        left = os.fstat(src.fileno()).st_size
        while left:
            left -= os.copy_file_range(src.fileno(), dst.fileno(), left)
    seconds = time.perf_counter() - t
    into.unlink()
    return seconds


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values)}


def _run_rounds(
    rounds: int,
    steps: dict[str, Callable[[], dict[str, Any]]],
    samples: dict[str, list[dict[str, Any]]],
    pretouch_bytes: int = 0,
) -> None:
    names = list(steps)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            time.sleep(1.0)  # let the last step's memory go back before the next one takes it
            fresh_memory.touch(pretouch_bytes)  # ... and be the guest's again (bench/fresh_memory.py)
            r = steps[name]()
            samples.setdefault(name, []).append(r)
            print(f"round {i} {name}: {_brief(r)}", flush=True)


def _pretouch_bytes(a: Any) -> int:
    """Fresh memory touched before each step: ``--pretouch`` times the worker's bytes."""
    return int((a.anon_mb + a.shm_mb) * MIB * a.pretouch)


def _brief(r: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--anon-mb", type=int, default=4096)
    ap.add_argument("--shm-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tmpfs", default="/dev/shm", help="where gpusnapd's store and the copies go")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads of the copy")
    ap.add_argument("--no-fill", action="store_true", help="also a block with page_fill_threads = -1")
    ap.add_argument(
        "--pretouch",
        type=float,
        default=1.25,
        help="before each step, touch and free this many times the worker's bytes of fresh memory (0: none)",
    )
    results_file.add_arguments(ap)
    a = ap.parse_args()
    _become_subreaper()
    root = Path(tempfile.mkdtemp(prefix="gpusnap-restore-5g-", dir=a.tmpfs))
    work = Path(tempfile.mkdtemp(prefix="gpusnap-restore-5g-"))
    samples: dict[str, list[dict[str, Any]]] = {}
    daemon = None
    worker = None
    try:
        daemon = start_daemon(root / "d")
        client = daemon.client()
        wd = work / "w"  # not under /dev/shm: a restored tree gets a private one, where its files would be missing
        worker = _start_worker(wd, a.anon_mb, a.shm_mb)
        op = client.wait(client.checkpoint(worker.pid).id)
        if op.error:
            raise SystemExit(f"gpusnap's checkpoint failed: {op.error}")
        worker.wait()
        _reap_session(worker.pid)
        if op.snapshot is None:
            raise SystemExit("gpusnap's checkpoint made no snapshot")
        snap = op.snapshot.id
        images = daemon.store / "snapshots" / snap / "images"
        pages = sorted(images.glob("pages-*.img"))
        saved = next((images / "dev-shm").iterdir())
        segment = (saved, Path("/dev/shm") / saved.name)
        page_bytes = sum(p.stat().st_size for p in pages)
        first = daemon
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "criu": lambda: _restore_criu(images, wd, segment),
            "gpusnap": lambda: _restore_gpusnap(first, client, snap, wd),
            "copy": lambda: {
                "pages_1_thread_s": _copy_pages(pages, 1),
                f"pages_{a.threads}_threads_s": _copy_pages(pages, a.threads),
                "segment_s": _copy_segment(saved, root / "segment-copy"),
            },
        }
        touch = _pretouch_bytes(a)
        _run_rounds(a.rounds, steps, samples, touch)
        if a.no_fill:
            stop_daemon(daemon)
            second = daemon = start_daemon(root / "d", extra_env={"GPUSNAP_PAGE_FILL_THREADS": "-1"})
            client = daemon.client()
            _run_rounds(
                a.rounds,
                {"criu_2": steps["criu"], "gpusnap_no_fill": lambda: _restore_gpusnap(second, client, snap, wd)},
                samples,
                touch,
            )
    finally:
        if worker is not None and worker.poll() is None:
            kill_tree(worker.pid)
        if daemon is not None:
            stop_daemon(daemon)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    doc = _summary(samples, a, page_bytes, a.shm_mb * MIB)
    results_file.write(doc, "restore-5g", a.out, a.label)
    return 0 if all(r.get("same_memory", True) for rs in samples.values() for r in rs) else 1


def _summary(samples: dict[str, list[dict[str, Any]]], a: Any, page_bytes: int, shm_bytes: int) -> dict[str, Any]:
    first = {k: _stats([r["restore_to_first_request_s"] for r in v]) for k, v in samples.items() if k != "copy"}
    copy = {k: _stats([r[k] for r in samples["copy"]]) for k in samples["copy"][0]}
    fills = [r["page_fill"] for r in samples["gpusnap"] if "page_fill" in r]
    rates = {
        "criu_pages_gb_s": page_bytes / 1e9 / statistics.median(r["restore_s"] for r in samples["criu"]),
        "copy_pages_1_thread_gb_s": page_bytes / 1e9 / copy["pages_1_thread_s"]["median"],
        f"copy_pages_{a.threads}_threads_gb_s": page_bytes / 1e9 / copy[f"pages_{a.threads}_threads_s"]["median"],
        "copy_segment_gb_s": shm_bytes / 1e9 / copy["segment_s"]["median"],
    }
    if fills:
        # the fill's threads copy the private /dev/shm's large files too (daemon/drivers/privateshm.py)
        rates["gpusnap_page_fill_gb_s"] = statistics.median(
            (f["bytes"] + f.get("file_bytes", 0)) / 1e9 / f["seconds"] for f in fills
        )
        rates["gpusnap_page_fill_over_criu"] = rates["gpusnap_page_fill_gb_s"] / rates["criu_pages_gb_s"]
    doc: dict[str, Any] = {
        "worker": {"anon_bytes": a.anon_mb * MIB, "shm_bytes": shm_bytes, "page_image_bytes": page_bytes},
        "pretouch_bytes": _pretouch_bytes(a),
        "restore_to_first_request_s": first,
        "gpusnap_over_criu": first["gpusnap"]["median"] / first["criu"]["median"],
        "copy_s": copy,
        "page_leg_rates": rates,
        "samples": samples,
        "rounds": a.rounds,
    }
    if "gpusnap_no_fill" in first:
        doc["gpusnap_no_fill_over_criu"] = first["gpusnap_no_fill"]["median"] / first["criu_2"]["median"]
    return doc


if __name__ == "__main__":
    sys.exit(main())
