"""make bench-thp: does MADV_HUGEPAGE on a worker's large anonymous memory make CRIU's restore faster?

Issue 12's "smaller, faster CRIU part": on the H200 the CRIU restore phase of an 8B worker took 1.86 s with
the host's THP in ``madvise`` mode and 0.98 s with ``always`` (docs/performance.md). gpusnap must not change
host-global settings, so the question is whether the per-VMA flag (VM_HUGEPAGE, set by
``madvise(MADV_HUGEPAGE)``) gets the restored memory 2 MiB pages, and the restore the speed of ``always``.
CRIU records the flag at dump (VmaEntry ``madv`` in mm-<pid>.img, from smaps' ``hg``) and applies it at
restore, in criu/pie/restorer.c after it has read the pages into the VMA (docs/performance.md).

The workload is tests/daemon/workloads/anon_regions.py: ``--regions`` × ``--mb`` MiB of dirty private anonymous
memory (the VMA kind of a Python/torch heap's large allocations) and a sparse ``--sparse-mb`` region with one
page in each 2 MiB (what huge pages would bloat). Variants, interleaved round by round:

- ``none``: no flag (the baseline);
- ``before-dump``: the workload madvises its regions after filling them, as an agent would right before a
  dump (the VMAs carry the flag, the pages are 4 KiB);
- ``before-fill``: madvised before the fill, so the source's pages are 2 MiB already;
- ``image``: no flag in the process; the bench sets the ``madv`` bit (1 << MADV_HUGEPAGE) of every private
  anonymous VMA of at least 2 MiB in the dumped mm images with pycriu.images, as a daemon could do at dump
  for trees with no agent (plain CRIU only: gpusnap's images are checksummed at dump).

Each variant is dumped and restored with plain CRIU (its CLI, with the options gpusnapd gives it: the floor;
``--criu-baseline`` picks the restoring binary), with ``--criu-patched`` (a CRIU built with
bench/criu-hugepage-before-read.patch, which applies MADV_HUGEPAGE before the pages are read), and with
gpusnap (client checkpoint, then restore; its ``restore`` phase is CRIU's restore). For each restore: wall
time, CRIU's own log time, the restored task's CPU time (the restore work done in it: premap, the
restorer's preadv and its page faults; steadier than wall time on a loaded host), the host's THP-fault and
compaction counters across it, the restored process's AnonHugePages and Rss (/proc/PID/smaps_rollup) right
after the restore and ``--settle`` seconds later (khugepaged collapses flagged VMAs in the background), and
the regions' sha256 against the source's. ``ceiling`` times the restorer's step alone (a fresh private
anonymous mapping, then preadv of a page-cached file into it) with MADV_HUGEPAGE before the read and without.

Results: bench/results/thp-[<label>-]<date>.json (every sample, min and median, ratios to ``none`` and of
the patched CRIU to the baseline).
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import re
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
from bench.overhead_bench import _become_subreaper, _reap, _stats, end_children  # noqa: E402
from bench.plain_criu import OPTS as CRIU_OPTS  # noqa: E402
from bench.plain_criu import binary as _criu  # noqa: E402
from bench.plain_criu import log_seconds as _criu_log_seconds  # noqa: E402
from tests.conftest import DaemonProc, criu_prefix, kill_tree, start_daemon, stop_daemon, wait_for  # noqa: E402

WORKLOAD = REPO / "tests" / "daemon" / "workloads" / "anon_regions.py"
VARIANTS = ("none", "before-dump", "before-fill", "image")
MADV_HUGEPAGE_BIT = 1 << mmap.MADV_HUGEPAGE
HUGE = 2 << 20
PRIVATE_ANON = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_ROLLUP = re.compile(rb"^(AnonHugePages|Rss):\s+(\d+) kB", re.M)


def thp_mode(knob: str = "enabled") -> str:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/``knob`` (``enabled``: ``always``, ``madvise``,
    ``never``; ``defrag``: also ``defer``, ``defer+madvise``)."""
    text = Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").read_text()
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unknown"


def rollup(pid: int) -> dict[str, int]:
    """AnonHugePages and Rss of ``pid`` in KiB, from /proc/PID/smaps_rollup."""
    raw = Path(f"/proc/{pid}/smaps_rollup").read_bytes()
    return {k.decode(): int(v) for k, v in _ROLLUP.findall(raw)}


VMSTAT_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "compact_success", "compact_fail")


def vmstat() -> dict[str, int]:
    """The THP-fault and compaction counters of /proc/vmstat (host-wide: other load adds to them)."""
    pairs = (line.split() for line in Path("/proc/vmstat").read_text().splitlines())
    return {k: int(v) for k, v in pairs if k in VMSTAT_KEYS}


