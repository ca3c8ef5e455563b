"""Facts about this host: kernel, machine, CPU model and flags."""

from __future__ import annotations

import functools
import os
import resource
import socket
from pathlib import Path

from gpusnap.daemon import version


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
    return version()


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


OPEN_FILES_WANTED = 65536
"""Soft RLIMIT_NOFILE gpusnapd raises itself to (within the hard limit): a capture holds one descriptor per
worker buffer (up to 16384), and systemd starts services with a soft limit of 1024."""


def raise_open_file_limit() -> int:
    """Raise the soft limit on open files to ``OPEN_FILES_WANTED`` or the hard limit; returns the new soft
    limit. CRIU runs with it too; a very high one would only make CRIU's service-descriptor table larger."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return want
    return soft
