"""make bench-fanout: fan-out restore (`gpusnap restore --replicas N`) on CPU, time per replica.

A tests/daemon/workloads/tree.py process tree (parent, child, listener; ``--mem-mb`` of memory) is
dumped once; for each N it is restored N times in one call (each copy in its own PID and network
namespaces) and, as the baseline in the same run, N times by N single restores (``--private-net``).
Every copy is checked to be running, then killed. JSON to bench/results/fanout-<date>.json:

    {"runs": [{"replicas": 4, "fanout_s": …, "per_replica_s": …, "baseline_s": …,
               "baseline_per_replica_s": …, "speedup": baseline_s / fanout_s, "phases": {...}}]}

Times are wall-clock seconds of the whole call (start to operation end) as a client sees them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from tests.conftest import Workloads, kill_tree, start_daemon, stop_daemon  # noqa: E402


def _restore(client: object, snapshot: str, replicas: int) -> tuple[float, list[int], dict[str, float]]:
    start = time.monotonic()
    op = client.restore(snapshot, replicas=replicas, private_network=True)  # type: ignore[attr-defined]
    done = client.wait(op.id)  # type: ignore[attr-defined]
    elapsed = time.monotonic() - start
    if done.error is not None or done.restore is None:
        raise SystemExit(f"restore failed: {done.error}")
    pids = [r.pid for r in done.restore.replicas] or [done.restore.pid]
    phases: dict[str, float] = {}
    for p in done.phases:
        name = p.phase.partition("#")[0]
        phases[name] = phases.get(name, 0.0) + p.duration_seconds
    return elapsed, pids, phases


def _check_and_kill(pids: list[int]) -> None:
    for pid in pids:
        if not Path(f"/proc/{pid}").exists():
            raise SystemExit(f"restored copy {pid} is not running")
    kill_tree(*pids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--replicas", default="1,4,8", help="copies per call, comma separated")
    ap.add_argument("--mem-mb", type=int, default=64, help="memory of the workload's parent process")
    results_file.add_arguments(ap)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-fanout-"))
    daemon = start_daemon(tmp)
    workloads = Workloads(tmp)
    runs = []
    try:
        client = daemon.client()
        w = workloads.start("--mem-mb", str(args.mem_mb))
        op = client.checkpoint(w.pid, name="fanout")
        snap = client.wait(op.id).snapshot
        assert snap is not None, "the checkpoint failed"
        node = client.node_info()
        for n in (int(x) for x in args.replicas.split(",")):
            fanout_s, pids, phases = _restore(client, snap.id, n)
            _check_and_kill(pids)
            baseline_s = 0.0
            for _ in range(n):
                one_s, one, _ = _restore(client, snap.id, 1)
                baseline_s += one_s
                _check_and_kill(one)
            run = {
                "replicas": n,
                "fanout_s": round(fanout_s, 3),
                "per_replica_s": round(fanout_s / n, 3),
                "baseline_s": round(baseline_s, 3),
                "baseline_per_replica_s": round(baseline_s / n, 3),
                "speedup": round(baseline_s / fanout_s, 3),
                "phases": {k: round(v, 4) for k, v in phases.items()},
            }
            print(json.dumps(run), flush=True)
            runs.append(run)
    finally:
        workloads.cleanup()
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "host": {"criu": node.host.criu_version, "cpu": node.host.cpu_model},
        "snapshot": {"size_bytes": snap.size_bytes, "processes": len(snap.source.tree_pids), "mem_mb": args.mem_mb},
        "runs": runs,
    }
    results_file.write(result, "fanout", args.out, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
