"""make bench-gpu: phase timings and bandwidth of GPU checkpoint/restore through gpusnapd.

For each size and mode, a PyTorch worker (tests/gpu/torch_worker.py) fills that many GiB of device
memory; gpusnap dumps it and restores it; the restored worker's checksum is verified. Modes: ``stock``
(no agent: the CUDA checkpoint and CRIU carry the data) and ``offload`` (the worker's agent names the
data as buffers: they go to the buffer store and come back through pinned memory), ``stable`` (offload
with the buffers in an address-stable arena and a CUDA graph reading them: today's reload re-maps the arena
and copies them in) and ``prefill`` (the same worker restored by a second gpusnapd with ``--gpu-prefill
auto``: it fills the arena's device memory while CRIU restores the worker; before its first restore the
bench waits until that gpusnapd has registered the new snapshot's blobs ahead, as it does in the background
after every checkpoint: ``registered_ahead``; ``docs/performance.md``). With
both ``stable`` and ``prefill`` the result carries ``prefill_ratio`` per size: stable's restore total over
prefill's, in the same run. Results are written as JSON to bench/results/gpu-<kind>-<date>.json:

    {"host": {...}, "runs": [{"gib": 2, "checkpoint": {"phases": {...}, "total_s": …, "gb_per_s": …},
                              "restore": {...}, "image_bytes": …, "verified": true}]}

GB/s = GPU bytes (10^9) / the operation's total time (sum of its phases).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from tests.conftest import phase_seconds, start_daemon, stop_daemon, wait_for  # noqa: E402

WORKER = REPO / "tests" / "gpu" / "torch_worker.py"


def _buffer_store_bytes(root: Path) -> int:
    blobs = root / "sha256"
    return sum(p.stat().st_size for p in blobs.iterdir()) if blobs.is_dir() else 0


def run_size(daemon: object, gib: float, tmp: Path, mode: str, buffers_root: Path) -> dict[str, object]:
    """One worker holding ``gib`` GiB: dump, restore, verify. ``mode``: ``stock`` (no agent: CUDA checkpoint
    and CRIU carry everything) or ``offload`` (the agent names the data as buffers); offload also takes a
    second snapshot of the restored copy to show what it adds to the store."""
    wd = tmp / f"{mode}-{gib}"
    wd.mkdir()
    env = {
        **os.environ,
        "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),  # type: ignore[attr-defined]
        "GPUSNAP_WAKE_DIR": str(tmp / "wake"),
    }
    extra = {"offload": ["--agent"], "stable": ["--agent", "--stable"], "prefill": ["--agent", "--stable"]}.get(
        mode, []
    )
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(wd), "--gib", str(gib), *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(wd / "stderr", "wb"),
        env=env,
        start_new_session=True,
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "worker did not start")
    if proc.poll() is not None:
        raise SystemExit((wd / "stderr").read_text())
    expected = (wd / "expected").read_text().split()
    rss = _rss(proc.pid)
    t0 = time.monotonic()
    dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
    dump_wall = time.monotonic() - t0
    proc.wait(timeout=120)
    ahead = wait_registered_ahead(daemon) if mode == "prefill" else None
    t0 = time.monotonic()
    restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
    restore_wall = time.monotonic() - t0
    now = wd / "now"
    os.kill(restored["pid"], signal.SIGUSR1)
    wait_for(now.exists, 300, "restored worker did not answer")
    verified = now.read_text().split()[: len(expected)] == expected
    second = None
    if mode == "offload":
        store_before = _buffer_store_bytes(buffers_root)
        again = json.loads(daemon.cli("-o", "json", "dump", str(restored["pid"]), check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
        second = {
            "image_bytes": again["size_bytes"],
            "buffer_bytes": again["buffer_bytes"],
            "buffer_store_growth_bytes": _buffer_store_bytes(buffers_root) - store_before,
            "phases": phase_seconds(again),
        }
        daemon.cli("rm", again["id"], check=True)  # type: ignore[attr-defined]
    else:
        os.kill(restored["pid"], signal.SIGKILL)
    again_restore = None
    if mode in ("stable", "prefill"):  # a second restore of the same snapshot: a long-lived daemon's steady state
        _gone(restored["pid"])
        t0 = time.monotonic()
        back = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=3600).stdout)  # type: ignore[attr-defined]
        wall = time.monotonic() - t0
        now.unlink()
        os.kill(back["pid"], signal.SIGUSR1)
        wait_for(now.exists, 300, "restored worker did not answer")
        verified = verified and now.read_text().split()[: len(expected)] == expected
        os.kill(back["pid"], signal.SIGKILL)
        _gone(back["pid"])
        again_restore = {
            "phases": phase_seconds(back),
            "total_s": sum(phase_seconds(back).values()),
            "cli_wall_s": wall,
        }
    daemon.cli("rm", dumped["id"], check=True)  # type: ignore[attr-defined]
    gpu_bytes = gib * 2**30
    ck_total = sum(phase_seconds(dumped).values())
    rs_total = sum(phase_seconds(restored).values())
    return {
        "mode": mode,
        "gib": gib,
        "gpu_bytes": int(gpu_bytes),
        "source_rss_bytes": rss,
        "image_bytes": dumped["size_bytes"],
        "buffer_bytes": dumped.get("buffer_bytes", 0),
        "snapshot_over_data": (dumped["size_bytes"] + dumped.get("buffer_bytes", 0)) / (gpu_bytes + rss),
        "verified": verified,
        "checkpoint": {
            "phases": phase_seconds(dumped),
            "total_s": ck_total,
            "cli_wall_s": dump_wall,
            "gb_per_s": gpu_bytes / 1e9 / ck_total,
        },
        "restore": {
            "phases": phase_seconds(restored),
            "total_s": rs_total,
            "cli_wall_s": restore_wall,
            "gb_per_s": gpu_bytes / 1e9 / rs_total,
        },
        "second_snapshot": second,
        "restore_again": again_restore,
        "registered_ahead": ahead,
    }


def wait_registered_ahead(daemon: object, timeout_s: float = 120) -> dict[str, object]:
    """Wait until the prefill daemon has registered the new snapshot's blobs ahead of its restore (``gpusnap
    node``'s gpu prefill state; it does so in the background after the checkpoint), so the first restore
    measures the warm path a restore some time after its checkpoint gets. Returns the wait and the state."""
    t0 = time.monotonic()
    state: dict[str, Any] = {}
    while time.monotonic() - t0 < timeout_s:
        state = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)["gpu_prefill"]  # type: ignore[attr-defined]
        if state["registered_bytes"] and not state["registering"]:
            break
        time.sleep(0.2)
    return {"wait_s": round(time.monotonic() - t0, 3), "state": state}


def _gone(pid: int, timeout_s: float = 30) -> None:
    """Wait (at most ``timeout_s``) for a killed restored root to be reaped, so its GPU memory is free."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _prefill_ratios(runs: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Per size with both modes: restore totals and reload phases of ``stable`` (the worker reads its arena
    back) and ``prefill`` (gpusnapd filled it during the restore), and stable's total over prefill's; the
    ``again_`` keys for the second restore of the same snapshot. Prefill's contexts are created at
    gpusnapd's start and the blobs registered after the checkpoint, so both restores run warm."""
    out: dict[str, dict[str, float]] = {}
    by = {(r["gib"], r["mode"]): r for r in runs}
    for (gib, mode), run in by.items():
        other = by.get((gib, "prefill"))
        if mode != "stable" or other is None:
            continue
        row: dict[str, float] = {}
        for key, label in (("restore", ""), ("restore_again", "again_")):
            rs, pf = run.get(key), other.get(key)
            if not rs or not pf:
                continue
            a, b = rs["total_s"], pf["total_s"]  # type: ignore[index]
            row[f"{label}stable_restore_s"] = round(a, 3)
            row[f"{label}prefill_restore_s"] = round(b, 3)
            row[f"{label}stable_reload_s"] = round(rs["phases"].get("reload-buffers", 0.0), 3)  # type: ignore[index]
            row[f"{label}prefill_reload_s"] = round(pf["phases"].get("reload-buffers", 0.0), 3)  # type: ignore[index]
            row[f"{label}stable_over_prefill"] = round(a / b, 3) if b else 0.0
        out[str(gib)] = row
    return out


