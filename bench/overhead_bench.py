"""make bench-overhead: gpusnap's own overhead on small CPU trees, against plain CRIU in the same run.

For each workload (``sleep``: one coreutils ``sleep``; ``tree``: tests/daemon/workloads/tree.py, a
Python parent and child joined by a pipe, 4 MiB of patterned memory), every round runs, interleaved so
load drifts hit both alike:

- plain CRIU through its CLI, with the options gpusnapd gives it (``criu dump`` of a fresh tree, then
  ``criu restore -d`` of those images into this PID namespace);
- gpusnap through its Python client (request sent → operation finished): a checkpoint of a fresh
  tree, a restore with ``host_pid_namespace`` (what plain CRIU does) and a default restore (into a
  fresh PID namespace); each restored tree is checked to be running, then killed;
- gpusnap through its CLI (``gpusnap -o json restore SNAPSHOT``: the interpreter's start, the imports, the
  calls, the output; a fresh PID namespace), as ``cli_restore``;
- CRIU's self-time: the last timestamp of each CRIU log (CRIU's own clock, from its start
  to its last line), for both paths.

Each round runs its steps (plain CRIU, then each daemon) starting one step later than the round before,
so that no daemon always follows the same one (a spare helper's restart, the disk's writeback of the step
before). Each timed operation starts ``--gap`` seconds (default 1) after the previous one ended, CRIU's and
gpusnap's alike: gpusnapd keeps a spare CRIU helper started ahead, which needs about 0.3 s to become
ready; ``--gap 0`` shows back-to-back requests, which pay part of that start.

It also times the CLI: ``gpusnap ls`` against an empty store and ``gpusnap --version``, beside fresh interpreters that only import
what it loads, step by step (``CLI_IMPORTS``: nothing, click, the generated protobuf messages, grpc, the
client, the CLI and client), so the floor each library sets is in the same file.

``--baseline DIR`` (a directory holding another gpusnap package, e.g. an older commit's ``build/pkg``)
runs a second gpusnapd on that code, its rounds interleaved with this checkout's, as ``baseline_gpusnap_*``
and ``baseline_ls_empty_store`` (its CLI runs that package too): an A/B under one load. ``--variant NAME=DIR`` (repeatable) adds further
daemons the same way, as ``NAME_gpusnap_*`` and ``NAME_ls_empty_store``: e.g. the baseline plus one
change alone, so each change of a set is measured in the same run. Results: bench/results/overhead-<label>-<date>.json
with every sample, min and median, and the targets of issue 12 (gpusnap ≤ CRIU + 50 ms; ``ls`` ≤ 0.3 s)
judged on medians.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import plain_criu, results_file  # noqa: E402
from tests.conftest import DaemonProc, _cli_env, kill_tree, start_daemon, stop_daemon, wait_for  # noqa: E402

TREE = REPO / "tests" / "daemon" / "workloads" / "tree.py"
TARGET_OVERHEAD_S = 0.050
TARGET_LS_S = 0.300
PR_SET_CHILD_SUBREAPER = 36


def _start(kind: str, workdir: Path) -> int:
    workdir.mkdir(parents=True)
    if kind == "sleep":
        cmd = ["sleep", "1000000"]
    else:
        cmd = [sys.executable, str(TREE), str(workdir), "--mem-mb", "4", "--no-listener"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    if kind == "tree":
        wait_for(lambda: (workdir / "ready").exists(), 60, f"workload {workdir} did not start")
    else:
        wait_for(lambda: Path(f"/proc/{proc.pid}/exe").exists(), 10, "sleep did not start")
    _children.append(proc)
    return proc.pid


_children: list[subprocess.Popen[bytes]] = []


def end_children(children: list[subprocess.Popen[bytes]]) -> None:
    """Kill every workload this bench started that still runs, and reap them all."""
    for p in children:
        if p.poll() is None:
            p.kill()
        p.wait()


def _tree(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


def _become_subreaper() -> None:
    """Adopt orphans (a dumped tree's child, a restored tree whose CRIU exited), so they are reaped here:
    a zombie that is still a session's member keeps that session's PID in use, and a restore into this
    PID namespace then fails with "Can't fork for <pid>: File exists"."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap(pids: list[int]) -> None:
    """Reap until every PID of ``pids`` (a dumped or killed tree) is gone, so restores can reuse them."""
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in pids):
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"PIDs {pids} did not go away")
        time.sleep(0.005)


