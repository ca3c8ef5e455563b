"""Whose rights a restore acts with: those its tree's processes ran with, whoever took or restores the snapshot.

A snapshot an orchestrator (root) takes of user A's worker is root's to list and restore, but the tree in it
ran as A: everything a restore does for it by a path (the files CRIU reopens, the unix sockets it binds, the
copies of files it continues writing, the terminal file) is done with A's rights, as if A restored it
(docs/security.md, "A snapshot's rights are its tree's"). Where a tree's processes ran as several users, each
path a process held is opened with the rights that process ran with; what CRIU makes for the tree as a whole
(named sockets, ghost files) is made as the tree's user (:attr:`TreeRights.user`). Only a tree whose every
process ran as root is restored as CRIU does it.

The rights come from the manifest's ``tree_creds`` (recorded at dump, while the tree is frozen). Snapshots of
older gpusnap lack them: every process then gets the root process's credentials (``owner_creds``, recorded
for every snapshot since file rights were checked), or its uid and gid. A non-root owner's snapshot never
grants more than that owner's rights, whatever its manifest says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpusnap.daemon.api.types import Creds, Snapshot


@dataclasses.dataclass(frozen=True)
class TreeRights:
    """The rights of a snapshot's processes (host PID at dump -> credentials) and of the tree as a whole."""

    by_pid: Mapping[int, Creds]
    user: Creds | None
    """The tree's user: the root process's credentials when it ran as a user, else the first process's that
    did; ``None`` when every process ran as root."""

    def of(self, pid: int) -> Creds | None:
        """The rights process ``pid`` (host PID at dump) ran with; ``None``: root's (nothing to check). A PID
        the manifest does not know gets the tree's user's."""
        creds = self.by_pid.get(pid, self.user)
        return None if creds is None or creds.uid == 0 else creds

    def of_restored(self, creds: Creds) -> Creds | None:
        """The rights a restored process is checked with, given those CRIU gave it (``creds``, read from
        ``/proc``); ``None``: root's. A tree with a user never gets a process checked as root unless it ran
        as root at dump."""
        if creds.uid != 0:
            return creds
        ran_as_root = any(c.uid == 0 for c in self.by_pid.values())
        return None if ran_as_root else self.user


def of(snapshot: Snapshot) -> TreeRights:
    """The rights ``snapshot``'s tree is restored with (see the module docstring)."""
    root_pid = snapshot.source.tree_pids[0] if snapshot.source.tree_pids else snapshot.source.pid
    fallback = snapshot.owner_creds or Creds(uid=snapshot.source.uid, gid=snapshot.source.gid)
    if snapshot.tree_creds:
        by_pid = {p.pid: p.creds for p in snapshot.tree_creds}
    else:  # an older manifest: every process as the root process
        by_pid = {pid: fallback for pid in (*snapshot.source.tree_pids, root_pid)}
    if snapshot.owner_uid != 0:  # a user's own snapshot: never more than the user's rights
        own = fallback if fallback.uid == snapshot.owner_uid else Creds(snapshot.owner_uid, snapshot.source.gid)
        by_pid = {pid: c if c.uid == snapshot.owner_uid else own for pid, c in by_pid.items()}
    users = [c for c in by_pid.values() if c.uid != 0]
    root = by_pid.get(root_pid)
    user = root if root is not None and root.uid != 0 else (users[0] if users else None)
    return TreeRights(by_pid=by_pid, user=user)
