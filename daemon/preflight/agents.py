"""A capture's check of the tree's worker agents: a process that runs a gpusnap agent not attached to this
daemon (its ``GPUSNAP_AGENT_SOCKET`` names another socket, or none was served there when it dialed) would be
captured on the slow path, with no warm-up, quiesce or weight offload, unless the caller asks for that."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from gpusnap.adapters.contract.wire import AGENT_THREAD
from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.drivers import proc, procfs

RECONNECT_GRACE_S = 2.0
"""How long an agent that is not attached gets to attach before the capture is refused: agents dial again
every 0.5 s (``gpusnap.adapters.agent.RECONNECT_S``), so one that reaches this daemon at all (it restarted,
the worker started a moment ago) attaches well within it."""


def unattached(
    tree_pids: Sequence[int], attached: Callable[[], Collection[int]], wait_s: float = RECONNECT_GRACE_S
) -> list[int]:
    """The processes of the tree that run a gpusnap agent (its thread, ``AGENT_THREAD``) none of this daemon's
    sessions belongs to, after waiting up to ``wait_s`` seconds for them to attach; ``attached()`` gives the
    PIDs whose agents are attached now."""
    deadline = time.monotonic() + wait_s
    while True:
        running = [p for p in tree_pids if proc.runs_thread(p, AGENT_THREAD)]
        missing = [p for p in running if p not in set(attached())] if running else []
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def check_attached(tree_pids: Sequence[int], attached: Callable[[], Collection[int]], agent_socket: Path) -> None:
    """Refuse a capture of a tree with an agent that is not attached to this daemon (:func:`unattached`).

    Raises:
        FailedPreconditionError: reason ``AGENT_NOT_ATTACHED``, naming the process, the socket its environment
            names and the one this daemon serves, and the two ways on (fix the socket, or ``--no-quiesce``).
    """
    missing = unattached(tree_pids, attached)
    if not missing:
        return
    pid = missing[0]
    try:
        dials = procfs.read_environ(pid).get("GPUSNAP_AGENT_SOCKET", "")
    except OSError:
        dials = ""
    where = (
        f"its GPUSNAP_AGENT_SOCKET is {dials}, "
        if dials and dials != str(agent_socket)
        else "it dials the default /run/gpusnap/agent.sock, "
        if not dials and str(agent_socket) != "/run/gpusnap/agent.sock"
        else "it has not reached it (it says why in its log), "
    )
    more = f" (and {len(missing) - 1} more of the tree)" if len(missing) > 1 else ""
    raise FailedPreconditionError(
        f"PID {pid} ({proc.title(pid) or 'unknown'}){more} runs a gpusnap agent that is not attached to this "
        f"gpusnapd: {where}but this daemon's agent socket is {agent_socket}. Without its agent the dump would take "
        "the slow path (no warm-up, quiesce or weight offload). Restart the engine with "
        f"GPUSNAP_AGENT_SOCKET={agent_socket}, or dump with --no-quiesce to capture it as it is",
        reason="AGENT_NOT_ATTACHED",
        metadata={"pid": str(pid), "agent_socket": str(agent_socket), **({"dials": dials} if dials else {})},
    )