GAP_S = [1.0]
"""Pause before each timed operation (``--gap``)."""


def _restore_and_wait(client: Any, snap: str, host_pidns: bool) -> Any:
    return client.wait(client.restore(snap, host_pid_namespace=host_pidns).id)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    time.sleep(GAP_S[0])
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def plain_criu_round(kind: str, tmp: Path, i: int) -> dict[str, float]:
    """One dump and one restore with the CRIU CLI; returns wall and log seconds."""
    pid = _start(kind, tmp / f"criu-{kind}-{i}")
    pids = _tree(pid)
    images = tmp / f"criu-{kind}-{i}-img"
    dump_s, _ = _timed(lambda: plain_criu.dump(pid, images))
    _reap(pids)
    restore_s, restored = _timed(lambda: plain_criu.restore(images))
    assert Path(f"/proc/{restored}").exists(), "plain CRIU restore left nothing running"
    kill_tree(restored)
    _reap(pids)
    out = {
        "dump_s": dump_s,
        "restore_s": restore_s,
        "dump_log_s": plain_criu.log_seconds(images / "dump.log"),
        "restore_log_s": plain_criu.log_seconds(images / "restore.log"),
    }
    shutil.rmtree(images, ignore_errors=True)
    return out


def _phases(op: Any) -> dict[str, float]:
    return {p.phase: p.duration_seconds for p in op.phases}


def gpusnap_round(daemon: DaemonProc, kind: str, tmp: Path, i: int) -> dict[str, Any]:
    """One checkpoint and two restores (host PID namespace, fresh one) through the client, then a restore
    through the CLI as a person types it (``gpusnap restore SNAPSHOT``: a fresh PID namespace)."""
    client = daemon.client()
    pid = _start(kind, tmp / f"gs-{kind}-{i}")
    pids = _tree(pid)
    dump_s, op = _timed(lambda: client.wait(client.checkpoint(pid).id))
    _reap(pids)
    snap = op.snapshot.id
    snap_dir = daemon.store / "snapshots" / snap
    out: dict[str, Any] = {
        "dump_s": dump_s,
        "dump_log_s": plain_criu.log_seconds(snap_dir / "dump.log"),
        "dump_phases": _phases(op),
    }
    for key, host_pidns in (("restore_host_pidns", True), ("restore", False)):
        seconds, rop = _timed(functools.partial(_restore_and_wait, client, snap, host_pidns))
        root = rop.restore.pid
        assert Path(f"/proc/{root}").exists(), f"gpusnap {key} left nothing running"
        restored = _tree(root)
        kill_tree(root)
        _reap(restored)
        out[f"{key}_s"] = seconds
        out[f"{key}_log_s"] = plain_criu.log_seconds(snap_dir / f"restore-{rop.id}.log")
        out[f"{key}_phases"] = _phases(rop)
    seconds, res = _timed(functools.partial(daemon.cli, "-o", "json", "restore", snap, check=True))
    doc = json.loads(res.stdout)
    restored = _tree(int(doc["pid"]))
    kill_tree(int(doc["pid"]))
    _reap(restored)
    out["cli_restore_s"] = seconds
    out["cli_restore_log_s"] = plain_criu.log_seconds(snap_dir / f"restore-{doc['operation']}.log")
    out["cli_restore_phases"] = {p["phase"]: p["duration_seconds"] for p in doc["phases"]}
    client.delete_snapshot(snap)
    return out


def _stats(samples: list[float]) -> dict[str, Any]:
    return {
        "min_s": round(min(samples), 4),
        "median_s": round(statistics.median(samples), 4),
        "samples_s": [round(s, 4) for s in samples],
    }


def _phase_medians(rounds: list[dict[str, Any]], key: str) -> dict[str, float]:
    names = {n for r in rounds for n in r[key]}
    return {n: round(statistics.median(r[key].get(n, 0.0) for r in rounds), 4) for n in sorted(names)}


