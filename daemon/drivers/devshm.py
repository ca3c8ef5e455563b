"""A tree's named POSIX shared memory (``/dev/shm``): found, saved beside the images, and CRIU's link remaps.

CRIU keeps only the path and size of a linked tmpfs file that a process maps or holds open, so the
files themselves travel in the snapshot (``save``) and a restore brings them back around CRIU.

A file mapped under a name since removed but still linked under another (glibc's ``sem_open`` maps
``sem.XXXXXX``, links it as ``sem.<name>`` and removes the first name: every multiprocessing lock of a
spawn-context engine) is dumped by CRIU as a *link remap*: a new hard link ``link_remap.<file id>`` in
the same directory, which its restore opens in place of the removed name. CRIU removes those names
after a dump that leaves the tree running or fails, but keeps them after one that kills the tree, for a
restore on the same host (CRIU's ``criu/files-reg.c``; docs/criu-limits.md). Kept, one outlives its
snapshot, and the next dump of a tree of the same shape (same file ids) fails on "Can't link remap
... File exists". gpusnap therefore carries them in the saved copy only: :func:`remove_link_remaps`
after each dump, :func:`put_back_link_remaps` before a restore into the host's /dev/shm.

The files themselves outlive a dump that ends the tree: nothing of the tree is left to remove them (vLLM's
``psm_*`` queues, 400 MiB for a tiny model). The snapshot holds them, so :func:`remove_ended` removes the
names that only the ended tree used, and :func:`put_back_link_remaps` puts a missing name back before a
restore into the host's /dev/shm.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

DEV_SHM = Path("/dev/shm")
LINK_REMAP_PREFIX = "link_remap."
"""CRIU's name for a link remap (``criu/files-reg.c``)."""


@dataclass(frozen=True)
class LinkRemap:
    """One name in /dev/shm and the inode it names, so only that file is ever removed: a link remap CRIU made,
    or a file a tree held (:func:`named`)."""

    path: Path
    dev: int
    ino: int


def files(pids: list[int], root: Path = DEV_SHM) -> list[Path]:
    """Every name under ``root`` of a file that one of ``pids`` holds open or maps, sorted.

    Matched by inode, so it also finds a file mapped under a name that was since removed but that is
    still linked under another one and, inside CRIU's post-dump, the link remaps CRIU made for those.
    """
    held = _held(pids, root)
    if not held:  # nothing of the tree is under root: no need to list it (a host's /dev/shm may be large)
        return []
    return _named_inodes(held, root)


