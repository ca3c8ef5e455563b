"""The park ladder: each workload's rung, the moves its policy asks for, an event for every move.

A workload is a snapshot and every copy of it on this node. Its rung is the highest one it holds a copy on:

    active     a tree gpusnapd restored or activated from it runs (on a GPU when it has GPU state)
    suspended  such a tree is suspended in place (``gpusnap suspend``): GPU memory freed, the process alive
    standby    restored ahead (``gpusnap standby``): stopped, CUDA-checkpointed, in host memory
    ram        its snapshot, with every buffer (weights) in the RAM tier
    disk       its snapshot, some buffer on the disk tier
    remote     its snapshot, some buffer only in the remote store (S3)

What moves a workload (:meth:`Ladder.tick`, every ``[park] interval_s`` and after every operation):

- ``keep_warm``: the ladder makes standbys (one standby operation at a time per snapshot, highest priority
  first) until the snapshot has as many as its policy keeps warm, and makes a new one when a restore or an
  activation took one.
- Idleness: a standby beyond ``keep_warm`` that has stood ``standby_idle_s`` is dropped (standby → ram/disk);
  the buffer tiers move their least recently used blobs down when over budget (ram → disk; disk → remote
  once the remote store holds them), lowest priority first (``BufferStore.rank``).
- Budgets (``[park]``: ``standby_ram_bytes``, ``gpu_bytes``; the tiers' ``ram_tier_bytes``,
  ``disk_tier_bytes``). A standby operation reserves its copies' image bytes before CRIU runs and a restore or
  activation its GPU memory (CUDA state plus buffers) before anything moves, under one lock, so operations
  running at once never pass a budget together. A standby that does not fit first takes the room of
  standbys of lower priority (dropped: lowest priority, beyond ``keep_warm``, oldest first); else it, like a
  restore over the GPU budget, is refused (``PARK_BUDGET``, a retry). A running tree is never suspended or
  stopped by the ladder: active and suspended change only by operations (restore, activate, suspend, resume).
- A move never loses the only copy: dropping a standby leaves its snapshot (which cannot be deleted while it
  has standbys), a tier move copies before it removes, and the disk tier drops a blob only once the remote
  store holds it whole (``gpusnap.daemon.remote.evict``). The ladder deletes no snapshot.

Every rung change of a workload, whoever caused it, is an event (:attr:`Ladder.events`, the API's
``GetLadder``, the log line ``park.move``, the metric ``gpusnap_park_moves_total``), credited to its cause: an
operation's end to the workloads that operation was about (its snapshot, the tree it suspended), the ladder's
own drops to the standby's workload, and what happens outside both at the next pass (a restored tree that ended
or was stopped, a standby dropped by hand, a deleted snapshot, a tier move), each with its own reason.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import structlog

from gpusnap.daemon.api.errors import GpusnapError, InvalidArgumentError, ResourceExhaustedError
from gpusnap.daemon.api.sizes import human_size
from gpusnap.daemon.api.types import FinishedOperation, OperationKind, Policy, RestoreResult, Snapshot
from gpusnap.daemon.drivers import proc
from gpusnap.daemon.park.policy import Policies, Rule
from gpusnap.daemon.park.standbys import READY, Standby, StandbyRegistry
from gpusnap.daemon.store import SnapshotStore, documents
from gpusnap.daemon.store.documents import DocumentError

log = structlog.get_logger(__name__)

ACTIVE_FILE = "park-active.json"
KEEP_EVENTS = 256
RETRY_S = 60.0
"""After a standby the ladder made failed, it tries that snapshot again only this much later."""


class Started(Protocol):
    """An operation the ladder started (a standby of ``keep_warm``), as it checks on it at its next pass."""

    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> GpusnapError | None: ...


class Rung(enum.IntEnum):
    """Highest first (the order of ``gpusnap.v1.Rung``)."""

    ACTIVE = 1
    SUSPENDED = 2
    STANDBY = 3
    RAM = 4
    DISK = 5
    REMOTE = 6

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclasses.dataclass(frozen=True)
class Event:
    """One move of a workload from one rung to another."""

    time: datetime
    snapshot_id: str
    from_rung: Rung | None
    to_rung: Rung | None
    reason: str


@dataclasses.dataclass(frozen=True)
class Tracked:
    """A tree gpusnapd restored or activated (host PIDs; its start time names it)."""

    snapshot_id: str
    root: int
    root_start: float
    gpu_bytes: int
    suspended: bool = False


@dataclasses.dataclass(frozen=True)
class Workload:
    """One row of the ladder."""

    snapshot: Snapshot
    rung: Rung
    active: int
    suspended: int
    standbys: int
    policy: Policy
    host_memory_bytes: int
    gpu_memory_bytes: int
    ram_tier_bytes: int
    note: str = ""
    """Why its policy is not met now (keep_warm deferred: over a budget, the standby failed); empty when it is."""


@dataclasses.dataclass(frozen=True)
class Budget:
    name: str
    used_bytes: int
    budget_bytes: int


def gpu_need(snapshot: Snapshot) -> int:
    """GPU memory a running copy of ``snapshot`` holds: its CUDA state at capture plus its buffers (bytes;
    0 without GPU state)."""
    if not snapshot.gpu_processes:
        return 0
    return sum(g.gpu_memory_bytes for g in snapshot.gpu_processes) + snapshot.buffer_bytes


def blob_rank(policies: Policies, store: SnapshotStore, key: str) -> int:
    """``BufferStore.rank``: the highest park priority (``policies``) of ``store``'s snapshots using blob
    ``<uid>/<digest>`` (0 when none uses it); ``build_daemon`` hands it to the store at construction."""
    uid, _, digest = key.partition("/")
    ranks = [
        policies.effective(s).priority or 0
        for s in store.list()
        if str(s.buffer_uid) == uid and any(b.sha256 == digest for b in s.buffers)
    ]
    return max(ranks, default=0)


class Ladder:
    """The node's park ladder (module docstring). Thread-safe.

    Args:
        store: the snapshot store (its buffer tiers are the ram/disk/remote rungs).
        standbys: the node's standbys.
        policies: the node's park policies and ``[park]`` settings.
        state_dir: where the tracked trees are kept (``park-active.json``).
        remote: whether a remote store is configured (a blob missing locally is then on the remote rung).
        make_standby: starts a standby operation of one copy of a snapshot, as the snapshot's owner
            (``Daemon.standby``: the owner's operation slots and tree bounds); the ladder makes none without it.
        drop_standby: drops a standby by id (``operations.standby.drop``); the ladder drops none without it.
    """

    def __init__(
        self,
        store: SnapshotStore,
        standbys: StandbyRegistry,
        policies: Policies,
        state_dir: Path,
        remote: bool,
        *,
        make_standby: Callable[[Snapshot], Started] | None = None,
        drop_standby: Callable[[str], object] | None = None,
    ):
        self.store = store
        self.standbys = standbys
        self.policies = policies
        self.config = policies.config
        self.remote = remote
        self.events: collections.deque[Event] = collections.deque(maxlen=KEEP_EVENTS)
        self.moves: collections.Counter[tuple[str, str]] = collections.Counter()
        self.make_standby = make_standby
        """Starts a standby operation of one copy of a snapshot, as its owner (``Daemon.standby``)."""
        self.drop_standby = drop_standby
        """Drops a standby by id (``operations.standby.drop``)."""
        self._active_path = state_dir / ACTIVE_FILE
        self._lock = threading.RLock()
        self._tracked: dict[int, Tracked] = {}
        self._reserved: dict[str, dict[int, int]] = {"standby_ram": {}, "gpu": {}}
        self._next_reservation = 0
        self._making: dict[str, Started] = {}
        self._failed_at: dict[str, float] = {}
        self._unmet: dict[str, str] = {}
        """Snapshot id -> why its keep_warm is not met now (the last refusal of the standby the ladder asked for)."""
        self._last: dict[str, Rung] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    def load(self) -> None:
        """Read the trees tracked before a restart; keep those still alive (same PID and start time)."""
        try:
            found = documents.load_items(self._active_path, Tracked)
        except FileNotFoundError:
            found = ()
        except (OSError, DocumentError) as exc:
            log.error("park.active_unreadable", error=str(exc))
            found = ()
        with self._lock:
            self._tracked = {t.root: t for t in found if abs(proc.start_time(t.root) - t.root_start) < 0.01}
            self._save_tracked()
            self._last = {w.snapshot.id: w.rung for w in self._workloads()}

    def start(self) -> None:
        """Run :meth:`tick` every ``interval_s`` (and when :meth:`poke` asks) on a thread of its own."""
        self._thread = threading.Thread(target=self._loop, name="gpusnap-park", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)

    def poke(self) -> None:
        """Ask for a pass soon (after an operation, a policy change)."""
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # the ladder must keep running; the next pass tries again
                log.exception("park.tick_failed")
            self._wake.wait(self.config.interval_s)
            self._wake.clear()

    # -- what operations tell the ladder --------------------------------------------------------------------

    def after_operation(self, record: FinishedOperation) -> None:
        """Track the tree a restore or activation brought up, a suspend or resume of a tracked tree, and
        record the rung changes it caused; then ask for a pass (it subscribes to the operation registry)."""
        if record.succeeded:
            with self._lock:
                if isinstance(record.result, RestoreResult):
                    self.track(record.result)
                elif record.kind in (OperationKind.SUSPEND, OperationKind.RESUME) and record.target_pid:
                    found = self._tracked.get(record.target_pid)
                    if found is not None:
                        suspended = record.kind is OperationKind.SUSPEND
                        self._tracked[found.root] = dataclasses.replace(found, suspended=suspended)
                        self._save_tracked()
        self.observe(f"{record.kind.value} {record.id}", only=self._about(record))
        self.poke()

    def _about(self, record: FinishedOperation) -> set[str]:
        """The workloads (snapshot ids) an operation was about: its snapshot (target or result), its standbys',
        or the one whose tree it suspended or resumed. None for an operation on an untracked tree (a dump of a
        PID, its dry run)."""
        about = {record.target_snapshot} if record.target_snapshot else set()
        result = record.result
        if isinstance(result, Snapshot | RestoreResult):
            about.add(result.id if isinstance(result, Snapshot) else result.snapshot_id)
        elif isinstance(result, tuple):
            about.update(s.snapshot_id for s in result if isinstance(s, Standby))
        tracked = self._tracked.get(record.target_pid) if record.target_pid else None
        if tracked is not None:
            about.add(tracked.snapshot_id)
        return about

    def track(self, result: RestoreResult, snapshot: Snapshot | None = None) -> None:
        """Count the tree(s) a restore or activation of ``snapshot`` brought up as active (idempotent: the
        operation's thread tracks them, with the snapshot it read, before its GPU reservation ends, and the
        operation's end finds them tracked, so ``park-active.json`` is written once and the manifest not read
        again; ``None``: read here)."""
        with self._lock:
            copies = [c for c in result.replicas or (result,) if c.pid not in self._tracked]
        if not copies:
            return
        try:
            snapshot = snapshot or self.store.get(result.snapshot_id)
        except GpusnapError:
            return
        with self._lock:
            for copy in copies:
                if copy.pid not in self._tracked:
                    start = proc.start_time(copy.pid)
                    self._tracked[copy.pid] = Tracked(snapshot.id, copy.pid, start, gpu_need(snapshot))
            self._save_tracked()

    def _save_tracked(self) -> None:
        try:
            documents.save_items(self._active_path, self._tracked.values())
        except OSError as exc:
            log.warning("park.active_unwritable", error=str(exc))

    def check_policy(self, rule: Rule) -> None:
        """Refuse a rule whose ``keep_warm`` the standby budget could never hold for a snapshot it selects (its
        standbys alone, every other standby dropped), rather than accept it and defer it forever.

        Raises:
            InvalidArgumentError: reason ``INVALID_POLICY``, with the sizes and the most that fits.
        """
        keep, budget = rule.policy.keep_warm or 0, self.config.standby_ram_bytes
        if not keep or not budget:
            return
        for snapshot in self.store.list():
            need = snapshot.size_bytes * keep
            if rule.applies_to(snapshot) and need > budget:
                fits = budget // snapshot.size_bytes if snapshot.size_bytes else keep
                raise InvalidArgumentError(
                    f"keep_warm {keep} for {snapshot.name or snapshot.id} needs {keep} standby{'s' if keep > 1 else ''} of "
                    f"{human_size(snapshot.size_bytes)}, {human_size(need)} of host memory, over the "
                    f"{human_size(budget)} [park] standby_ram_bytes budget, so it could never be met; keep at most "
                    f"{fits} warm, or raise the budget",
                    reason="INVALID_POLICY",
                    metadata={"needed_bytes": str(need), "budget_bytes": str(budget), "snapshot": snapshot.id},
                )

    # -- budgets --------------------------------------------------------------------------------------------

    def reserve_standby(self, snapshot: Snapshot, count: int) -> Callable[[], None]:
        """Hold ``count`` copies' image bytes of the standby budget until the returned release is called (the
        standby operation's end; the standbys made count by their own memory once registered).

        Raises:
            ResourceExhaustedError: they do not fit, even after dropping standbys of lower priority
                (``PARK_BUDGET``).
        """
        need = snapshot.size_bytes * count
        priority = self.policies.effective(snapshot).priority or 0
        with self._lock:
            budget = self.config.standby_ram_bytes
            if budget:
                self._make_room(need, budget, priority, snapshot.id)
            return self._reserve("standby_ram", need)

    def reserve_gpu(self, snapshot: Snapshot) -> Callable[[], None]:
        """Hold a running copy's GPU memory (:func:`gpu_need`) of the GPU budget until the returned release
        is called (the restore's or activation's end; the tree counts by itself once tracked).

        Raises:
            ResourceExhaustedError: over ``[park] gpu_bytes`` (``PARK_BUDGET``).
        """
        need = gpu_need(snapshot)
        with self._lock:
            budget = self.config.gpu_bytes
            used = self._gpu_used()
            if budget and need and used + need > budget:
                raise ResourceExhaustedError(
                    f"restoring {snapshot.id} needs {human_size(need)} of GPU memory, and the workloads gpusnapd "
                    f"runs hold {human_size(used)} of the {human_size(budget)} [park] gpu_bytes budget; "
                    "suspend or end one (`gpusnap suspend PID`), or raise the budget",
                    reason="PARK_BUDGET",
                    metadata={"budget": "gpu", "needed_bytes": str(need), "used_bytes": str(used)},
                )
            return self._reserve("gpu", need)

    def _reserve(self, budget: str, nbytes: int) -> Callable[[], None]:
        self._next_reservation += 1
        key = self._next_reservation
        self._reserved[budget][key] = nbytes

        def release() -> None:
            with self._lock:
                self._reserved[budget].pop(key, None)

        return release

    def _standby_used(self) -> int:
        """The standbys' memory now (measured live, inits included) plus what standbys being made reserved."""
        table = proc.ProcessTable.now()
        ready = sum(s.live_memory_bytes(table) for s in self.standbys.list())
        return ready + sum(self._reserved["standby_ram"].values())

    def _gpu_used(self) -> int:
        self._prune_tracked()
        running = sum(t.gpu_bytes for t in self._tracked.values() if not t.suspended)
        return running + sum(self._reserved["gpu"].values())

    def _make_room(self, need: int, budget: int, priority: int, for_snapshot: str) -> None:
        """Drop standbys of priority below ``priority`` until ``need`` more fits ``budget``.

        Raises:
            ResourceExhaustedError: it does not fit even then (``PARK_BUDGET``).
        """
        if self._standby_used() + need <= budget:
            return
        for sb, prio in self._drop_order():
            if prio >= priority:
                break
            self._drop(sb, f"standby_ram budget (room for a standby of {for_snapshot}, priority {priority})")
            if self._standby_used() + need <= budget:
                return
        used = self._standby_used()
        if used + need > budget:
            raise ResourceExhaustedError(
                f"standbys of {for_snapshot} need {human_size(need)} of host memory, and standbys hold "
                f"{human_size(used)} of the {human_size(budget)} [park] standby_ram_bytes budget with no "
                "lower priority to give way; drop one (`gpusnap drop STANDBY`), lower keep_warm, or raise the budget",
                reason="PARK_BUDGET",
                metadata={"budget": "standby_ram", "needed_bytes": str(need), "used_bytes": str(used)},
            )

    def _drop_order(self) -> list[tuple[Standby, int]]:
        """Ready standbys in the order budgets take them: lowest priority, beyond keep_warm, oldest first."""
        ranked = []
        for snapshot_id, standbys in self._by_snapshot().items():
            policy = self._policy_of(snapshot_id)
            keep = policy.keep_warm or 0
            for n, sb in enumerate(sorted(standbys, key=lambda s: s.created, reverse=True)):
                ranked.append((policy.priority or 0, n < keep, sb.created, sb))
        ranked.sort(key=lambda r: (r[0], r[1], r[2]))
        return [(sb, prio) for prio, _, _, sb in ranked]

    def _by_snapshot(self, ready_only: bool = True) -> dict[str, list[Standby]]:
        """Standbys by snapshot (with ``ready_only`` False also those an activation holds: they are on the
        standby rung until their tree is up)."""
        out: dict[str, list[Standby]] = {}
        for sb in self.standbys.list():
            if sb.state == READY or not ready_only:
                out.setdefault(sb.snapshot_id, []).append(sb)
        return out

    def _policy_of(self, snapshot_id: str) -> Policy:
        try:
            return self.policies.effective(self.store.get(snapshot_id))
        except GpusnapError:
            return self.config.defaults

    def _drop(self, sb: Standby, reason: str) -> None:
        if self.drop_standby is None:
            return
        log.info("park.drop_standby", standby=sb.id, snapshot=sb.snapshot_id, reason=reason)
        self.drop_standby(sb.id)
        self.observe(reason, only={sb.snapshot_id})

    # -- the pass -------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """One pass: idle standbys, the standby budget, keep_warm, the buffer tiers (module docstring)."""
        now = datetime.now(UTC)
        with self._lock:
            for sb in self.standbys.list():
                if sb.state == READY and not sb.tree_alive():  # stopped, or ended by its owner: no standby now
                    self._drop(sb, "its tree ended")
            for snapshot_id, standbys in self._by_snapshot().items():
                policy = self._policy_of(snapshot_id)
                idle = policy.standby_idle_s or 0
                extra = sorted(standbys, key=lambda s: s.created, reverse=True)[policy.keep_warm or 0 :]
                for sb in extra:
                    if idle and (now - sb.created).total_seconds() > idle:
                        self._drop(sb, f"standby idle {idle:.0f} s")
            budget = self.config.standby_ram_bytes
            if budget:
                for sb, _ in self._drop_order():
                    if self._standby_used() <= budget:
                        break
                    self._drop(sb, "standby_ram budget")
            self._keep_warm()
        self.store.buffers.enforce_budgets()
        self.observe(_outside, outside=True)

    def _keep_warm(self) -> None:
        if self.make_standby is None:
            return
        have = self._by_snapshot()
        wanted = []
        snapshots = {s.id: s for s in self.store.list()}
        for snapshot in snapshots.values():
            policy = self.policies.effective(snapshot)
            if (policy.keep_warm or 0) > len(have.get(snapshot.id, [])):
                wanted.append((-(policy.priority or 0), snapshot.created, snapshot.id, policy.keep_warm))
        for met in set(self._unmet) - {w[2] for w in wanted}:
            del self._unmet[met]
        for _, _, snapshot_id, keep in sorted(wanted):
            making = self._making.get(snapshot_id)
            if making is not None and not making.done:
                continue  # one at a time per snapshot
            self._making.pop(snapshot_id, None)
            if making is not None and making.error is not None:
                self._failed_at[snapshot_id] = time.monotonic()
                self._unmet[snapshot_id] = f"keep_warm {keep}: the standby failed: {making.error.message}"
            if time.monotonic() - self._failed_at.get(snapshot_id, -RETRY_S) < RETRY_S:
                continue
            try:
                self._making[snapshot_id] = self.make_standby(snapshots[snapshot_id])
                log.info("park.keep_warm", snapshot=snapshot_id, keep_warm=keep)
            except GpusnapError as exc:  # over budget, busy: try again at a later pass, and say why in the ladder
                self._failed_at[snapshot_id] = time.monotonic()
                self._unmet[snapshot_id] = f"keep_warm {keep} not met: {exc.message}"
                log.info("park.keep_warm_deferred", snapshot=snapshot_id, reason=exc.reason, error=str(exc))

    # -- rungs and events -----------------------------------------------------------------------------------

    def workloads(self) -> list[Workload]:
        """Every snapshot's workload, highest rung first."""
        with self._lock:
            return sorted(self._workloads(), key=lambda w: (w.rung, w.snapshot.created))

    def budgets(self) -> list[Budget]:
        with self._lock:
            tiers = [Budget(f"{t.name}_tier", t.used_bytes(), t.budget_bytes) for t in self.store.buffers.tiers]
            return [
                Budget("gpu", self._gpu_used(), self.config.gpu_bytes),
                Budget("standby_ram", self._standby_used(), self.config.standby_ram_bytes),
                *tiers,
            ]

    def _prune_tracked(self) -> None:
        gone = [r for r, t in self._tracked.items() if abs(proc.start_time(r) - t.root_start) >= 0.01]
        for root in gone:
            del self._tracked[root]
        if gone:
            self._save_tracked()

    def _workloads(self) -> list[Workload]:
        self._prune_tracked()
        table = proc.ProcessTable.now()
        standbys = self._by_snapshot(ready_only=False)
        out = []
        for snapshot in self.store.list():
            trees = [t for t in self._tracked.values() if t.snapshot_id == snapshot.id]
            active = [t for t in trees if not t.suspended]
            suspended = [t for t in trees if t.suspended]
            mine = standbys.get(snapshot.id, [])
            ram, tier = self._tier_of(snapshot)
            rung = Rung.ACTIVE if active else Rung.SUSPENDED if suspended else Rung.STANDBY if mine else tier
            out.append(
                Workload(
                    snapshot=snapshot,
                    rung=rung,
                    active=len(active),
                    suspended=len(suspended),
                    standbys=len(mine),
                    policy=self.policies.effective(snapshot),
                    host_memory_bytes=sum(s.live_memory_bytes(table) for s in mine)
                    + sum(proc.rss_bytes(proc.tree_pids_or_empty(t.root)) for t in suspended),
                    gpu_memory_bytes=sum(t.gpu_bytes for t in active),
                    ram_tier_bytes=ram,
                    note=self._unmet.get(snapshot.id, ""),
                )
            )
        return out

    def _tier_of(self, snapshot: Snapshot) -> tuple[int, Rung]:
        """(bytes of its buffers in the RAM tier, the lowest tier one of its buffers is only on)."""
        buffers = self.store.buffers
        ram = 0
        rung = Rung.RAM if snapshot.buffers else Rung.DISK  # (its images are on the store's disk)
        for ref in {r.sha256: r for r in snapshot.buffers}.values():
            path = buffers.path(snapshot.buffer_uid, ref.sha256)
            if not path.exists():
                rung = max(rung, Rung.REMOTE if self.remote else Rung.DISK)
            elif buffers.in_ram_tier(path):
                ram += ref.size_bytes
            else:
                rung = max(rung, Rung.DISK)
        return ram, rung

    def observe(
        self,
        reason: str | Callable[[Rung | None, Rung | None], str],
        *,
        only: set[str] | None = None,
        outside: bool = False,
    ) -> list[Event]:
        """Compare the workloads' rungs with the last ones seen; an event for each change, with ``reason`` (what
        caused it, or a function of the change that says). ``only``: those workloads (an operation's). ``outside``:
        only moves down a rung, onto the ladder's tiers or off it (a tree that ended, a standby dropped by hand, a
        tier move, a new or deleted snapshot): up a rung only an operation moves a workload, and its end records
        that. Returns the new events."""
        with self._lock:
            now = {w.snapshot.id: w.rung for w in self._workloads()}
            new = []
            for snapshot_id in sorted((set(now) | set(self._last)) if only is None else only):
                before, after = self._last.get(snapshot_id), now.get(snapshot_id)
                if before == after or (outside and after is not None and after < (before or Rung.RAM)):
                    continue  # (up a rung, or onto one of a running tree or standby: an operation's move, at its end)
                why = reason if isinstance(reason, str) else reason(before, after)
                new.append(Event(datetime.now(UTC), snapshot_id, before, after, why))
                if after is None:
                    self._last.pop(snapshot_id, None)
                else:
                    self._last[snapshot_id] = after
            for event in new:
                self.events.append(event)
                names = (_label(event.from_rung), _label(event.to_rung))
                self.moves[names] += 1
                log.info("park.move", snapshot=event.snapshot_id, src=names[0], dst=names[1], reason=event.reason)
            return new

    def usage(self) -> dict[str, Any]:
        """What a metrics scrape reads: workloads per rung, standbys and their memory, moves so far."""
        workloads = self.workloads()
        return {
            "rungs": {r.label: sum(1 for w in workloads if w.rung is r) for r in Rung},
            "standbys": len(self.standbys.list()),
            "standby_bytes": self._standby_used() - sum(self._reserved["standby_ram"].values()),
            "moves": dict(self.moves),
        }


def _outside(before: Rung | None, after: Rung | None) -> str:
    """What moved a workload from ``before`` to ``after`` when no operation did (``Ladder.observe``)."""
    if after is None:
        return "its snapshot was deleted"
    if before is None:
        return "a new snapshot"
    if before in (Rung.ACTIVE, Rung.SUSPENDED):
        return "its restored trees ended (stopped, or exited)"
    if before is Rung.STANDBY:
        return "its standbys ended (dropped)"
    return "tier budgets"


def _label(rung: Rung | None) -> str:
    return rung.label if rung is not None else "none"