CLI_IMPORTS = {
    "python_startup": "pass",
    "import_click": "import click",
    "import_protobuf_messages": "import gpusnap.daemon._proto.snapshots_pb2, gpusnap.daemon._proto.operations_pb2",
    "import_grpc": "import grpc",
    "import_client": "import gpusnap.daemon.client.calls",
    "import_cli_and_client": "import gpusnap.daemon.cli, gpusnap.daemon.client.calls",
}
"""What ``gpusnap ls`` loads, step by step (each a fresh ``python -c``): the floor under the CLI's start."""


def cli_times(daemon: DaemonProc, runs: int, others: dict[str, tuple[DaemonProc, str]]) -> dict[str, Any]:
    """``gpusnap ls`` wall time (the store is empty) and ``gpusnap --version``'s and, in the same rounds, a fresh
    interpreter running each of ``CLI_IMPORTS`` (and each of ``others``' ``ls`` and ``--version``: name -> its
    daemon and its package's path, put first), ``runs`` times each."""
    env = _cli_env()
    ls_s: list[float] = []
    other_s: dict[str, list[float]] = {name: [] for name in others}
    version_s: dict[str, list[float]] = {name: [] for name in ["", *others]}
    steps: dict[str, list[float]] = {k: [] for k in CLI_IMPORTS}

    def ls(d: DaemonProc, e: dict[str, str]) -> float:
        cmd = [sys.executable, "-m", "gpusnap.daemon.cli", "--socket", str(d.socket), "ls"]
        t, res = _timed(lambda: subprocess.run(cmd, capture_output=True, text=True, env=e))
        assert res.returncode == 0, res.stderr
        return t

    clis = [(ls_s, daemon, env), *((other_s[n], d, {**env, "PYTHONPATH": p}) for n, (d, p) in others.items())]
    for i in range(runs):
        start = i % len(clis)  # rotated, as the operations' rounds
        for samples, d, e in clis[start:] + clis[:start]:
            samples.append(ls(d, e))
        for name in version_s:
            e = env if not name else {**env, "PYTHONPATH": others[name][1]}
            run = functools.partial(subprocess.run, [sys.executable, "-m", "gpusnap.daemon.cli", "--version"], env=e)
            version_s[name].append(_timed(functools.partial(run, check=True, capture_output=True))[0])
        for key, code in CLI_IMPORTS.items():
            run = functools.partial(subprocess.run, [sys.executable, "-c", code], env=env, check=True)
            steps[key].append(_timed(run)[0])
    out = {"ls_empty_store": _stats(ls_s), **{k: _stats(v) for k, v in steps.items()}}
    for name, samples in other_s.items():
        out[f"{name}_ls_empty_store"] = _stats(samples)
    for name, samples in version_s.items():
        out[f"{name + '_' if name else ''}version"] = _stats(samples)
    return out