def _held(pids: list[int], root: Path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file under ``root`` that one of ``pids`` holds open or maps."""
    held: set[tuple[int, int]] = set()
    prefix = str(root) + "/"
    for pid in pids:
        for sub in ("fd", "map_files"):
            try:
                entries = list(Path(f"/proc/{pid}/{sub}").iterdir())
            except OSError:
                continue
            for entry in entries:
                try:
                    if not os.readlink(entry).startswith(prefix):
                        continue
                    st = entry.stat()
                except OSError:
                    continue
                held.add((st.st_dev, st.st_ino))
    return held


def _named_inodes(held: set[tuple[int, int]], root: Path) -> list[Path]:
    """Every name under ``root`` of an inode of ``held``, sorted."""
    found: list[Path] = []
    try:
        with os.scandir(root) as it:
            for ent in it:
                try:
                    st = ent.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in held:
                    found.append(Path(ent.path))
    except OSError:
        return []
    return sorted(found)


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def named(paths: list[Path]) -> list[LinkRemap]:
    """Each of ``paths`` that is a regular file, with the inode it names now."""
    found = []
    for p in paths:
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found.append(LinkRemap(p, st.st_dev, st.st_ino))
    return found


def remove_ended(names: list[LinkRemap], ended: list[int], root: Path = DEV_SHM) -> list[Path]:
    """After a dump that ended the tree ``ended`` (its PIDs), whose files ``names`` the snapshot holds: remove
    each name that still names its inode when no other live process holds that file open or maps it. Returns
    the names removed.

    Another process that holds it keeps it, name and all (it may share it with the tree by name); a process
    that only opens it by name later finds it gone, as it would once the tree's own clean-up had run.
    """
    if not names:
        return []
    gone = set(ended)
    others = _held([p for p in _pids() if p not in gone], root)
    removed = []
    for n in names:
        if (n.dev, n.ino) in others:
            continue
        try:
            st = n.path.lstat()
            if (st.st_dev, st.st_ino) != (n.dev, n.ino):
                continue
            n.path.unlink()
        except OSError:
            continue
        removed.append(n.path)
    return removed


def save(names: list[Path], dest: Path) -> int:
    """Copy a tree's ``/dev/shm`` files (from :func:`files`) into ``dest``; returns bytes used.

    ``cp -a --sparse=always`` keeps holes (vLLM's queues are mostly sparse) and the hard links between
    a name and CRIU's link remap for it, which a copy file by file would break.
    """
    if not names:
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cp", "-a", "--sparse=always", "--", *map(str, names), str(dest) + "/"], check=True, capture_output=True
    )
    return sum(p.stat().st_blocks * 512 for p in dest.iterdir())


def link_remaps(names: list[Path]) -> list[LinkRemap]:
    """The link remaps among ``names`` (regular files only), with the inode each names."""
    return named([p for p in names if p.name.startswith(LINK_REMAP_PREFIX)])


def remove_link_remaps(remaps: list[LinkRemap]) -> None:
    """Remove each link remap that still names the inode it named.

    Only the extra name goes: the file stays for whoever still holds or names it."""
    for r in remaps:
        try:
            st = r.path.lstat()
            if (st.st_dev, st.st_ino) != (r.dev, r.ino):
                continue
            r.path.unlink()
        except OSError:
            continue


@dataclass
class PutBack:
    """What :func:`put_back_link_remaps` made in the host's /dev/shm."""

    remaps: list[LinkRemap]
    """Link remaps: removed once CRIU has opened them (:func:`remove_link_remaps`)."""
    names: list[LinkRemap]
    """Names the tree held that were gone (a dump that ended the tree removes them): the restored tree's
    from then on, as they were the source's; removed again only when the restore fails."""


def put_back_link_remaps(saved: Path, root: Path = DEV_SHM) -> PutBack:
    """Before a restore into ``root`` (the host's /dev/shm), give each saved file that is missing there its
    name again (the files of a tree whose dump ended it, :func:`remove_ended`), then each saved link remap.

    A link remap stands for a file that still has another name (``sem.<name>``). Where that name is
    in ``root`` as a regular file with the saved owner, mode and size, the link remap becomes a hard
    link to it, so the restored mapping and the name stay one file as they were; otherwise it is a new
    file (``O_EXCL``, never through a symlink) with the saved bytes, owner and mode. A missing name is
    put back the same way (a hard link to a name of the same file put back before it, else a new file).

    Raises:
        FileExistsError: a link remap's name is taken in ``root`` (by a dump made before gpusnap removed
            them, or by someone else), or a missing name was taken meanwhile; nothing made is left behind.
    """
    made = PutBack([], [])
    try:
        entries = sorted(saved.iterdir())
    except OSError:
        return made
    by_inode: dict[int, list[Path]] = {}
    for p in entries:
        by_inode.setdefault(p.lstat().st_ino, []).append(p)
    try:
        for remaps in (False, True):  # the names first: a link remap is then linked to its name
            for p in entries:
                st = p.lstat()
                if p.name.startswith(LINK_REMAP_PREFIX) != remaps or not stat.S_ISREG(st.st_mode):
                    continue
                if not remaps and os.path.lexists(root / p.name):
                    continue
                one = _put_back(p, st, [s for s in by_inode[st.st_ino] if s != p], root)
                (made.remaps if remaps else made.names).append(one)
    except BaseException:
        remove_link_remaps(made.remaps + made.names)
        raise
    return made


def _same_kind(a: os.stat_result, b: os.stat_result) -> bool:
    return stat.S_ISREG(a.st_mode) and (a.st_uid, a.st_gid, a.st_mode, a.st_size) == (
        b.st_uid,
        b.st_gid,
        b.st_mode,
        b.st_size,
    )


def _put_back(p: Path, st: os.stat_result, siblings: list[Path], root: Path) -> LinkRemap:
    target = root / p.name
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target))
    for sibling in siblings:
        host = root / sibling.name
        try:
            if not _same_kind(host.lstat(), st):
                continue
            os.link(host, target, follow_symlinks=False)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(target)) from None
        except OSError:
            continue
        got = target.lstat()
        if _same_kind(got, st):  # what was linked is what was checked (no swap in between)
            return LinkRemap(target, got.st_dev, got.st_ino)
        target.unlink()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with p.open("rb") as src, os.fdopen(os.dup(fd), "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, stat.S_IMODE(st.st_mode))
        got = os.fstat(fd)
    finally:
        os.close(fd)
    return LinkRemap(target, got.st_dev, got.st_ino)
