"""Raw facts of processes read from ``/proc`` (or a fake tree under ``proc_root``, for tests): open files and
mappings, environment, command line, liveness, and the signs of CUDA MPS. ``drivers.proc`` reads the live tree
through psutil; these read files only, so that the GPU preflight's facts can be unit-tested."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: Default MPS pipe directory when ``CUDA_MPS_PIPE_DIRECTORY`` is unset.
DEFAULT_MPS_PIPE_DIR = "/tmp/nvidia-mps"


def pid_alive(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """Whether ``pid`` exists and is not a zombie (``<proc_root>/<pid>/stat`` state not Z/X)."""
    base = proc_root / str(pid)
    if not base.is_dir():
        return False
    try:
        text = (base / "stat").read_text()
    except OSError:  # vanished meanwhile, or a fake tree without stat: trust the directory
        return base.is_dir()
    state = text.rpartition(")")[2].split()
    return not (state and state[0] in ("Z", "X"))


def open_paths(pid: int, proc_root: Path = Path("/proc")) -> list[str]:
    """Targets of ``<proc_root>/<pid>/fd/*`` and file paths of ``<proc_root>/<pid>/maps``.

    Args:
        pid: the process.
        proc_root: ``/proc`` or a fake tree (fd entries as symlinks, ``maps`` as text).

    Returns:
        Paths such as ``"/dev/nvidia0"``, ``"socket:[123]"``; `` (deleted)`` suffixes stripped; fds closed while
        reading are skipped; empty when the process vanished.
    """
    base = proc_root / str(pid)
    paths: list[str] = []
    try:
        fds = os.listdir(base / "fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            paths.append(os.readlink(base / "fd" / fd))
        except OSError:
            continue
    try:
        maps = (base / "maps").read_text()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            paths.append(parts[5].removesuffix(" (deleted)"))
    return [p.removesuffix(" (deleted)") for p in dict.fromkeys(paths)]


def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """``<proc_root>/<pid>/environ`` as a dict (the environment at exec time).

    Raises:
        OSError: unreadable (process gone, no permission).
    """
    raw = (proc_root / str(pid) / "environ").read_bytes()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            key, _, value = item.partition(b"=")
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def effective_environ(pid: int, reported: Mapping[str, str], proc_root: Path = Path("/proc")) -> dict[str, str]:
    """A process's environment as its libraries see it: ``/proc/<pid>/environ`` (as at exec), with the
    capture settings its agent reported (``capture_settings.reported``) laid over it.

    ``configure_capture_env`` run inside a process changes ``getenv`` there but not ``/proc/<pid>/environ``;
    without the agent's report the preflight would refuse a front end configured as documented.

    Raises:
        OSError: ``environ`` unreadable (process gone, no permission).
    """
    return {**read_environ(pid, proc_root), **reported}


def read_cmdline(pid: int, proc_root: Path = Path("/proc")) -> list[str]:
    """``<proc_root>/<pid>/cmdline`` as argv; empty when the process vanished or is a kernel thread."""
    try:
        raw = (proc_root / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.removesuffix(b"\0").split(b"\0")] if raw else []


def mps_pipe_dir_exists(pid: int, env: Mapping[str, str], proc_root: Path = Path("/proc")) -> bool:
    """Whether the target's MPS pipe directory holds a ``control`` socket, seen from its mount namespace.

    Args:
        pid: the target.
        env: its environment (``CUDA_MPS_PIPE_DIRECTORY`` or default ``/tmp/nvidia-mps``).
        proc_root: ``/proc`` or a fake tree; the directory is looked up under ``<proc_root>/<pid>/root``.
    """
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_MPS_PIPE_DIR
    return (proc_root / str(pid) / "root" / pipe.lstrip("/") / "control").exists()


def mps_daemon_running(proc_root: Path = Path("/proc")) -> bool:
    """Whether an MPS daemon runs: some ``<proc_root>/<pid>/comm`` starts with ``nvidia-cuda-mps``.

    ``comm`` is truncated to 15 characters, so ``nvidia-cuda-mps-control`` and ``nvidia-cuda-mps-server`` both
    read ``nvidia-cuda-mps``.
    """
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return False
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            comm = (proc_root / entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("nvidia-cuda-mps"):
            return True
    return False
