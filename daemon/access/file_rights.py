"""A restore never gives a non-root snapshot's tree a file its owner could not open.

CRIU restores as root and reopens by path every file the tree held (open and mapped files, the cwd,
the root, the exe, link-remap files) checking only size and mode. A user could therefore dump a process
holding ``~/d/x``, swap ``~/d/x`` (or ``~/d``) for a symlink to ``/etc/shadow`` and restore: the restored
process would hold root's file. gpusnap closes this in three places (docs/security.md):

1. At dump, while the tree is frozen, it records each such file's path and inode (``st_dev``,
   ``st_ino``) and the access its holder needs, and the owner's credentials (:func:`record`).
2. Before CRIU runs, a helper that *is* the owner (``access.asowner``) resolves every recorded path
   with no symlink followed and checks that it reaches the same inode with that access
   (:func:`check_before_restore`); on another host only the rights are checked (inode numbers differ).
3. At CRIU's ``pre-resume`` notification, when every task is restored but stopped before its first
   instruction, the same helper checks what the restored processes actually hold, inside their mount
   namespace (:func:`check_restored`): this closes the window between 2 and CRIU's own opens. A refusal
   kills the tree before it runs.

Deleted files are ghost files that CRIU recreates from the images (owned by the owner), or anonymous
shared memory; a deleted file of anyone else is refused. Every message says only what the owner could
find out alone (the helper runs as the owner).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpusnap.daemon.access import asowner
from gpusnap.daemon.api.errors import PermissionDeniedError
from gpusnap.daemon.api.types import Creds, HeldFile, Snapshot
from gpusnap.daemon.drivers import heldfiles, host, proc

ANONYMOUS_SHARED = re.compile(r"^/(dev/zero|SYSV[0-9a-f]{8}|memfd:.*)$")
"""Link names of shared anonymous memory (mmap MAP_SHARED|MAP_ANONYMOUS, SysV shm, memfd): no path."""
SHOWN = 3
"""Problems named in one error."""
WHY = {
    "missing": "is missing",
    "symlink": "is reached through a symlink",
    "replaced": "is not the file the snapshot held (replaced or moved since)",
    "denied": "is not one uid {uid} may open with the access the process needs",
}


def record(pids: Iterable[int]) -> tuple[tuple[HeldFile, ...], Creds | None]:
    """The held files of the frozen tree ``pids`` (root first) and its root's credentials.

    Recorded for root's snapshots too (only non-root ones are checked): a few /proc reads per file."""
    pids = list(pids)
    if not pids:
        return (), None
    return tuple(heldfiles.held_files(pids)), heldfiles.creds(pids[0])


def owner_creds(snapshot: Snapshot) -> Creds:
    """The credentials a non-root snapshot is restored with: its owner's, as recorded at the dump."""
    c = snapshot.owner_creds
    if c is not None and c.uid == snapshot.owner_uid:
        return c
    return Creds(uid=snapshot.owner_uid, gid=snapshot.source.gid, groups=())


def _refuse(snapshot: Snapshot, creds: Creds, bad: list[tuple[str, str]], when: str) -> None:
    listed = "; ".join(f"{where} {WHY[p].format(uid=creds.uid)}" for where, p in bad[:SHOWN])
    more = f" (and {len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
    raise PermissionDeniedError(
        f"snapshot {snapshot.id} cannot be restored {when}: {listed}{more}. A restore may only give the tree "
        f"files uid {creds.uid} can open itself: put the files back as they were at the dump (real "
        "directories, no symlinks) or restore as root",
        reason="FILE_NOT_PERMITTED",
        metadata={"snapshot": snapshot.id},
    )


def check_before_restore(snapshot: Snapshot, private_shm: bool) -> None:
    """Step 2: every recorded path still leads, without symlinks, to its inode, openable by the owner.

    Args:
        private_shm: the restore brings /dev/shm back from the images (its files are not checked here).

    Raises:
        PermissionDeniedError: reason ``FILE_NOT_PERMITTED``, naming up to three files and the fix.
    """
    if snapshot.owner_uid == 0 or not snapshot.held_files:
        return
    same_host = snapshot.host.hostname == host.hostname()
    held = [h for h in snapshot.held_files if not (private_shm and h.path.startswith("/dev/shm/"))]
    unique = {(h.path, h.access, h.dev, h.ino): h for h in held}
    items = [
        asowner.Item(path=h.path, access=h.access, dev=h.dev if same_host else -1, ino=h.ino if same_host else -1)
        for h in unique.values()
    ]
    creds = owner_creds(snapshot)
    problems = asowner.check(creds, items)
    bad = [(f"{h.path} ({h.what} of PID {h.pid})", p) for h, p in zip(unique.values(), problems, strict=True) if p]
    if bad:
        _refuse(snapshot, creds, bad, "by its owner")


def check_restored(snapshot: Snapshot, root_pid: int, ghosts_dir: str = "") -> None:
    """Step 3: what the restored (not yet running) tree under host PID ``root_pid`` holds is the owner's to open.

    Args:
        ghosts_dir: the root-only directory CRIU made this restore's ghost files in
            (``drivers.criu_userpaths``): what the tree holds there is a deleted file of the snapshot's,
            and is checked as one (CRIU removes their names once the tree resumes).

    Raises:
        PermissionDeniedError: reason ``FILE_NOT_PERMITTED``.
    """
    if snapshot.owner_uid == 0:
        return
    creds = owner_creds(snapshot)
    items: dict[tuple[str, int, int, int], str] = {}
    bad: list[tuple[str, str]] = []
    for pid in proc.tree_pids(root_pid):
        for what, link, bits in heldfiles.links(pid):
            found = heldfiles.target(link)
            if found is None:
                continue
            name, st = found
            if name.startswith(heldfiles.SKIPPED_PREFIXES):
                continue
            ghost = bool(ghosts_dir) and name.startswith(ghosts_dir + "/")
            if name.endswith(heldfiles.DELETED) or ghost:
                gone = name.removesuffix(heldfiles.DELETED)
                if st.st_uid != creds.uid and not ANONYMOUS_SHARED.match(gone):
                    bad.append((f"{gone} ({what} of restored PID {pid})", "denied"))
                continue
            items.setdefault((name, bits, st.st_dev, st.st_ino), f"{name} ({what} of restored PID {pid})")
    keys = list(items)
    problems = asowner.check(
        creds, [asowner.Item(path=k[0], access=k[1], dev=k[2], ino=k[3]) for k in keys], mnt_ns_of=root_pid
    )
    bad += [(items[k], p) for k, p in zip(keys, problems, strict=True) if p]
    if bad:
        _refuse(snapshot, creds, bad, "as it was brought back")
