"""A snapshot restores as often as asked even when a file its tree writes has grown: later copies write copies.

CRIU records the size of every regular file a tree holds open, except one opened write-only with
``O_APPEND`` (a log), and refuses a restore when the file's size differs ("File … has bad size N (expect
M)", criu/files-reg.c). A file the tree writes at its own position (``open(path, "w")``, a shell's ``>``)
has grown as soon as the source (after ``dump --leave-running``) or a restored copy wrote to it. Cutting it
back would destroy what they wrote, and two copies writing one file at the same positions overwrite each
other. So (README, "Restoring a snapshot many times"; docs/criu-limits.md):

- The first restore of a snapshot whose dump ended its source (the first copy of a fan-out) continues
  such a file in place when it still has its size at the dump: the restored copy takes over.
- Every later restore (and that first one, when the file has changed size since) continues a copy of it:
  ``NAME.gpusnap-<operation>`` beside it (``…-<i>`` for copy ``i`` of a fan-out), which starts as the file's
  first M bytes (M: its size at the dump), made by the snapshot's owner with the file's mode bits. The file
  itself is neither cut back nor written by that copy. The restore's result names each copy.
- A file that is now shorter than at the dump is refused (``FILE_SHRUNK``): what the tree continues from
  is gone.

"The first restore" is a claim: the file :data:`~gpusnap.daemon.store.store.IN_PLACE` in the snapshot's
directory, created with ``O_EXCL`` by the restore that takes it, or at the dump when the source is left
running (it keeps the files). The helper makes the copies as the owner, in the tree's namespaces, and CRIU
inherits them (``inherit_fd``, keyed by the path) instead of opening any path
(:mod:`gpusnap.daemon.drivers.filecopies`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection

from gpusnap.daemon.access import tree_rights
from gpusnap.daemon.api.types import Creds, HeldFile, Snapshot
from gpusnap.daemon.drivers.filecopies import CopySpec, FileToCopy

INFIX = ".gpusnap-"
"""A copy's name is the file's name, this, and the restore's operation id (and ``-<i>`` in a fan-out)."""


def continued(held: HeldFile) -> bool:
    """Whether a restore continues ``held`` at its position in a file whose size CRIU checks: a regular file
    held by an fd opened for writing, but not write-only with ``O_APPEND`` (CRIU records no size then)."""
    if held.size < 0 or held.flags < 0 or held.flags & os.O_PATH:
        return False
    mode = held.flags & os.O_ACCMODE
    return mode != os.O_RDONLY and not (mode == os.O_WRONLY and held.flags & os.O_APPEND)


def request(
    snapshot: Snapshot, label: str, take_in_place: Callable[[], bool], fresh: Collection[str] = ()
) -> CopySpec | None:
    """What the restore's helper needs to give this copy of the tree its own copy of each file it writes
    without ``O_APPEND`` (``criu_exec``'s ``file_copies``), or ``None`` when the tree writes none.

    A file the tree holds through several open file descriptions (a writer and a reader, one with ``O_APPEND``
    and one without: CRIU's ``static/file_append``) is reopened from its copy once per description, each with
    its own position and flags (``reopen``: CRIU's external-file path, ``criu_userpaths``); a file held through
    one gets the copy's descriptor itself. Each copy is made with the rights of the process that writes the
    file (``access.tree_rights``).

    Args:
        label: the copy's operation id, with ``-<i>`` for copy ``i`` of a fan-out.
        take_in_place: takes the snapshot's in-place claim (called only when such a file exists); ``True``
            lets this restore continue files that still have their size at the dump in place.
        fresh: paths this restore brings back as copies of this tree's own, with their size at the dump (the
            /dev/shm files copied into a private /dev/shm): continued in place, never copied again.
    """
    written = {h.path for h in snapshot.held_files if continued(h) and h.path not in fresh}
    if not written:
        return None
    rights = tree_rights.of(snapshot)
    files = []
    for path in sorted(written):
        held = [h for h in snapshot.held_files if h.path == path]
        fds = {(h.pid, h.what) for h in held if h.what.startswith("fd ") and h.flags >= 0}
        writer = next(h for h in held if continued(h))
        creds = rights.of(writer.pid) or Creds(uid=0, gid=0)
        reads = any(h.access & os.R_OK for h in held)
        access = os.O_RDWR if reads or writer.flags & os.O_ACCMODE == os.O_RDWR else os.O_WRONLY
        reopen = len(fds) > 1
        files.append(
            FileToCopy(
                path=path,
                # CRIU's name of a regular file: its path without the first "/"; of an external one, the path
                key=path if reopen else path.lstrip("/") or ".",
                reopen=reopen,
                copy=os.path.basename(path) + INFIX + label,
                size=writer.size,
                pos=writer.pos,
                flags=(writer.flags & ~os.O_ACCMODE) | (os.O_RDWR if reopen else access),
                owner=creds,
            )
        )
    return CopySpec(in_place=take_in_place(), files=tuple(files))
