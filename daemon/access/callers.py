"""What a caller may do: change anything at all (not anonymous), checkpoint a process tree, use a snapshot,
and see what another user owns (docs/security.md).

Root may do everything to everyone's; any other caller acts on its own processes and snapshots only, and
an operation, snapshot or standby of another user answers as one that does not exist, so that nobody learns
what others hold.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from gpusnap.daemon.api.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from gpusnap.daemon.api.types import Caller, Snapshot
from gpusnap.daemon.drivers import proc


def sees(caller: Caller, owner_uid: int) -> bool:
    """Whether ``caller`` may see (and act on) what uid ``owner_uid`` owns: its own, or anything for root."""
    return caller.is_root or owner_uid == caller.uid


def owner_of(snapshot: Snapshot) -> Caller:
    """The caller the daemon acts as for ``snapshot``'s owner (the park ladder's keep-warm standbys): the
    owner's operation slots and tree bounds, not root's."""
    if snapshot.owner_uid == 0:
        return Caller(pid=0, uid=0, gid=0)
    gid = snapshot.owner_creds.gid if snapshot.owner_creds else snapshot.source.gid
    return Caller(pid=0, uid=snapshot.owner_uid, gid=gid)


def visible_uid(caller: Caller) -> int | None:
    """The uid whose things ``caller`` sees in a listing; ``None`` (everyone's) for root."""
    return None if caller.is_root else caller.uid


def require_identified(
    caller: Caller, doing: str = "change anything", certificate: str = "a client certificate"
) -> None:
    """Refuse anonymous callers (TCP without a verified client certificate) what only identified ones may do
    (``doing``: changes; the node's facts too, with ``certificate`` "a listed client certificate").

    Raises:
        PermissionDeniedError: reason ``ANONYMOUS``.
    """
    if caller.anonymous:
        raise PermissionDeniedError(
            f"callers without a verified client certificate may not {doing}; configure tls_client_ca "
            f"and connect with {certificate}, or use the Unix socket",
            reason="ANONYMOUS",
        )


def check_may_checkpoint(pid: int, caller: Caller) -> list[int]:
    """Refuse targets no caller may checkpoint, and other users' processes for non-root callers.

    Returns:
        The tree's PIDs, root first (as ``proc.tree_pids``).

    Raises:
        InvalidArgumentError: the daemon itself or one of its ancestors.
        PermissionDeniedError: a non-root caller names a process it does not own.
        NotFoundError: no such process.
    """
    status = proc.status(pid)
    tgid = (status.get("Tgid") or [str(pid)])[0]
    if tgid != str(pid):
        raise InvalidArgumentError(
            f"{pid} is a thread of process {tgid}; checkpoint the process (or its tree's root) instead",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    if pid == 2 or (status.get("PPid") or [""])[0] == "2":
        raise InvalidArgumentError(
            f"PID {pid} is a kernel thread; only user processes can be checkpointed",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    own = os.getpid()
    if pid in {own, *proc.ancestors(own)}:
        raise InvalidArgumentError(
            f"PID {pid} is gpusnapd itself or one of its ancestors; name the worker's process tree instead",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    tree = proc.tree_pids(pid)
    if caller.pid and caller.pid in tree:
        raise InvalidArgumentError(
            f"the tree of PID {pid} contains the calling process ({caller.pid}), whose connection to gpusnapd "
            "cannot be captured; call gpusnap from outside the tree",
            reason="INVALID_PID",
            metadata={"pid": str(pid)},
        )
    owners = set()
    for p in tree:
        if p == own:
            raise InvalidArgumentError(
                f"the tree of PID {pid} contains gpusnapd itself", reason="INVALID_PID", metadata={"pid": str(pid)}
            )
        uid = proc.real_uid(p)
        if uid is not None:
            owners.add(uid)
    if not caller.is_root and owners != {caller.uid}:
        raise PermissionDeniedError(
            f"PID {pid} (or a process of its tree) does not belong to uid {caller.uid}; "
            "only root may checkpoint other users' processes",
            reason="NOT_OWNER",
            metadata={"pid": str(pid)},
        )
    if not caller.is_root:
        check_plain_rights(tree, caller.uid)
    return tree


def check_plain_rights(pids: list[int], uid: int) -> None:
    """Refuse a non-root caller's tree with a process that holds more than uid ``uid``'s own rights.

    Checked at preflight and again on the frozen tree (a process may exec a set-user-ID program between).

    Raises:
        PermissionDeniedError: reason ``NOT_OWNER``, naming the process and what it holds.
    """
    for p in pids:
        extra = _rights_beyond(p, uid)
        if extra:
            raise PermissionDeniedError(
                f"process {p} of the tree runs with rights beyond uid {uid}'s own ({extra}): a set-user-ID or "
                "set-group-ID program, or one with file capabilities, whose restore would bring them back; end it "
                "before the capture, or have root checkpoint the tree",
                reason="NOT_OWNER",
                metadata={"pid": str(p)},
            )


def _rights_beyond(pid: int, uid: int) -> str:
    """What ``pid`` holds beyond a plain process of ``uid`` (``/proc/<pid>/status``: every uid ``uid``, its
    effective, saved and filesystem gids its real one, no permitted, effective or ambient capability); ``""``
    when nothing or gone. CRIU restores all of these from the images (``creds`` of ``core-*.img``)."""
    fields = proc.status(pid)
    uids, gids = fields.get("Uid", []), fields.get("Gid", [])
    names = ("real", "effective", "saved", "filesystem")
    for name, value in zip(names, uids, strict=False):
        if int(value) != uid:
            return f"{name} uid {value}"
    for name, value in zip(names[1:], gids[1:], strict=False):
        if gids and value != gids[0]:
            return f"{name} gid {value}, real gid {gids[0]}"
    for key in ("CapPrm", "CapEff", "CapAmb"):
        if int((fields.get(key) or ["0"])[0], 16):
            return f"capabilities {key}={fields[key][0]}"
    return ""


def check_may_restore(snapshot: Snapshot, caller: Caller, missing: Callable[[], NotFoundError]) -> None:
    """Non-root callers may use only snapshots they took of their own processes.

    Args:
        missing: the error the store gives for a snapshot it does not have: another user's snapshot gets
            the same, so that a caller learns nothing of snapshots that are not theirs.

    Raises:
        NotFoundError: another user's snapshot (``missing()``).
        PermissionDeniedError: the caller's snapshot of another user's processes (reason ``NOT_OWNER``).
    """
    if caller.is_root:
        return
    if snapshot.owner_uid != caller.uid:
        raise missing()
    if snapshot.source.uid != caller.uid:
        raise PermissionDeniedError(
            f"snapshot {snapshot.id} holds processes of uid {snapshot.source.uid}; only root may use it",
            reason="NOT_OWNER",
            metadata={"snapshot": snapshot.id},
        )
