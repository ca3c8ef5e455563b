"""Push and pull throughput against the real Ceph RADOS Gateway on loopback, with local disk as the
baseline in the same run. ``seconds``/``MiBps`` are whole CLI calls (process start included);
``upload_MiBps``/``download_MiBps`` are the transfer phases alone.

Node A dumps a process tree of ``--mib`` MiB of random memory (no two chunks alike) and pushes it; node B
pulls it; A pushes it again (every chunk already there). The baseline copies the same image files on
local disk (read, write, fsync) the way a pull writes them. Writes bench/results/remote-*.json.

    GPUSNAP_CRIU_PREFIX=.criu .venv/bin/python bench/remote_bench.py [--mib 384] [--threads 8]
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
from tests.conftest import WORKLOADS, kill_tree, start_daemon, stop_daemon, wait_for  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=384)
    ap.add_argument("--threads", type=int, default=8)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-remote-", dir="/var/tmp"))
    gw = ceph_rgw.start()
    nodes = []
    tree = None
    try:
        import boto3
        from botocore.config import Config

        boto3.client(
            "s3",
            endpoint_url=gw.endpoint,
            region_name=ceph_rgw.REGION,
            aws_access_key_id=ceph_rgw.ACCESS_KEY,
            aws_secret_access_key=ceph_rgw.SECRET_KEY,
            config=Config(s3={"addressing_style": "path"}),
        ).create_bucket(Bucket="bench")
        env = {
            **gw.env(),
            "GPUSNAP_REMOTE": "s3://bench/fleet",
            "GPUSNAP_REMOTE_ENDPOINT": gw.endpoint,
            "GPUSNAP_REMOTE_THREADS": str(args.threads),
        }
        for name in ("a", "b"):
            (tmp / name).mkdir()
            nodes.append(start_daemon(tmp / name, extra_env=env))
        a, b = nodes
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
        size = snap["size_bytes"]

        def timed(d: Any, *cmd: str) -> tuple[float, Any]:
            t = time.monotonic()
            out = _cli(d, *cmd)
            return time.monotonic() - t, out

        push_s, pushed = timed(a, "push", snap["id"])
        pull_s, pulled = timed(b, "pull", snap["id"])
        repush_s, repushed = timed(a, "push", snap["id"])
        images = a.store / "snapshots" / snap["id"] / "images"
        t = time.monotonic()
        _copy_tree(images, tmp / "disk-copy")
        disk_s = time.monotonic() - t
        mib = size / 2**20
        res = {
            "snapshot_bytes": size,
            "push": {
                "seconds": round(push_s, 3),
                "MiBps": round(mib / push_s, 1),
                "phases": pushed["phases"],
                "upload_MiBps": round(mib / pushed["phases"]["upload"], 1),
                "transferred_bytes": pushed["transferred_bytes"],
            },
            "pull": {
                "seconds": round(pull_s, 3),
                "MiBps": round(mib / pull_s, 1),
                "phases": pulled["phases"],
                "download_MiBps": round(mib / pulled["phases"]["download"], 1),
                "transferred_bytes": pulled["transferred_bytes"],
            },
            "push_again": {
                "seconds": round(repush_s, 3),
                "transferred_bytes": repushed["transferred_bytes"],
                "skipped_bytes": repushed["skipped_bytes"],
            },
            "local_disk_copy": {"seconds": round(disk_s, 3), "MiBps": round(mib / disk_s, 1)},
            "upload_vs_disk": round(disk_s / pushed["phases"]["upload"], 3),
            "download_vs_disk": round(disk_s / pulled["phases"]["download"], 3),
        }
    finally:
        if tree is not None:
            kill_tree(tree.pid)
        for d in nodes:
            stop_daemon(d)
        gw.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "bench": "remote",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "mib": args.mib,
        "threads": args.threads,
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
