"""A restore never gives a tree a file that the process holding it could not have opened as it ran.

CRIU restores as root and reopens by path every file the tree held (open and mapped files, the cwd,
the root, the exe, link-remap files) checking only size and mode. A user could therefore dump a process
holding ``~/d/x``, swap ``~/d/x`` (or ``~/d``) for a symlink to ``/etc/shadow`` and restore: the restored
process would hold root's file. The same holds when root takes and restores the snapshot of the user's
tree: the rights are the tree's, not the caller's (``access.tree_rights``). gpusnap closes this in three
places (docs/security.md):

1. At dump, while the tree is frozen, it records each such file's path and inode (``st_dev``,
   ``st_ino``) and the access its holder needs, and every process's credentials (:func:`record`).
2. Before CRIU runs, a helper that *is* the holder's user (``access.asowner``) resolves every recorded
   path with no symlink followed and checks that it reaches the same inode with that access
   (:func:`check_before_restore`); on another host only the rights are checked (inode numbers differ).
3. At CRIU's ``pre-resume`` notification, when every task is restored with its credentials but stopped
   before its first instruction, the same helper checks what the restored processes actually hold, each
   with the credentials it was given, inside their mount namespace (:func:`check_restored`): this closes
   the window between 2 and CRIU's own opens. A refusal kills the tree before it runs.

Processes that ran as root are not checked. Deleted files are ghost files that CRIU recreates from the
images (owned by the holder's user), or anonymous shared memory; a deleted file of anyone else is refused.
Every message says only what that user could find out alone (the helper runs as the user).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from gpusnap.daemon.access import asowner, tree_rights
from gpusnap.daemon.api.errors import NotFoundError, PermissionDeniedError
from gpusnap.daemon.api.types import Creds, HeldFile, ProcessCreds, Snapshot
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


def record(pids: Iterable[int]) -> tuple[tuple[HeldFile, ...], Creds | None, tuple[ProcessCreds, ...]]:
    """The held files of the frozen tree ``pids`` (root first), its root's credentials and every process's
    rights (``access.tree_rights``).

    Recorded for every snapshot, whoever takes it: a few /proc reads per file and process."""
    pids = list(pids)
    if not pids:
        return (), None, ()
    rights = []
    for pid in pids:
        try:
            rights.append(heldfiles.process_creds(pid))
        except OSError:  # gone: CRIU found it frozen, so it cannot be; nothing of it is restored then
            continue
    return tuple(heldfiles.held_files(pids)), heldfiles.creds(pids[0]), tuple(rights)


def _refuse(snapshot: Snapshot, bad: list[tuple[str, str, Creds]], when: str) -> None:
    listed = "; ".join(f"{where} {WHY[p].format(uid=creds.uid)}" for where, p, creds in bad[:SHOWN])
    more = f" (and {len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
    uid = bad[0][2].uid
    fix = "or restore as root" if snapshot.owner_uid != 0 else "whoever restores it: a restore acts as the tree ran"
    raise PermissionDeniedError(
        f"snapshot {snapshot.id} cannot be restored {when}: {listed}{more}. A restore may only give the tree "
        f"files uid {uid} can open itself: put the files back as they were at the dump (real "
        f"directories, no symlinks), {fix}",
        reason="FILE_NOT_PERMITTED",
        metadata={"snapshot": snapshot.id},
    )


def check_before_restore(snapshot: Snapshot, private_shm: bool) -> None:
    """Step 2: every recorded path still leads, without symlinks, to its inode, openable with the rights of the
    process that held it (``access.tree_rights``: nothing to check for a process that ran as root).

    Args:
        private_shm: the restore brings /dev/shm back from the images (its files are not checked here).

    Raises:
        PermissionDeniedError: reason ``FILE_NOT_PERMITTED``, naming up to three files and the fix.
    """
    rights = tree_rights.of(snapshot)
    if rights.user is None or not snapshot.held_files:
        return
    same_host = snapshot.host.hostname == host.hostname()
    held = [h for h in snapshot.held_files if not (private_shm and h.path.startswith("/dev/shm/"))]
    by_creds: dict[Creds, dict[tuple[str, int, int, int], HeldFile]] = {}
    for h in held:
        creds = rights.of(h.pid)
        if creds is not None:
            by_creds.setdefault(creds, {}).setdefault((h.path, h.access, h.dev, h.ino), h)
    bad: list[tuple[str, str, Creds]] = []
    for creds, unique in by_creds.items():
        items = [
            asowner.Item(path=h.path, access=h.access, dev=h.dev if same_host else -1, ino=h.ino if same_host else -1)
            for h in unique.values()
        ]
        problems = asowner.check(creds, items)
        bad += [
            (f"{h.path} ({h.what} of PID {h.pid})", p, creds)
            for h, p in zip(unique.values(), problems, strict=True)
            if p
        ]
    if bad:
        _refuse(snapshot, bad, "with the rights its tree ran with")


def check_restored(snapshot: Snapshot, root_pid: int, ghosts_dir: str = "") -> None:
    """Step 3: what the restored (not yet running) tree under host PID ``root_pid`` holds, each process's with
    the rights CRIU gave it back (``access.tree_rights``: a process that ran as root is not checked).

    Args:
        ghosts_dir: the root-only directory CRIU made this restore's ghost files in
            (``drivers.criu_userpaths``): what the tree holds there is a deleted file of the snapshot's,
            and is checked as one (CRIU removes their names once the tree resumes).

    Raises:
        PermissionDeniedError: reason ``FILE_NOT_PERMITTED``.
    """
    rights = tree_rights.of(snapshot)
    if rights.user is None:
        return
    items: dict[Creds, dict[tuple[str, int, int, int], str]] = {}
    bad: list[tuple[str, str, Creds]] = []
    for pid in proc.tree_pids(root_pid):
        try:
            creds = rights.of_restored(heldfiles.process_creds(pid).creds)
        except OSError:
            raise NotFoundError(f"restored process {pid} is gone", reason="PROCESS_NOT_FOUND") from None
        if creds is None:
            continue
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
                    bad.append((f"{gone} ({what} of restored PID {pid})", "denied", creds))
                continue
            items.setdefault(creds, {}).setdefault(
                (name, bits, st.st_dev, st.st_ino), f"{name} ({what} of restored PID {pid})"
            )
    for creds, found_items in items.items():
        keys = list(found_items)
        problems = asowner.check(
            creds, [asowner.Item(path=k[0], access=k[1], dev=k[2], ino=k[3]) for k in keys], mnt_ns_of=root_pid
        )
        bad += [(found_items[k], p, creds) for k, p in zip(keys, problems, strict=True) if p]
    if bad:
        _refuse(snapshot, bad, "as it was brought back")
