"""make bench-restore-candidates: ways to cut the CRIU restore of a multi-GB CPU image (issue 21, item 4).

The 8B worker's CPU image is 2.1 GB and its CRIU restore 0.9–1.9 s on the H200 (docs/performance.md): the
restorer reads every page into fresh anonymous memory, one 4 KiB fault at a time. The candidates, each
restored from the same dump in one run, interleaved round by round (``--rounds``), with plain CRIU (its
CLI, with the options gpusnapd gives it):

- ``disk``: the images on the store's disk, in the page cache (just written): today's restore (baseline);
- ``disk-cold``: the same files dropped from the page cache first (``POSIX_FADV_DONTNEED``): a restore from
  a disk tier that memory pressure evicted;
- ``tmpfs``: the images in a tmpfs (``--tmpfs``): a RAM tier for the images themselves;
- ``lazy``: the images in the tmpfs, restored with CRIU's lazy pages (``criu lazy-pages`` serving them over
  userfaultfd, ``criu restore --lazy-pages``): the restore returns before the memory is in; the rest comes
  on first touch and in the background.

The workload is tests/daemon/workloads/anon_regions.py: ``--regions`` × ``--mb`` MiB of dirty private
anonymous memory (the kind a Python/torch heap holds). For each restore: ``restore_s`` (the CRIU command's
wall time: the tree is running when it returns) and ``read_s`` (SIGUSR1 → the workload has re-hashed all of
its memory, checked equal to the source's). ``ready_s`` = ``restore_s`` + ``read_s`` − the baseline's
median ``read_s``: when the memory a worker needs is in (the CUDA restore reads the checkpointed device
memory, the canary the heap), which is what a lazy restore defers. Ratios are against ``disk`` medians of the
same run. JSON: bench/results/restore-candidates-[<label>-]<date>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from bench.overhead_bench import _reap  # noqa: E402
from bench.plain_criu import OPTS as CRIU_OPTS  # noqa: E402
from bench.plain_criu import binary as _criu  # noqa: E402
from bench.plain_criu import log_seconds as _criu_log_seconds  # noqa: E402
from tests.conftest import kill_tree, wait_for  # noqa: E402

WORKLOAD = REPO / "tests" / "daemon" / "workloads" / "anon_regions.py"
CANDIDATES = ("disk", "disk-cold", "tmpfs", "lazy")


def _start(wd: Path, a: argparse.Namespace) -> subprocess.Popen[bytes]:
    wd.mkdir(parents=True)
    cmd = [sys.executable, str(WORKLOAD), str(wd), "--regions", str(a.regions), "--mb", str(a.mb), "--sparse-mb", "0"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 300, "workload did not start")
    assert proc.poll() is None, f"workload exited {proc.returncode}"
    return proc


def _drop_cache(images: Path) -> None:
    for f in images.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _restore(candidate: str, images: Path, wd: Path) -> dict[str, Any]:
    """Restore ``images`` as ``candidate``; times, the memory check, then kill the tree."""
    pidfile = images / f"restored-{candidate}.pid"
    pidfile.unlink(missing_ok=True)
    log = f"restore-{candidate}.log"
    cmd = [_criu(), "restore", "-d", "-D", str(images), "-o", log, "--pidfile", str(pidfile), *CRIU_OPTS]
    server = None
    if candidate == "disk-cold":
        _drop_cache(images)
    if candidate == "lazy":
        server = subprocess.Popen(
            [_criu(), "lazy-pages", "-D", str(images), "-o", "lazy-pages.log", "-v4"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: (images / "lazy-pages.socket").exists() or server.poll() is not None, 30, "no lazy-pages")
        cmd.append("--lazy-pages")
    (wd / "sha_now").unlink(missing_ok=True)
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True)
    restore_s = time.perf_counter() - t
    if res.returncode != 0:
        errors = [ln for ln in (images / log).read_text().splitlines() if "Error" in ln]
        raise AssertionError(f"{candidate} restore failed: {errors[-3:]}")
    pid = int(pidfile.read_text())
    try:
        t = time.perf_counter()
        os.kill(pid, signal.SIGUSR1)
        wait_for(lambda: (wd / "sha_now").exists(), 300, f"{candidate}: the restored workload did not read its memory")
        read_s = time.perf_counter() - t
        same = (wd / "sha_now").read_text() == (wd / "expected_sha").read_text()
    finally:
        kill_tree(pid)
        _reap([pid])
        if server is not None:
            server.wait(timeout=60)
    assert same, f"{candidate}: restored memory differs from the source's"
    return {"restore_s": restore_s, "read_s": read_s, "criu_log_s": _criu_log_seconds(images / log), "sha_equal": same}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--tmpfs", default="/dev/shm")
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    results_file.add_arguments(ap)
    a = ap.parse_args()
    candidates = [c for c in a.candidates.split(",") if c]
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-restore-candidates-", dir=str(REPO / "build")))
    shm = Path(tempfile.mkdtemp(prefix="gpusnap-restore-candidates-", dir=a.tmpfs))
    samples: dict[str, list[dict[str, Any]]] = {c: [] for c in candidates}
    image_bytes = 0
    try:
        for i in range(a.rounds):
            wd = tmp / f"w{i}"
            proc = _start(wd, a)
            disk = tmp / f"img{i}"
            disk.mkdir()
            dump = [_criu(), "dump", "-t", str(proc.pid), "-D", str(disk), "-o", "dump.log", *CRIU_OPTS]
            subprocess.run(dump, check=True, capture_output=True)
            proc.wait()
            image_bytes = sum(f.stat().st_size for f in disk.iterdir())
            ram = shm / f"img{i}"
            shutil.copytree(disk, ram)
            order = candidates[i % len(candidates) :] + candidates[: i % len(candidates)]  # rotated each round
            for c in order:
                r = _restore(c, ram if c in ("tmpfs", "lazy") else disk, wd)
                samples[c].append(r)
                print(f"round {i} {c}: restore {r['restore_s']:.3f}s read {r['read_s']:.3f}s", flush=True)
            shutil.rmtree(disk, ignore_errors=True)
            shutil.rmtree(ram, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    med = {
        c: {k: statistics.median(s[k] for s in rs) for k in ("restore_s", "read_s", "criu_log_s")}
        for c, rs in samples.items()
        if rs
    }
    base = med.get("disk")
    for c, m in med.items():
        m["min_restore_s"] = min(s["restore_s"] for s in samples[c])
        if base is not None:
            m["ready_s"] = m["restore_s"] + m["read_s"] - base["read_s"]
            m["restore_over_disk"] = m["restore_s"] / base["restore_s"]
            m["ready_over_disk"] = m["ready_s"] / (base["restore_s"])
    doc = {
        "workload": {"regions": a.regions, "mb": a.mb, "image_bytes": image_bytes},
        "rounds": a.rounds,
        "load_average": os.getloadavg(),
        "medians": med,
        "samples": samples,
    }
    results_file.write(doc, "restore-candidates", a.out, a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
