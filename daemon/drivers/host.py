"""Facts about this host: kernel, machine, CPU model and flags."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from gpusnap.daemon import __version__


@functools.cache
def cpu_model_and_flags() -> tuple[str, tuple[str, ...]]:
    """The first CPU's ``model name`` and sorted ``flags`` from /proc/cpuinfo."""
    model, flags = "", tuple[str, ...]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = tuple(sorted(value.split()))
            if model and flags:
                break
    except OSError:
        pass
    return model, flags


def kernel() -> str:
    """``uname -r``."""
    return os.uname().release


def machine() -> str:
    """``uname -m``."""
    return os.uname().machine


def hostname() -> str:
    """This host's name."""
    return socket.gethostname()


def gpusnap_version() -> str:
    """The running gpusnap's version."""
    return __version__


CAP_SYS_RESOURCE = 24


def has_capability(cap: int) -> bool:
    """Whether this process's effective capability set holds ``cap`` (capabilities(7) number)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> cap & 1)
    return False


def mem_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo, bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
