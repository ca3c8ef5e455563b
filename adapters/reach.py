"""Whether a worker can reach gpusnapd's agent socket, said once in the engine's log when it cannot.

A worker whose ``GPUSNAP_AGENT_SOCKET`` names a socket no gpusnapd serves (the service's
``/run/gpusnap/agent.sock`` under a ``make run`` daemon, which serves ``build/run/agent.sock``) runs on
without an agent, and a capture would take the slow path (no warm-up, quiesce or weight offload). Engine
plugins check at start-up (:func:`check_at_start`), the agent when it first dials (:func:`unreachable`);
each path is said once per process, and not again in the processes an engine starts once it was said in
theirs (``SAID_ENV``). Standard library only: this runs inside engine processes.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

SAID_ENV = "GPUSNAP_AGENT_SOCKET_UNREACHABLE"
"""Set in the environment to the socket path once it was said unreachable: the engine's child processes
(which inherit it) then say nothing more about the same path."""

_said: set[str] = set()


def probe(path: str) -> OSError | None:
    """Connect to ``path`` and hang up at once; the error if no one answers there (the daemon drops a
    connection that says nothing)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        sock.connect(path)
    except OSError as exc:
        return exc
    finally:
        sock.close()
    return None


def check_at_start(path: str) -> None:
    """An engine plugin's start-up check of its socket: says so in the log if it cannot be reached."""
    if os.environ.get(SAID_ENV) == path:
        return  # the process that started this one said it already
    error = probe(path)
    if error is not None:
        unreachable(path, error)


def unreachable(path: str, error: OSError) -> None:
    """Say (a warning, once per path and process) that gpusnapd cannot be reached at ``path``, why, what that
    means for a capture, and how to fix it."""
    if path in _said or os.environ.get(SAID_ENV) == path:
        _said.add(path)
        return
    _said.add(path)
    os.environ[SAID_ENV] = path
    log.warning(
        "gpusnap: PID %d cannot reach gpusnapd at %s (GPUSNAP_AGENT_SOCKET): %s. Until this engine's agents attach, "
        "`gpusnap dump` refuses it (with --no-quiesce it captures it on the slow path: no warm-up, quiesce or weight "
        "offload). Set GPUSNAP_AGENT_SOCKET to the agent socket gpusnapd serves (it logs it at start as "
        "agent_socket; `make run` serves build/run/agent.sock in its checkout) and restart the engine; the agent "
        "keeps trying meanwhile.",
        os.getpid(),
        path,
        error.strerror or error,
    )


def reached(path: str, after_s: float) -> None:
    """Say that the agent reached ``path`` after all, where :func:`unreachable` said it could not."""
    if path in _said:
        _said.discard(path)
        if os.environ.get(SAID_ENV) == path:
            del os.environ[SAID_ENV]
        log.warning(
            "gpusnap: PID %d reached gpusnapd at %s after %.0f s; its agent is attached", os.getpid(), path, after_s
        )
