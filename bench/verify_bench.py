"""make bench-verify: what verify and the /dev/shm copies cost a restore, this checkout against a baseline in one run.

Issue 25, item 1: a restore hashed every image file before CRIU ran (2.1 s of a 5.4 GB image on 2 cores) and
copied a private /dev/shm's segment twice. Now the page images are hashed while CRIU restores (the tasks held
at its pre-resume), a RAM store trusts what this daemon hashed (``store.verified``), and the segment is copied
once. Each daemon (this checkout's and ``--baseline DIR``'s, a directory holding another gpusnap package:
``make bench-baseline REV=<commit before>``) dumps its own worker (tests/daemon/workloads/anon_regions.py:
``--anon-mb`` MiB of dirty anonymous memory and a ``--shm-mb`` MiB /dev/shm segment held open for writing);
then, ``--rounds`` times, in alternating order, each restores its snapshot:

- ``restore_s``: ``gpusnap restore`` run until it returns (the tree runs);
- ``first_request_s``: from the same start until the restored worker has answered SIGUSR1 with the hash of all
  its memory (equal to the source's, checked): the first request, which reads every page;
- ``verify_s``, ``criu_s``: the operation's ``verify`` and ``restore`` phases;
- ``dev_shm_bytes``: tmpfs the restored tree's private /dev/shm uses.

``--store ram`` puts both stores on a tmpfs of their own (a RAM store; root's, mode 0700), ``disk`` under the
temporary directory. Results: bench/results/verify-<store>[-<label>]-<date>.json with every run, the medians
and ``ratio`` (this checkout's median over the baseline's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file, tmpfs  # noqa: E402
from tests.conftest import DaemonProc, _cli_env, kill_tree, start_daemon, stop_daemon, wait_for  # noqa: E402

WORKLOAD = REPO / "tests" / "daemon" / "workloads" / "anon_regions.py"
KEYS = ("restore_s", "first_request_s", "verify_s", "criu_s", "dev_shm_bytes")


def _dump(d: DaemonProc, wd: Path, a: argparse.Namespace) -> tuple[str, str]:
    """Start the worker in ``wd`` and dump it (which ends it); returns the snapshot id and its expected hash."""
    wd.mkdir(parents=True)
    name = f"gsn-bench-verify-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, str(WORKLOAD), str(wd), "--regions", str(a.anon_mb // 256), "--mb", "256"]
    cmd += ["--sparse-mb", "0", "--shm-mb", str(a.shm_mb), "--shm-name", name]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        wait_for(lambda: (wd / "ready").exists() or proc.poll() is not None, 600, "the worker did not start")
        snap = json.loads(d.cli("-o", "json", "dump", str(proc.pid), timeout=600, check=True).stdout)["id"]
        proc.wait(timeout=60)
    finally:
        kill_tree(proc.pid)
        Path("/dev/shm", name).unlink(missing_ok=True)  # (a baseline's dump leaves it behind)
    return snap, (wd / "expected_sha").read_text()


def _restore(d: DaemonProc, snap: str, wd: Path, expected: str) -> dict[str, Any]:
    (wd / "sha_now").unlink(missing_ok=True)
    t0 = time.monotonic()
    out = json.loads(d.cli("-o", "json", "restore", snap, timeout=600, check=True).stdout)
    restore_s = time.monotonic() - t0
    pid = int(out["pid"])
    try:
        os.kill(pid, signal.SIGUSR1)
        wait_for((wd / "sha_now").exists, 600, "the restored worker does not answer")
        first = time.monotonic() - t0
        assert (wd / "sha_now").read_text() == expected, "the restored worker's memory differs from the source's"
        shm = os.statvfs(f"/proc/{pid}/root/dev/shm")
        phases = {p["phase"]: p["duration_seconds"] for p in out["phases"]}
    finally:
        kill_tree(pid)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 60, "the restored worker does not end")
    return {
        "restore_s": restore_s,
        "first_request_s": first,
        "verify_s": phases.get("verify", 0.0),
        "criu_s": phases.get("restore", 0.0),
        "dev_shm_bytes": (shm.f_blocks - shm.f_bfree) * shm.f_frsize,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="a directory holding the gpusnap package to compare with")
    ap.add_argument("--store", choices=("disk", "ram"), default="ram")
    ap.add_argument("--anon-mb", type=int, default=2048, help="MiB of dirty anonymous memory (a multiple of 256)")
    ap.add_argument("--shm-mb", type=int, default=512, help="MiB of the /dev/shm segment")
    ap.add_argument("--rounds", type=int, default=3)
    results_file.add_arguments(ap)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-verify-bench-"))
    packages: dict[str, Path | None] = {"gpusnap": None, "baseline": Path(a.baseline).resolve()}  # None: this checkout
    daemons: dict[str, DaemonProc] = {}
    snaps: dict[str, tuple[str, str]] = {}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in packages}
    mounts = contextlib.ExitStack()
    try:
        for name, package in packages.items():
            where = tmp / name
            where.mkdir()
            if a.store == "ram":
                mounts.enter_context(tmpfs.mounted(where, 2 * (a.anon_mb + a.shm_mb) + 512))
            path = os.pathsep.join([str(package), _cli_env()["PYTHONPATH"]]) if package else None
            daemons[name] = start_daemon(where, extra_env={"PYTHONPATH": path} if path else None)
            if path:
                daemons[name].env = {**_cli_env(), "PYTHONPATH": path}
            snaps[name] = _dump(daemons[name], tmp / f"w-{name}", a)
        names = list(packages)
        for r in range(a.rounds):
            for name in names[r % 2 :] + names[: r % 2]:  # alternate which daemon goes first
                run = _restore(daemons[name], snaps[name][0], tmp / f"w-{name}", snaps[name][1])
                print(name, json.dumps(run), flush=True)
                runs[name].append(run)
    finally:
        for d in daemons.values():
            stop_daemon(d)
        mounts.close()
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in KEYS} for name, rs in runs.items()}
    ratio = {k: medians["gpusnap"][k] / medians["baseline"][k] for k in KEYS if medians["baseline"][k]}
    doc = {
        "host": {"cpus": os.cpu_count()},
        "baseline": a.baseline,  # as given: no machine path in the results
        "store": a.store,
        "anon_mb": a.anon_mb,
        "shm_mb": a.shm_mb,
        "rounds": a.rounds,
        "runs": runs,
        "median": medians,
        "ratio": ratio,
    }
    print(json.dumps({"median": medians, "ratio": ratio}, indent=2))
    results_file.write(doc, f"verify-{a.store}", a.out, a.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
