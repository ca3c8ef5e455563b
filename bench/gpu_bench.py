"""make bench-gpu: phase timings and bandwidth of GPU checkpoint/restore through gpusnapd.

For each size, a PyTorch worker (tests/gpu/torch_worker.py) fills that many GiB of device memory;
gpusnap dumps it and restores it; the restored worker's checksum is verified. Results are written as
JSON to bench/results/gpu-<kind>-<date>.json:

    {"host": {...}, "runs": [{"gib": 2, "checkpoint": {"phases": {...}, "total_s": …, "gb_per_s": …},
                              "restore": {...}, "image_bytes": …, "verified": true}]}

GB/s = GPU bytes (10^9) / the operation's total time (sum of its phases).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import start_daemon, stop_daemon, wait_for  # noqa: E402

WORKER = REPO / "tests" / "gpu" / "torch_worker.py"


def run_size(daemon: object, gib: float, tmp: Path) -> dict[str, object]:
    wd = tmp / f"w{gib}"
    wd.mkdir()
    proc = subprocess.Popen([sys.executable, str(WORKER), str(wd), "--gib", str(gib)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(wd / "stderr", "wb"), start_new_session=True)
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "worker did not start")
    if proc.poll() is not None:
        raise SystemExit((wd / "stderr").read_text())
    expected = (wd / "expected").read_text().split()
    t0 = time.monotonic()
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
    dump_wall = time.monotonic() - t0
    proc.wait(timeout=120)
    t0 = time.monotonic()
    restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
    restore_wall = time.monotonic() - t0
    now = wd / "now"
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_for(now.exists, 300, "restored worker did not answer")
    verified = now.read_text().split()[:2] == expected
    os.kill(restored["pid"], signal.SIGKILL)
    daemon.cli("rm", dumped["id"], check=True)  # type: ignore[attr-defined]
    gpu_bytes = gib * 2**30
    ck_total = sum(dumped["phases"].values())
    rs_total = sum(restored["phases"].values())
    return {
        "gib": gib,
        "gpu_bytes": int(gpu_bytes),
        "image_bytes": dumped["size_bytes"],
        "verified": verified,
        "checkpoint": {"phases": dumped["phases"], "total_s": ck_total, "cli_wall_s": dump_wall,
                       "gb_per_s": gpu_bytes / 1e9 / ck_total},
        "restore": {"phases": restored["phases"], "total_s": rs_total, "cli_wall_s": restore_wall,
                    "gb_per_s": gpu_bytes / 1e9 / rs_total},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="2,16,64", help="GiB of GPU data, comma separated")
    ap.add_argument("--store-parent", default=None, help="directory for the store (default: a temp dir on disk)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--label", default="", help="tag for the results file name")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-", dir=args.store_parent))
    daemon = start_daemon(tmp)
    runs = []
    try:
        node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
        for size in (float(s) for s in args.sizes.split(",")):
            run = run_size(daemon, size, tmp)
            print(json.dumps(run), flush=True)
            runs.append(run)
    finally:
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    gpus = node.get("gpus", [])
    result = {
        "benchmark": "gpu",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"kernel": platform.release(), "criu": node["host"]["criuVersion"],
                 "driver": node["host"].get("nvidiaDriverVersion", ""), "gpu": gpus[0]["name"] if gpus else "",
                 "gpus": len(gpus), "store": args.store_parent or "disk (temp dir)"},
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu-{args.label + '-' if args.label else ''}{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / name}")
    return 0 if all(r["verified"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
