"""StandbyRegistry: the standbys of this node, durable across gpusnapd restarts.

A standby is a snapshot restored ahead of demand (``gpusnap standby``, ``gpusnap.daemon.operations.standby``):
CRIU has brought its tree back into a fresh PID namespace and left every task stopped, its CUDA processes are
CHECKPOINTED (no GPU memory), its agents quiesced, and its buffers pinned in the buffer store. Activation
(``gpusnap activate``, or a restore of its snapshot) claims it, so that exactly one activation gets it.

The registry lives in ``<store>/standbys.json`` (rewritten atomically on every change). At start,
:meth:`StandbyRegistry.adopt` keeps each standby whose namespace init and root are the same processes (PID and
start time) and still stopped, and kills what is left of the others; a standby an activation had claimed when
gpusnapd stopped belongs to that activation's recovery (the operation journal), never to the registry.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog

from gpusnap.daemon.drivers import proc, restored
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError

log = structlog.get_logger(__name__)

FILE = "standbys.json"
READY = "ready"
ACTIVATING = "activating"
KEEP_GONE = 256
"""Standbys activated or dropped that an ``activate`` still recognises (it then restores their snapshot)."""


def new_standby_id() -> str:
    """A fresh id: ``sb-`` + 26 lowercase base32 characters."""
    return "sb-" + base64.b32encode(os.urandom(16)).decode().lower().rstrip("=")


@dataclasses.dataclass(frozen=True)
class Standby:
    """One standby: its snapshot and owner, and where its stopped tree lives (host PIDs, start times in
    seconds since the epoch as ``proc.start_time`` gives them)."""

    id: str
    snapshot_id: str
    owner_uid: int
    created: datetime
    init_pid: int
    init_start: float
    root: int
    root_start: float
    ns_pid: int
    pids: tuple[int, ...]
    restored: tuple[int, ...]
    """The processes CRIU restored, counted before any ran (the restore's validation)."""
    cuda_pids: tuple[int, ...]
    private_network: bool
    host_memory_bytes: int
    """Resident memory of its tree when it was made (bytes; :meth:`now` gives what it holds now)."""
    digests: tuple[str, ...] = ()
    """Its snapshot's buffer digests, pinned in the buffer store while it stands by."""
    buffer_uid: int = 0
    state: str = READY

    def tree_alive(self) -> bool:
        """Its namespace init and root are the processes it was made with (same start times)."""
        return _same(self.init_pid, self.init_start) and _same(self.root, self.root_start)

    def live_memory_bytes(self, table: proc.ProcessTable | None = None) -> int:
        """Resident memory of its tree now, its namespace init included (bytes; 0 once it is gone): what the
        standby budget and the owner's tree bounds count, however the tree changed since it was made (its
        owner may continue its processes). ``table``: one listing of the processes for many standbys."""
        table = table or proc.ProcessTable.now()
        if _same(self.init_pid, self.init_start):
            return proc.rss_bytes(table.descendants(self.init_pid))
        return proc.rss_bytes(table.descendants(self.root)) if _same(self.root, self.root_start) else 0

    def now(self, table: proc.ProcessTable | None = None) -> Standby:
        """This standby with ``host_memory_bytes`` as its tree holds now (:meth:`live_memory_bytes`)."""
        return dataclasses.replace(self, host_memory_bytes=self.live_memory_bytes(table))


def _same(pid: int, start: float) -> bool:
    """``pid`` is the process that started at ``start`` and is alive (a zombie is not)."""
    return bool(pid) and abs(proc.start_time(pid) - start) < 0.01 and proc.alive(pid)


def kill(standby: Standby) -> None:
    """Kill a standby's tree: its namespace init takes every process inside with it. CUDA processes of a
    standby are CHECKPOINTED (they hold no GPU state), so no GPU release comes first (cuda-checkpoint#53)."""
    if _same(standby.init_pid, standby.init_start):
        restored.end_now(standby.init_pid)  # (its init removes the tree's file copies)
    if _same(standby.root, standby.root_start):
        proc.kill_tree(proc.tree_pids_or_empty(standby.root))


class StandbyRegistry:
    """The node's standbys (see the module docstring). Thread-safe.

    Args:
        path: the registry file (``<store>/standbys.json``).
        on_change: called (without the registry's lock) after a standby is added, claimed or removed.
    """

    def __init__(self, path: Path, on_change: Callable[[], None] | None = None):
        self.path = path
        self.on_change = on_change
        self._lock = threading.Lock()
        self._standbys: dict[str, Standby] = {}
        self._gone: collections.OrderedDict[str, Standby] = collections.OrderedDict()
        """Standbys activated or dropped, by id (the newest ``KEEP_GONE``)."""

    def adopt(self, still_standing: Callable[[Standby], str]) -> tuple[list[Standby], list[tuple[Standby, str]]]:
        """Read the registry file at start and keep each standby ``still_standing`` answers ``""`` for;
        kill the tree of every other one (the answer says why) and forget it. A standby claimed by an
        activation is forgotten without a kill (the activation's recovery owns its tree).

        Returns:
            (adopted, [(dropped, why)]).
        """
        try:
            saved = documents.load_items(self.path, Standby)
        except FileNotFoundError:
            saved = ()
        except (OSError, DocumentError) as exc:
            log.error("standby.registry_unreadable", path=str(self.path), error=str(exc))
            saved = ()
        adopted: list[Standby] = []
        dropped: list[tuple[Standby, str]] = []
        for sb in saved:
            if sb.state != READY:
                dropped.append((sb, "an activation had claimed it when gpusnapd stopped (its recovery decides)"))
                continue
            why = "its tree is gone" if not sb.tree_alive() else still_standing(sb)
            if why:
                kill(sb)
                dropped.append((sb, why))
                continue
            adopted.append(sb)
        with self._lock:
            self._standbys = {sb.id: sb for sb in adopted}
            self._save_locked()
        for sb, why in dropped:
            log.warning("standby.dropped_at_start", standby=sb.id, snapshot=sb.snapshot_id, why=why)
        for sb in adopted:
            log.info("standby.adopted", standby=sb.id, snapshot=sb.snapshot_id, root=sb.root)
        return adopted, dropped

    def add(self, standby: Standby) -> None:
        """Register a new standby (durable before returning)."""
        with self._lock:
            self._standbys[standby.id] = standby
            self._save_locked()
        self._changed()

    def get(self, standby_id: str) -> Standby | None:
        with self._lock:
            return self._standbys.get(standby_id)

    def gone(self, standby_id: str) -> Standby | None:
        """A standby activated or dropped lately (``None``: unknown id)."""
        with self._lock:
            return self._gone.get(standby_id)

    def list(self, owner_uid: int | None = None, snapshot_id: str = "") -> list[Standby]:
        """Standbys (of ``owner_uid``, of ``snapshot_id``, when given), oldest first."""
        with self._lock:
            found = [
                s
                for s in self._standbys.values()
                if (owner_uid is None or s.owner_uid == owner_uid) and (not snapshot_id or s.snapshot_id == snapshot_id)
            ]
        return sorted(found, key=lambda s: (s.created, s.id))

    def claim(self, standby_id: str) -> Standby | None:
        """Take a ready standby for one activation (durable before returning); ``None`` when it is not
        ready (another activation has it, or it is gone)."""
        with self._lock:
            sb = self._standbys.get(standby_id)
            if sb is None or sb.state != READY:
                return None
            claimed = self._standbys[standby_id] = dataclasses.replace(sb, state=ACTIVATING)
            self._save_locked()
        self._changed()
        return claimed

    def unclaim(self, standby_id: str) -> None:
        """Give back a standby :meth:`claim` took, untouched (its activation never started)."""
        with self._lock:
            sb = self._standbys.get(standby_id)
            if sb is None or sb.state != ACTIVATING:
                return
            self._standbys[standby_id] = dataclasses.replace(sb, state=READY)
            self._save_locked()
        self._changed()

    def claim_for(self, snapshot_id: str, private_network: bool) -> Standby | None:
        """Claim the oldest ready standby of ``snapshot_id`` made with ``private_network``; ``None``: none."""
        while True:
            ready = [
                s
                for s in self.list(snapshot_id=snapshot_id)
                if s.state == READY and s.private_network == private_network
            ]
            if not ready:
                return None
            claimed = self.claim(ready[0].id)
            if claimed is not None:
                return claimed

    def remove(self, standby_id: str) -> Standby | None:
        """Forget a standby (activated, or dropped: the caller has killed its tree); durable before
        returning. It is remembered for :meth:`gone`."""
        with self._lock:
            sb = self._standbys.pop(standby_id, None)
            if sb is None:
                return None
            self._gone[standby_id] = sb
            while len(self._gone) > KEEP_GONE:
                self._gone.popitem(last=False)
            self._save_locked()
        self._changed()
        return sb

    def _save_locked(self) -> None:
        documents.save_items(self.path, sorted(self._standbys.values(), key=lambda s: s.id))

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # an observer (the park ladder) must not fail a standby's bookkeeping
                log.exception("standby.observer_failed")


def now() -> datetime:
    return datetime.now(UTC)
