"""What a (frozen) process tree holds by path, read from /proc: the files CRIU reopens by path on restore.

CRIU records an open regular file, a mapped file, the cwd, the root and the exe by path (plus size and
mode), and on restore opens that path again, as root (CRIU's ``files-reg.c``). A path-based object is
anything whose ``/proc/<pid>/fd/N`` (``map_files/<range>``, ``cwd``, ``root``, ``exe``) link reads as an
absolute path; pipes, sockets and anonymous inodes (``pipe:[…]``, ``socket:[…]``, ``anon_inode:…``) are
not reopened by path. See proc(5) for the links and ``fdinfo``'s ``flags``.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from gpusnap.daemon.api.types import Creds, HeldFile, ProcessCreds

DELETED = " (deleted)"
SKIPPED_PREFIXES = ("/proc/", "/sys/")
"""Kernel-made trees whose names no user can replace; CRIU handles procfs files on its own."""


def _fdinfo(pid: int, fd: str) -> tuple[int, int]:
    """An fd's ``open(2)`` flags and file position (``fdinfo``'s ``flags``, octal, and ``pos``); -1 each if gone."""
    flags = pos = -1
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "flags":
                flags = int(value.strip(), 8)
            elif key == "pos":
                pos = int(value.strip())
    except (OSError, ValueError):
        pass
    return flags, pos


def _access_of_fd(pid: int, fd: str) -> int:
    """R/W bits an fd was opened with (``fdinfo`` flags); 0 for ``O_PATH`` descriptors."""
    flags, _ = _fdinfo(pid, fd)
    if flags < 0:
        return os.R_OK
    if flags & os.O_PATH:
        return 0
    return {os.O_RDONLY: os.R_OK, os.O_WRONLY: os.W_OK}.get(flags & os.O_ACCMODE, os.R_OK | os.W_OK)


def _maps_access(pid: int) -> dict[str, int]:
    """``map_files`` entry name (``start-end``) -> access bits its mapping needs (``w`` only if shared)."""
    out: dict[str, int] = {}
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        rng, perms = fields[0], fields[1]
        start, end = (s.lstrip("0") or "0" for s in rng.split("-"))
        bits = os.R_OK if "r" in perms else 0
        if "w" in perms and "s" in perms:
            bits |= os.W_OK
        out[f"{start}-{end}"] = bits
    return out


def links(pid: int) -> Iterator[tuple[str, str, int]]:
    """``(what, /proc link, access)`` for each path-capable object of ``pid``."""
    for name, bits in (("cwd", os.X_OK), ("root", os.X_OK), ("exe", os.X_OK)):
        yield name, f"/proc/{pid}/{name}", bits
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in sorted(fds, key=int):
        yield f"fd {fd}", f"/proc/{pid}/fd/{fd}", _access_of_fd(pid, fd)
    maps = _maps_access(pid)
    try:
        ranges = os.listdir(f"/proc/{pid}/map_files")
    except OSError:
        ranges = []
    for rng in sorted(ranges):
        yield f"map {rng.split('-')[0]}", f"/proc/{pid}/map_files/{rng}", maps.get(rng, os.R_OK)


def target(link: str) -> tuple[str, os.stat_result] | None:
    """The path a /proc link names and the inode behind it; ``None`` when it is not a path (or is gone)."""
    try:
        name = os.readlink(link)
        st = os.stat(link)
    except OSError:
        return None
    if not name.startswith("/"):
        return None
    return name, st


def held_files(pids: Iterable[int]) -> list[HeldFile]:
    """Every linked (not deleted) path-based file the processes hold; deleted ones are ghost or
    link-remap files that CRIU copies into, or links beside, the images itself. A regular file held by an
    fd also gets its size and the fd's flags and position (``operations.file_copies``)."""
    out: list[HeldFile] = []
    for pid in pids:
        for what, link, bits in links(pid):
            found = target(link)
            if found is None:
                continue
            name, st = found
            if name.endswith(DELETED) or name.startswith(SKIPPED_PREFIXES):
                continue
            held = HeldFile(pid=pid, what=what, path=name, dev=st.st_dev, ino=st.st_ino, access=bits)
            if what.startswith("fd ") and stat.S_ISREG(st.st_mode):  # what a restore continues it from
                flags, pos = _fdinfo(pid, what.removeprefix("fd "))
                held = dataclasses.replace(held, size=st.st_size, pos=pos, flags=flags)
            out.append(held)
    return out


def creds(pid: int) -> Creds:
    """Real uid, gid and supplementary groups of ``pid``.

    Raises:
        OSError: the process is gone.
    """
    uid = gid = -1
    groups: tuple[int, ...] = ()
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Uid":
            uid = int(value.split()[0])
        elif key == "Gid":
            gid = int(value.split()[0])
        elif key == "Groups":
            groups = tuple(int(g) for g in value.split())
    return Creds(uid=uid, gid=gid, groups=groups)


def process_creds(pid: int) -> ProcessCreds:
    """The rights ``pid`` runs with: its filesystem uid and gid (the fourth ``Uid``/``Gid`` field of
    ``/proc/<pid>/status``, what the kernel checks opens against) and its supplementary groups.

    Raises:
        OSError: the process is gone.
    """
    fields = {
        k: v.split() for k, _, v in (ln.partition(":") for ln in Path(f"/proc/{pid}/status").read_text().splitlines())
    }
    return ProcessCreds(
        pid=pid,
        uid=int(fields["Uid"][3]),
        gid=int(fields["Gid"][3]),
        groups=tuple(int(g) for g in fields.get("Groups", [])),
    )
