"""Push and pull throughput against the real Ceph RADOS Gateway on loopback, with local disk as the
baseline in the same run. ``seconds``/``MiBps`` are whole CLI calls (process start included);
``upload_MiBps``/``download_MiBps`` are the transfer phases alone.

Node A dumps a process tree of ``--mib`` MiB of random memory (no two chunks alike) and pushes it; node B
pulls it; A pushes it again (every chunk already there). That is done ``--rounds`` times, each against a fresh
prefix; the medians are compared with a copy of the same image files on local disk (read, write, fsync)
the way a pull writes them. (Multipart uploads and ranged GETs of chunk parts were compared here too and
dropped: docs/fleet.md, "Multipart: measured and dropped".) Writes bench/results/remote-*.json.

    GPUSNAP_CRIU_PREFIX=.criu .venv/bin/python bench/remote_bench.py [--mib 256] [--threads 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import ceph_rgw  # noqa: E402
from tests.conftest import WORKLOADS, kill_tree, phase_seconds, start_daemon, stop_daemon, wait_for  # noqa: E402


def _copy_tree(src: Path, dst: Path) -> int:
    total = 0
    for path in sorted(src.rglob("*")):
        if path.is_file():
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as fi, open(target, "wb") as fo:
                shutil.copyfileobj(fi, fo, 16 << 20)
                fo.flush()
                os.fsync(fo.fileno())
            total += path.stat().st_size
    return total


def _cli(d: Any, *args: str) -> Any:
    return json.loads(d.cli("-o", "json", *args, check=True, timeout=600).stdout)


def _round(tmp: Path, gw: Any, s3: Any, a_dir: Path, snap: dict[str, Any], n: int, threads: int) -> Any:
    """Push from node A, pull on a fresh node B, push again, against a fresh prefix."""
    prefix = f"round{n}"
    env = {
        **gw.env(),
        "GPUSNAP_REMOTE": f"s3://bench/{prefix}",
        "GPUSNAP_REMOTE_ENDPOINT": gw.endpoint,
        "GPUSNAP_REMOTE_THREADS": str(threads),
    }
    b_dir = tmp / f"b{n}"
    b_dir.mkdir()
    a, b = start_daemon(a_dir, extra_env=env), start_daemon(b_dir, extra_env=env)
    try:

        def timed(d: Any, *cmd: str) -> tuple[float, Any]:
            t = time.monotonic()
            out = _cli(d, *cmd)
            return time.monotonic() - t, out

        mib = snap["size_bytes"] / 2**20
        push_s, pushed = timed(a, "push", snap["id"])
        pull_s, pulled = timed(b, "pull", snap["id"])
        repush_s, repushed = timed(a, "push", snap["id"])
    finally:
        stop_daemon(a)
        stop_daemon(b)
        shutil.rmtree(b_dir, ignore_errors=True)
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix):
            for obj in page.get("Contents", []):  # memstore keeps objects in the OSD's RAM
                s3.delete_object(Bucket="bench", Key=obj["Key"])
    return {
        "push": _leg(mib, push_s, pushed, "upload"),
        "pull": _leg(mib, pull_s, pulled, "download"),
        "push_again": {
            "seconds": round(repush_s, 3),
            "transferred_bytes": repushed["transferred_bytes"],
            "skipped_bytes": repushed["skipped_bytes"],
        },
    }


def _leg(mib: float, seconds: float, out: Any, phase: str) -> dict[str, Any]:
    """One timed push or pull: the whole CLI call and its transfer phase alone."""
    return {
        "seconds": round(seconds, 3),
        "MiBps": round(mib / seconds, 1),
        "phases": phase_seconds(out),
        f"{phase}_MiBps": round(mib / phase_seconds(out)[phase], 1),
        "transferred_bytes": out["transferred_bytes"],
    }


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-remote-", dir="/var/tmp"))
    gw = ceph_rgw.start()
    tree = None
    try:
        s3 = gw.s3_client()
        s3.create_bucket(Bucket="bench")
        a_dir = tmp / "a"
        a_dir.mkdir()
        a = start_daemon(a_dir)
        try:
            wd = tmp / "tree"
            wd.mkdir()
            tree = subprocess.Popen(
                [
                    sys.executable,
                    str(WORKLOADS / "tree.py"),
                    str(wd),
                    "--mem-mb",
                    str(args.mib),
                    "--random",
                    "--no-listener",
                    "--no-child",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            wait_for(lambda: (wd / "ready").exists(), 120, "tree did not start")
            snap = _cli(a, "dump", str(tree.pid))
        finally:
            stop_daemon(a)
        runs = [_round(tmp, gw, s3, a_dir, snap, r, args.threads) for r in range(args.rounds)]
        images = a_dir / "store" / "snapshots" / snap["id"] / "images"
        t = time.monotonic()
        _copy_tree(images, tmp / "disk-copy")
        disk_s = time.monotonic() - t
        mib = snap["size_bytes"] / 2**20
        up = mib / _median([r["push"]["phases"]["upload"] for r in runs])
        down = mib / _median([r["pull"]["phases"]["download"] for r in runs])
        res = {
            "snapshot_bytes": snap["size_bytes"],
            "median_upload_MiBps": round(up, 1),
            "median_download_MiBps": round(down, 1),
            "runs": runs,
            "local_disk_copy": {"seconds": round(disk_s, 3), "MiBps": round(mib / disk_s, 1)},
            "upload_vs_disk": round(up / (mib / disk_s), 3),
            "download_vs_disk": round(down / (mib / disk_s), 3),
        }
    finally:
        if tree is not None:
            kill_tree(tree.pid)
        gw.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "bench": "remote",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "mib": args.mib,
        "threads": args.threads,
        "rounds": args.rounds,
        "server": "Ceph RADOS Gateway 16.2 (Debian 12), memstore OSD, loopback",
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "results": res,
    }
    print(json.dumps(doc, indent=2))
    out = REPO / "bench" / "results" / f"remote-{datetime.now(UTC).strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