def _rss(pid: int) -> int:
    """Resident CPU memory of ``pid``, bytes (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="2,16,64", help="GiB of GPU data, comma separated")
    ap.add_argument("--store-parent", default=None, help="directory for the store (default: a temp dir on disk)")
    ap.add_argument("--buffer-dir", default="", help="gpusnapd --buffer-dir (e.g. under /dev/shm: a RAM tier)")
    results_file.add_arguments(ap)
    ap.add_argument(
        "--modes",
        default="stock,offload",
        help="stock (no agent), offload (the worker names its data as buffers), stable (offload, in an "
        "address-stable arena read by a CUDA graph) and/or prefill (stable, restored by a gpusnapd with "
        "--gpu-prefill auto), comma separated",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-", dir=args.store_parent))
    modes = args.modes.split(",")
    daemons = {}
    runs = []
    try:
        for kind in dict.fromkeys("prefill" if m == "prefill" else "plain" for m in modes):
            buffer_dir = f"{args.buffer_dir}-{kind}" if args.buffer_dir and kind == "prefill" else args.buffer_dir
            env = {"GPUSNAP_BUFFER_DIR": buffer_dir} if buffer_dir else {}
            env.update({"GPUSNAP_GPU_PREFILL": "auto"} if kind == "prefill" else {})
            daemons[kind] = (start_daemon(tmp / kind, extra_env=env), buffer_dir)
        node = json.loads(next(iter(daemons.values()))[0].cli("-o", "json", "node", check=True).stdout)
        if "prefill" in daemons:
            print(
                "gpu prefill:",
                json.loads(daemons["prefill"][0].cli("-o", "json", "node", check=True).stdout).get("gpu_prefill"),
            )
        for size in (float(s) for s in args.sizes.split(",")):
            for mode in modes:
                daemon, buffer_dir = daemons["prefill" if mode == "prefill" else "plain"]
                run = run_size(daemon, size, tmp, mode, Path(buffer_dir) if buffer_dir else daemon.store / "buffers")
                print(json.dumps(run), flush=True)
                runs.append(run)
    finally:
        for daemon, buffer_dir in daemons.values():
            stop_daemon(daemon)
            if buffer_dir and buffer_dir != args.buffer_dir:
                shutil.rmtree(buffer_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    gpus = node.get("gpus", [])
    result = {
        "host": {
            "criu": node["host"]["criu_version"],
            "driver": node["host"].get("nvidia_driver_version", ""),
            "gpu": gpus[0]["name"] if gpus else "",
            "gpus": len(gpus),
            "store": args.store_parent or "disk (temp dir)",
        },
        "runs": runs,
        "prefill_ratio": _prefill_ratios(runs),
    }
    results_file.write(result, "gpu", args.out, args.label)
    for gib, ratio in result["prefill_ratio"].items():  # type: ignore[attr-defined]
        print(f"PREFILL {gib} GiB: {json.dumps(ratio)}")
    return 0 if all(r["verified"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