def _versus(prefix: str, k: str, rounds: list[dict[str, Any]], criu: dict[str, Any]) -> dict[str, Any]:
    """Stats of operation ``k`` over ``rounds`` of one daemon, and its overhead over plain CRIU's ``criu``."""
    ours = _stats([r[f"{k}_s"] for r in rounds])
    return {
        f"{prefix}_{k}": ours,
        f"{prefix}_{k}_criu_log": _stats([r[f"{k}_log_s"] for r in rounds]),
        f"{prefix}_{k}_phases_median_s": _phase_medians(rounds, f"{k}_phases"),
        f"{prefix}_{k}_vs_criu": {
            "ratio": round(ours["median_s"] / criu["median_s"], 3),
            "overhead_ms": round((ours["median_s"] - criu["median_s"]) * 1000, 1),
            "overhead_min_ms": round((ours["min_s"] - criu["min_s"]) * 1000, 1),
            "target_met": ours["median_s"] <= criu["median_s"] + TARGET_OVERHEAD_S,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=10, help="rounds per workload (and CLI runs)")
    ap.add_argument("--workloads", default="sleep,tree", help="comma separated: sleep, tree")
    results_file.add_arguments(ap)
    ap.add_argument(
        "--gap",
        type=float,
        default=1.0,
        help="seconds of pause before each timed operation, for CRIU and gpusnap alike: gpusnapd's spare "
        "CRIU helper needs about 0.3 s to start, so back-to-back requests (--gap 0) pay part of it",
    )
    ap.add_argument("--no-write", action="store_true", help="print the summary only")
    ap.add_argument(
        "--baseline",
        default="",
        help="a directory holding another gpusnap package (e.g. a worktree's build/pkg): a second gpusnapd runs "
        "it, interleaved round by round with this checkout's, as baseline_gpusnap_* (an A/B under one load)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="one more gpusnap package, run and interleaved like --baseline, reported as NAME_gpusnap_* (repeatable)",
    )
    args = ap.parse_args()
    GAP_S[0] = args.gap
    _become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-bench-overhead-"))
    daemon = start_daemon(tmp)
    packages = [("baseline", args.baseline)] if args.baseline else []
    for spec in args.variant:
        name, sep, directory = spec.partition("=")
        if not sep or not name.isidentifier() or name in ("gpusnap", *(n for n, _ in packages)):
            ap.error(f"--variant {spec!r}: give NAME=DIR with a NAME of its own")
        packages.append((name, directory))
    others: dict[str, tuple[DaemonProc, str]] = {}
    for name, directory in packages:
        path = os.pathsep.join([str(Path(directory).resolve()), _cli_env()["PYTHONPATH"]])
        other = start_daemon(tmp / name, extra_env={"PYTHONPATH": path})
        other.env = {**_cli_env(), "PYTHONPATH": path}  # its CLI too is that package's
        others[name] = (other, path)
    result: dict[str, Any] = {
        "host": {"loadavg_start": os.getloadavg()[0]},
        "runs": args.runs,
        "gap_s": args.gap,
        "baseline": args.baseline,
        "variants": dict(packages),
        "workloads": {},
    }
    try:
        assert daemon.alive(), daemon.log.read_text()
        result["cli"] = cli_times(daemon, args.runs, others)
        for kind in args.workloads.split(","):
            plain: list[dict[str, float]] = []
            rounds: dict[str, list[dict[str, Any]]] = {"gpusnap": [], **{f"{n}_gpusnap": [] for n in others}}
            order: list[tuple[str, DaemonProc | None, int]] = [("criu", None, 0), ("gpusnap", daemon, 0)]
            order += [(f"{name}_gpusnap", d, n * args.runs) for n, (name, (d, _)) in enumerate(others.items(), 1)]
            for i in range(args.runs):  # each round starts one step later: no daemon always follows the same one
                start = i % len(order)
                for key, d, offset in order[start:] + order[:start]:
                    if d is None:
                        plain.append(plain_criu_round(kind, tmp, i))
                    else:
                        rounds[key].append(gpusnap_round(d, kind, tmp, offset + i))
            w: dict[str, Any] = {}
            for action, ours_keys in (
                ("dump", ("dump",)),
                ("restore", ("restore_host_pidns", "restore", "cli_restore")),
            ):
                w[f"criu_{action}"] = _stats([r[f"{action}_s"] for r in plain])
                w[f"criu_{action}_log"] = _stats([r[f"{action}_log_s"] for r in plain])
                for k in ours_keys:
                    for prefix, samples in rounds.items():
                        w.update(_versus(prefix, k, samples, w[f"criu_{action}"]))
            result["workloads"][kind] = w
            print(json.dumps({kind: {k: v for k, v in w.items() if k.endswith("_vs_criu")}}), flush=True)
    finally:
        stop_daemon(daemon)
        for d, _ in others.values():
            stop_daemon(d)
        end_children(_children)
        shutil.rmtree(tmp, ignore_errors=True)
    ls = result["cli"]["ls_empty_store"]
    result["cli"]["ls_target_met"] = ls["median_s"] <= TARGET_LS_S
    result["cli"]["ls_vs_python_startup"] = round(ls["median_s"] / result["cli"]["python_startup"]["median_s"], 2)
    result["host"]["loadavg_end"] = os.getloadavg()[0]
    print(
        json.dumps(
            {
                "cli": {k: result["cli"][k] for k in ("ls_target_met", "ls_vs_python_startup")},
                "ls_median_s": ls["median_s"],
                "ls_min_s": ls["min_s"],
            }
        )
    )
    if not args.no_write:
        results_file.write(result, "overhead", args.out, args.label)
    return 0


if __name__ == "__main__":
    sys.exit(main())