def _delta(before: dict[str, int]) -> dict[str, int]:
    after = vmstat()
    return {k: after[k] - before.get(k, 0) for k in after}


def task_cpu_s(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used (/proc/PID/stat fields 14 and 15): for a process CRIU
    just restored, the restore work done in it (its premap, the restorer's preadv and page faults)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_children: list[subprocess.Popen[bytes]] = []


def _start(workdir: Path, hugepage: str, a: argparse.Namespace) -> subprocess.Popen[bytes]:
    workdir.mkdir(parents=True)
    cmd = [sys.executable, str(WORKLOAD), str(workdir), "--regions", str(a.regions), "--mb", str(a.mb)]
    cmd += ["--sparse-mb", str(a.sparse_mb)]
    proc = subprocess.Popen(
        [*cmd, "--hugepage", hugepage],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    _children.append(proc)
    wait_for(lambda: (workdir / "ready").exists() or proc.poll() is not None, 300, "workload did not start")
    assert proc.poll() is None, f"workload {workdir} exited {proc.returncode}"
    return proc


def _check_restored(pid: int, workdir: Path, settle: float) -> dict[str, Any]:
    """CPU time and rollup right after the restore, rollup ``settle`` s later, the regions' digest against
    the source's."""
    cpu = task_cpu_s(pid)
    now = rollup(pid)
    time.sleep(settle)
    later = rollup(pid)
    (workdir / "sha_now").unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    wait_for(lambda: (workdir / "sha_now").exists(), 120, f"restored {pid} did not re-hash its memory")
    same = (workdir / "sha_now").read_text() == (workdir / "expected_sha").read_text()
    assert same, f"restored memory of {pid} differs from the source's"
    return {
        "anon_huge_kib": now.get("AnonHugePages", 0),
        "rss_kib": now.get("Rss", 0),
        "anon_huge_kib_settled": later.get("AnonHugePages", 0),
        "rss_kib_settled": later.get("Rss", 0),
        "sha_equal": same,
        "restored_task_cpu_s": cpu,
    }


def flag_images(images: Path) -> int:
    """Set the MADV_HUGEPAGE bit of every private anonymous VMA of ≥ 2 MiB in ``images``/mm-*.img.

    Returns:
        How many VMAs were flagged.
    """
    sys.path.insert(0, str(criu_prefix() / "python"))
    import pycriu  # the CRIU prefix's; pycriu.images reads and writes CRIU's image files

    flagged = 0
    for path in glob.glob(str(images / "mm-*.img")):
        with open(path, "rb") as fh:
            img = pycriu.images.load(fh)
        for mm in img["entries"]:
            for vma in mm["vmas"]:
                if vma["flags"] & PRIVATE_ANON == PRIVATE_ANON and vma["end"] - vma["start"] >= HUGE:
                    vma["madv"] = int(vma.get("madv", 0)) | MADV_HUGEPAGE_BIT
                    flagged += 1
        with open(path, "wb") as fh:
            pycriu.images.dump(img, fh)
    return flagged


def plain_round(variant: str, tmp: Path, i: int, a: argparse.Namespace, restorer: str = "") -> dict[str, Any]:
    """Dump and restore one workload with the CRIU CLI (``restorer``: another CRIU binary for the restore)."""
    wd = tmp / f"criu{'-other' if restorer else ''}-{variant}-{i}"
    proc = _start(wd, "none" if variant == "image" else variant, a)
    source = rollup(proc.pid)
    images = tmp / f"criu-{variant}-{i}-img"
    images.mkdir()
    t = time.perf_counter()
    dump = [_criu(), "dump", "-t", str(proc.pid), "-D", str(images), "-o", "dump.log", *CRIU_OPTS]
    subprocess.run(dump, check=True, capture_output=True)
    dump_s = time.perf_counter() - t
    proc.wait()
    flagged = flag_images(images) if variant == "image" else 0
    pidfile = images / "restored.pid"
    time.sleep(a.gap)
    counters = vmstat()
    t = time.perf_counter()
    restore = [restorer or a.criu_baseline or _criu(), "restore", "-d", "-D", str(images), "-o", "restore.log"]
    res = subprocess.run([*restore, "--pidfile", str(pidfile), *CRIU_OPTS], capture_output=True)
    restore_s = time.perf_counter() - t
    during = _delta(counters)
    if res.returncode != 0:
        errors = [ln for ln in (images / "restore.log").read_text().splitlines() if "Error" in ln]
        raise AssertionError(f"plain CRIU restore failed: {errors[-3:]}")
    pid = int(pidfile.read_text())
    try:
        out = _check_restored(pid, wd, a.settle)
    finally:
        kill_tree(pid)
        _reap([pid])
    out.update(
        dump_s=dump_s,
        restore_s=restore_s,
        restore_log_s=_criu_log_seconds(images / "restore.log"),
        source_anon_huge_kib=source.get("AnonHugePages", 0),
        source_rss_kib=source.get("Rss", 0),
        image_vmas_flagged=flagged,
        vmstat_delta=during,
    )
    shutil.rmtree(images, ignore_errors=True)
    return out


def gpusnap_round(daemon: DaemonProc, variant: str, tmp: Path, i: int, a: argparse.Namespace) -> dict[str, Any]:
    """Checkpoint and restore one workload through gpusnapd's client."""
    client = daemon.client()
    wd = tmp / f"gs-{variant}-{i}"
    proc = _start(wd, variant, a)
    source = rollup(proc.pid)
    op = client.wait(client.checkpoint(proc.pid).id)
    proc.wait()
    assert op.snapshot is not None, op.error
    snap = op.snapshot.id
    time.sleep(a.gap)
    counters = vmstat()
    t = time.perf_counter()
    rop = client.wait(client.restore(snap).id)
    restore_s = time.perf_counter() - t
    during = _delta(counters)
    assert rop.restore is not None, rop.error
    pid = rop.restore.pid
    try:
        out = _check_restored(pid, wd, a.settle)
    finally:
        kill_tree(pid)
        _reap([pid])
    phases = {p.phase: p.duration_seconds for p in rop.phases}
    out.update(
        restore_s=restore_s,
        restore_phase_s=phases.get("restore", 0.0),
        restore_phases=phases,
        vmstat_delta=during,
        source_anon_huge_kib=source.get("AnonHugePages", 0),
        source_rss_kib=source.get("Rss", 0),
    )
    client.delete_snapshot(snap)
    return out


def ceiling(tmp: Path, size: int, runs: int) -> dict[str, Any]:
    """preadv of ``size`` bytes (a page-cached file, as a pages image after a dump) into a fresh private
    anonymous mapping, as CRIU's restorer does, without and with MADV_HUGEPAGE before the read."""
    data = tmp / "pages.bin"
    with open(data, "wb") as fh:
        block = bytes(range(256)) * 4096
        for _ in range(size // len(block)):
            fh.write(block)
    fd = os.open(data, os.O_RDONLY)
    samples: dict[str, list[float]] = {"no_flag": [], "flag_before_read": []}
    cpu: dict[str, list[float]] = {"no_flag": [], "flag_before_read": []}
    huge: dict[str, int] = {}
    counters: dict[str, list[dict[str, int]]] = {"no_flag": [], "flag_before_read": []}
    try:
        for _ in range(runs):
            for key in samples:
                before = vmstat()
                t, c = time.perf_counter(), time.process_time()
                m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                if key == "flag_before_read":
                    m.madvise(mmap.MADV_HUGEPAGE)
                got = os.preadv(fd, [m], 0)
                samples[key].append(time.perf_counter() - t)
                cpu[key].append(time.process_time() - c)
                counters[key].append(_delta(before))
                assert got == size, f"short read {got}"
                huge[key] = rollup(os.getpid()).get("AnonHugePages", 0)
                m.close()
    finally:
        os.close(fd)
        data.unlink()
    out: dict[str, Any] = {k: _stats(v) for k, v in samples.items()}
    out.update({f"{k}_cpu": _stats(v) for k, v in cpu.items()})
    out["anon_huge_kib"] = huge
    out["vmstat_delta"] = counters
    out["flag_vs_no_flag"] = round(out["flag_before_read"]["median_s"] / out["no_flag"]["median_s"], 3)
    out["flag_vs_no_flag_cpu"] = round(out["flag_before_read_cpu"]["median_s"] / out["no_flag_cpu"]["median_s"], 3)
    return out


def _summary(rounds: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {k: _stats([r[k] for r in rounds]) for k in (*keys, "restored_task_cpu_s")}
    for k in ("anon_huge_kib", "anon_huge_kib_settled", "rss_kib", "rss_kib_settled", "source_anon_huge_kib"):
        out[f"{k}_median"] = int(statistics.median(r[k] for r in rounds))
    for k in VMSTAT_KEYS:
        out[f"{k}_median"] = int(statistics.median(r["vmstat_delta"].get(k, 0) for r in rounds))
    return out


def _progress(side: str, variant: str, r: dict[str, Any]) -> None:
    keys = ("restore_s", "restore_phase_s", "restored_task_cpu_s", "anon_huge_kib", "rss_kib")
    print(json.dumps({side: variant, **{k: r[k] for k in keys if k in r}}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3, help="rounds (each runs every variant)")
    ap.add_argument("--regions", type=int, default=6, help="anonymous regions in the workload")
    ap.add_argument("--mb", type=int, default=256, help="MiB per region")
    ap.add_argument("--sparse-mb", type=int, default=64, help="MiB of a sparse region (one page per 2 MiB)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma separated: {', '.join(VARIANTS)}")
    ap.add_argument("--no-gpusnap", action="store_true", help="plain CRIU only")
    ap.add_argument("--gap", type=float, default=1.0, help="seconds of pause before each timed restore")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds before the second AnonHugePages reading")
    ap.add_argument(
        "--criu-baseline",
        default="",
        help="the CRIU binary of the criu side's restores (default: the CRIU prefix's); give the unpatched "
        "build of the same source as --criu-patched for a clean A/B",
    )
    ap.add_argument(
        "--criu-patched",
        default="",
        help="a CRIU binary built with MADV_HUGEPAGE applied before the restorer reads the pages (see "
        "docs/performance.md): its restores of the same variants run as a third side, criu_patched",
    )
    ap.add_argument("--no-write", action="store_true", help="print the summary only")
    results_file.add_arguments(ap)
    a = ap.parse_args()
    variants = a.variants.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cleanup below also runs on a plain kill
    _become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-thp-"))
    daemon = None if a.no_gpusnap else start_daemon(tmp / "daemon")
    result: dict[str, Any] = {
        "host": {"thp_enabled": thp_mode(), "thp_defrag": thp_mode("defrag"), "loadavg_start": os.getloadavg()[0]},
        "runs": a.runs,
        "workload_mib": a.regions * a.mb,
        "regions": a.regions,
        "sparse_mib": a.sparse_mb,
        "settle_s": a.settle,
        "criu_baseline": Path(a.criu_baseline).name if a.criu_baseline else "the CRIU prefix's",
        "criu_patched": Path(a.criu_patched).name,
    }
    plain: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    ours: dict[str, list[dict[str, Any]]] = {v: [] for v in variants if v != "image"}
    patched: dict[str, list[dict[str, Any]]] = {v: [] for v in variants} if a.criu_patched else {}
    try:
        result["ceiling"] = ceiling(tmp, a.regions * a.mb << 20, a.runs)
        print(json.dumps({"ceiling": result["ceiling"]}), flush=True)
        for i in range(a.runs):
            for v in variants:
                plain[v].append(plain_round(v, tmp, i, a))
                _progress("criu", v, plain[v][-1])
                if v in patched:
                    patched[v].append(plain_round(v, tmp, i, a, a.criu_patched))
                    _progress("criu_patched", v, patched[v][-1])
                if daemon is not None and v in ours:
                    ours[v].append(gpusnap_round(daemon, v, tmp, i, a))
                    _progress("gpusnap", v, ours[v][-1])
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        end_children(_children)
        shutil.rmtree(tmp, ignore_errors=True)
    result["criu"] = {v: _summary(r, ("dump_s", "restore_s", "restore_log_s")) for v, r in plain.items()}
    result["criu_patched"] = {v: _summary(r, ("restore_s", "restore_log_s")) for v, r in patched.items() if r}
    result["gpusnap"] = {v: _summary(r, ("restore_s", "restore_phase_s")) for v, r in ours.items() if r}
    for side, key in (("criu", "restore_s"), ("criu_patched", "restore_s"), ("gpusnap", "restore_phase_s")):
        for k in (key, "restored_task_cpu_s"):
            base = result[side].get("none", {}).get(k)
            for summary in result[side].values():
                if base:
                    summary[f"{k}_vs_none"] = round(summary[k]["median_s"] / base["median_s"], 3)
    if result["criu_patched"]:
        result["criu_patched_vs_criu"] = {
            v: {
                k: round(s[k]["median_s"] / result["criu"][v][k]["median_s"], 3)
                for k in ("restore_s", "restore_log_s", "restored_task_cpu_s")
            }
            for v, s in result["criu_patched"].items()
        }
    result["samples"] = {"criu": plain, "criu_patched": patched, "gpusnap": ours}
    result["host"]["loadavg_end"] = os.getloadavg()[0]
    brief = {
        side: {v: {k: s[k] for k in s if k.endswith("_vs_none") or k == "anon_huge_kib_median"} for v, s in d.items()}
        for side, d in ((k, result[k]) for k in ("criu", "criu_patched", "gpusnap"))
    }
    print(json.dumps({**brief, "criu_patched_vs_criu": result.get("criu_patched_vs_criu", {})}))
    if not a.no_write:
        results_file.write(result, "thp", a.out, a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
