"""A captured vLLM server's restores timed to its first token, through gpusnapd's gRPC API (an
orchestrator's calls; the CLI adds its own start-up): for bench/gpu_vllm_bench.py (H200) and
bench/vllm_cpu_bench.py (CPU).

Each restore is timed from the call that starts it to the restored server's answer of one token (greedy,
``/v1/completions``), then the server is asked for 16 tokens, to compare with the source's.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from gpusnap.daemon.api.types import OperationState
from gpusnap.daemon.client.values import Operation, Standby
from tests.adapters.vllm_server import request
from tests.conftest import DaemonProc

ANSWER_TOKENS = 16
PAGES_FILLED = re.compile(
    r"pages filled: ([\d.]+) GB by (\d+) threads in ([\d.]+) s.*?(?:and ([\d.]+) GB of its /dev/shm files)?$"
)
"""The restore's PROGRESS message of its page fill (daemon/operations/restore.py, ``_page_fill_message``)."""


def messages(daemon: DaemonProc, op_id: str) -> dict[str, list[str]]:
    """An operation's progress messages, by phase (what ``gpusnap watch`` prints)."""
    out: dict[str, list[str]] = {}
    for e in daemon.client().watch(op_id):
        if e.message:
            out.setdefault(e.phase or "", []).append(e.message)
    return out


def page_fill(said: dict[str, list[str]]) -> dict[str, Any] | None:
    """The page fill a restore reported (``pages filled: 4.29 GB by 2 threads in 1.100 s …, and 1.07 GB of its
    /dev/shm files``): bytes, threads, seconds, file_bytes; ``None`` where the restore filled no pages itself (CRIU
    read them)."""
    for text in (m for ms in said.values() for m in ms):
        found = PAGES_FILLED.search(text)
        if found:
            gb, threads, seconds = float(found.group(1)), int(found.group(2)), float(found.group(3))
            files = float(found.group(4) or 0)
            return {"bytes": int(gb * 1e9), "threads": threads, "seconds": seconds, "file_bytes": int(files * 1e9)}
    return None


def timed_dump(daemon: DaemonProc, pid: int, name: str, *args: str) -> tuple[dict[str, Any], float]:
    """``gpusnap -o json dump PID --name NAME ARGS``: its document and its wall seconds."""
    t0 = time.monotonic()
    out = daemon.cli("-o", "json", "dump", str(pid), "--name", name, *args, check=True, timeout=1800)
    return dict(json.loads(out.stdout)), time.monotonic() - t0


def phases(op: Operation) -> dict[str, float]:
    """An operation's phases, name → seconds (4 decimals), in the order they ran."""
    return {p.phase: round(p.duration_seconds, 4) for p in op.phases}


def served(done: Operation, what: str, port: int, t0: float, prompt: list[int]) -> tuple[int, float, list[int]]:
    """The restored server of ``done`` (a restore or activation, succeeded, else the bench stops): its root
    PID, seconds from ``t0`` (wall clock) to its first token, then its greedy tokens for ``prompt``."""
    if done.state is not OperationState.SUCCEEDED or done.restore is None:
        raise SystemExit(f"{what} failed: {done}")
    first = request(port, prompt, 1)
    return done.restore.pid, float(first["t_done"]) - t0, list(request(port, prompt, ANSWER_TOKENS)["token_ids"])


def restore_to_first_token(daemon: DaemonProc, snapshot: str, port: int, prompt: list[int]) -> dict[str, Any]:
    """Restore ``snapshot`` (gRPC ``Restore``, then wait); time the call → the restored server's first token;
    then its greedy tokens for ``prompt``. Keys: ``pid``, ``restore_call_s`` (the call → the operation
    done), ``restore_to_first_token_s``, ``phases``, ``answer``, ``messages`` (progress, by phase) and
    ``page_fill`` (:func:`page_fill`)."""
    client = daemon.client()
    t0 = time.time()
    done = client.wait(client.restore(snapshot).id, timeout_s=1800)
    restored_at = time.time()
    pid, first_token_s, answer = served(done, f"restore of {snapshot}", port, t0, prompt)
    said = messages(daemon, done.id)
    return {
        "pid": pid,
        "restore_call_s": restored_at - t0,
        "restore_to_first_token_s": first_token_s,
        "phases": phases(done),
        "answer": answer,
        "messages": said,
        "page_fill": page_fill(said),
    }


def make_standby(daemon: DaemonProc, snapshot: str) -> tuple[Standby, dict[str, Any]]:
    """``gpusnap standby SNAPSHOT`` through gRPC (one standby); the standby, and ``standby_s`` (the call → the
    standby ready), ``standby_phases`` and ``standby_host_memory_bytes``."""
    client = daemon.client()
    t0 = time.time()
    made = client.wait(client.standby(snapshot).id, timeout_s=1800)
    standby_s = time.time() - t0
    if made.state is not OperationState.SUCCEEDED or made.standby is None:
        raise SystemExit(f"standby of {snapshot} failed: {made}")
    (sb,) = made.standby.standbys
    return sb, {
        "standby_s": standby_s,
        "standby_phases": phases(made),
        "standby_host_memory_bytes": sb.host_memory_bytes,
    }


def activate_to_first_token(daemon: DaemonProc, standby: str, port: int, prompt: list[int]) -> dict[str, Any]:
    """Activate ``standby`` (gRPC ``Activate``, then wait); time the call → the server's first token; then its
    greedy tokens for ``prompt``. Keys: ``pid``, ``activation_call_s``, ``activation_to_first_token_s``,
    ``activate_phases``, ``answer``."""
    client = daemon.client()
    t0 = time.time()
    done = client.wait(client.activate(standby).id, timeout_s=1800)
    activated_at = time.time()
    pid, first_token_s, answer = served(done, f"activation of {standby}", port, t0, prompt)
    return {
        "pid": pid,
        "activation_call_s": activated_at - t0,
        "activation_to_first_token_s": first_token_s,
        "activate_phases": phases(done),
        "answer": answer,
    }
