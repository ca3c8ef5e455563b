"""The operation journal: what each operation has done so far, durable before each step with side effects.

One file per operation under ``<store>/journal/<op-id>.json``: one JSON line per version of the entry,
appended and ``fdatasync``ed before the write returns (the directory is ``fsync``ed once, when the file
is created). The last whole line is the entry: a line torn by a host crash leaves the one before it. A
new version is written whenever what recovery needs changes: when the operation starts, whenever it
learns something recovery needs (the PIDs it froze or locked, the tree it restored), and at its end
with its final state; one equal to the last is not written again. The phase the operation enters (which
recovery only quotes in messages) goes to ``<op-id>.phase`` beside it, without ``fsync``: it survives a
daemon crash (the page cache keeps it); after a host crash the entry's own, earlier phase may be quoted.
The journal used to write a temporary file, rename it and ``fsync`` the directory for every change and
phase (two ``fsync`` calls, 5–25 ms together on a loaded CI disk; docs/performance.md). At start the
daemon reads every entry:
unfinished ones are recovered (``gpusnap.daemon.operations.recovery``), finished ones answer retries of
their idempotency key and ``GetOperation`` across a restart. Finished entries are kept as :func:`kept`
says (the same rule as the daemon's own list): the newest ``KEEP_FINISHED``, and every caller's own keyed
ones for ``REQUEST_ID_KEEP_S``.

An entry is an :class:`Entry`, encoded and decoded by the saved documents' one codec
(``gpusnap.daemon.store.documents``); a line that is JSON but not an entry (a newer gpusnapd's, a foreign one)
is logged and left alone.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import structlog
from msgspec import Meta

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.types import OperationKind, OperationState, RestoreResult
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError
from gpusnap.daemon.store.durable import fsync_dir

log = structlog.get_logger(__name__)

KEEP_FINISHED = 256
"""Newest finished operations kept whoever started them."""
REQUEST_ID_KEEP_S = 24 * 3600.0
"""How long a finished operation started with an idempotency key (``request_id``) is kept for its caller's
retries, whatever others start meanwhile (issue 19: 300 failing restores of one user evicted root's key)."""
REQUEST_IDS_PER_CALLER = 1024
"""Keyed finished operations kept per caller within ``REQUEST_ID_KEEP_S`` (its own oldest go first)."""
JOURNAL = "journal"
PHASE_SUFFIX = ".phase"
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
MAX_PHASE_BYTES = 256


@dataclasses.dataclass(frozen=True)
class EntryError:
    """How a failed or cancelled operation ended (``GpusnapError``'s code, reason and message)."""

    code: int
    """Its gRPC code, as a number (``api.errors.Code``)."""
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class EntryResult:
    """An operation's result as the journal keeps it, one field set: a checkpoint's or pull's snapshot by id,
    a restore's or activation's trees, a resume's GPU map (old UUID -> new), a standby operation's standbys by
    id."""

    snapshot_id: str = ""
    restore: RestoreResult | None = None
    """Its trees, replicas included."""
    gpu_map: dict[str, str] | None = None
    standbys: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One version of an operation's journal entry (the module docstring)."""

    id: str
    kind: OperationKind
    owner_uid: int
    started: Annotated[datetime, Meta(tz=True)]
    state: OperationState
    request_id: str = ""
    finished: str = ""
    """When it ended (ISO 8601); empty while it runs."""
    phase: str = ""
    target_pid: int = 0
    target_snapshot: str = ""
    dry_run: bool = False
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What recovery needs, by operation kind (``gpusnap.daemon.operations.recovery``)."""
    error: EntryError | None = None
    result: EntryResult | None = None
    schema_version: int = 1

    @property
    def running(self) -> bool:
        """Not ended: recovery finishes it."""
        return self.state is OperationState.RUNNING


class Journal:
    """Operation entries in ``directory`` (created mode 0700)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._lock = threading.Lock()
        self._last: dict[str, bytes] = {}
        """The last durable entry written for each operation (skipped if unchanged)."""

    def open(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def write(self, entry: Entry) -> None:
        """Persist ``entry`` (replacing the operation's previous one) before returning; an entry equal to
        the last one written for its operation is already durable and is not written again."""
        path = self.dir / f"{entry.id}.json"
        data = documents.encode(entry)
        with self._lock:
            if self._last.get(entry.id) == data:
                return
            try:
                fd = os.open(path, _APPEND | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(path, _APPEND)
                created = False
            try:
                os.write(fd, b"\n" + data + b"\n")  # a line torn by a crash stays a line of its own
                os.fdatasync(fd)
            finally:
                os.close(fd)
            if created:
                fsync_dir(self.dir)
            (self.dir / f"{entry.id}{PHASE_SUFFIX}").unlink(missing_ok=True)  # the entry names the phase now
            if entry.running:
                self._last[entry.id] = data
            else:
                self._last.pop(entry.id, None)

    def write_phase(self, op_id: str, phase: str) -> None:
        """Record that operation ``op_id`` entered ``phase``, without ``fsync`` (see the module docstring)."""
        path = self.dir / f"{op_id}{PHASE_SUFFIX}"
        with self._lock:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, phase.encode()[:MAX_PHASE_BYTES])
            finally:
                os.close(fd)

    def entries(self) -> list[Entry]:
        """Every readable entry, oldest first; unreadable ones are logged and removed, and ones that are no
        entry of this release (a newer gpusnapd's) are logged and kept.

        Read under the writers' lock: trims run while operations write, and a file just created holds no
        whole line until its first write returns."""
        with self._lock:
            return self._entries()

    def _entries(self) -> list[Entry]:
        out = []
        for path in self.dir.glob("op-*.json"):
            try:
                found = _last_entry(path.read_bytes())
                try:
                    entry = documents.convert(found, Entry)
                except DocumentError as exc:  # not an entry of this release: kept for the gpusnapd that wrote it
                    log.error("journal.entry_unknown", path=str(path), error=str(exc))
                    continue
                validate.operation_id(entry.id)
                if path.name != f"{entry.id}.json":
                    raise ValueError("entry named after another operation")
                phase = _read_phase(path.with_suffix(PHASE_SUFFIX))
                if phase and entry.running:
                    entry = dataclasses.replace(entry, phase=phase)
                out.append(entry)
            except Exception as exc:  # a torn or foreign file: it cannot be recovered from
                log.warning("journal.entry_unreadable", path=str(path), error=str(exc))
                path.unlink(missing_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        for stale in self.dir.glob(f"op-*{PHASE_SUFFIX}"):
            if not stale.with_suffix(".json").exists():
                stale.unlink(missing_ok=True)
        return sorted(out, key=lambda e: (e.started, e.id))

    def trim(self) -> None:
        """Remove the finished entries :func:`kept` does not keep."""
        finished = [e for e in self.entries() if not e.running]
        keep = kept([(e.id, e.owner_uid, e.request_id, e.started) for e in finished], datetime.now(UTC))
        for entry in finished:
            if entry.id in keep:
                continue
            (self.dir / f"{entry.id}.json").unlink(missing_ok=True)
            (self.dir / f"{entry.id}{PHASE_SUFFIX}").unlink(missing_ok=True)


def kept(finished: list[tuple[str, int, str, datetime]], now: datetime) -> set[str]:
    """Ids of the finished operations to keep, of ``(id, owner uid, request_id, started)``: the newest
    ``KEEP_FINISHED``, and of each caller's keyed ones started within ``REQUEST_ID_KEEP_S`` its newest
    ``REQUEST_IDS_PER_CALLER``, so that no caller's operations evict another's keys."""
    newest = sorted(finished, key=lambda f: f[3], reverse=True)
    keep = {f[0] for f in newest[:KEEP_FINISHED]}
    per_caller: dict[int, int] = {}
    for op_id, uid, request_id, started in newest:
        if request_id and (now - started).total_seconds() < REQUEST_ID_KEEP_S:
            per_caller[uid] = per_caller.get(uid, 0) + 1
            if per_caller[uid] <= REQUEST_IDS_PER_CALLER:
                keep.add(op_id)
    return keep


def _read_phase(path: Path) -> str:
    """The phase name in ``path``, or ``""`` if it is missing or not a plain phase name (torn, foreign)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        raw = os.read(fd, MAX_PHASE_BYTES + 1)
    except OSError:
        return ""
    finally:
        os.close(fd)
    try:
        name = raw.decode()
    except UnicodeDecodeError:
        return ""
    ok = 0 < len(raw) <= MAX_PHASE_BYTES and all(c.isalnum() or c in "-#_" for c in name)
    return name if ok else ""


def _last_entry(data: bytes) -> dict[str, Any]:
    """The last line of ``data`` that is a whole JSON object (a torn write leaves a partial last line).

    Raises:
        ValueError: no line is.
    """
    for line in reversed(data.splitlines()):
        try:
            return documents.decode(line, dict[str, Any])
        except DocumentError:
            continue
    raise ValueError("no complete entry")
