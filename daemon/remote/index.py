"""The remote store's name index: published snapshots listed and found by owner and name from keys alone.

One small object per published snapshot, beside its manifest::

    index/<owner uid>/<name, or "-" without one>/<created, ns since the epoch, 20 digits>.<snapshot id>

holding the snapshot's local manifest (``store.manifest``, no chunk lists). ``gpusnap ls --remote`` lists
``index/<uid>/`` (root: ``index/``), a LIST of 1000 keys a request, sorts by the keys and reads only the
entries of the page it returns; ``gpusnap pull NAME`` lists ``index/<uid>/<NAME>/`` and reads the newest
entry's manifest. Names are per owner, as in the local store: another owner's entries are never read.

The manifest stays the truth. An entry is put after its manifest (a push interrupted in between is
finished by its retry or by garbage collection, which indexes manifests older than its grace period that
have none) and removed before it (a delete interrupted in between leaves an unlisted manifest, still
found by id); collection also drops entries whose manifest is gone. Every entry read back is checked:
its key's owner, name and id must match its content.

Its reads run on a pool of their own per call (``threads`` workers), for the reason ``remote.transfer``'s
module docstring gives.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import structlog

from gpusnap.daemon.api import paging, validate
from gpusnap.daemon.api.errors import DataLossError, NotFoundError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.remote.objects import ObjectStore
from gpusnap.daemon.store import manifest

log = structlog.get_logger(__name__)

INDEX = "index/"
UNNAMED = "-"
MAX_ENTRY_BYTES = 16 << 20
_KEY_RE = re.compile(r"^index/(?P<uid>\d{1,10})/(?P<name>[a-z0-9][a-z0-9._-]{0,62}|-)/(?P<ns>\d{20})\.(?P<id>[^/]+)$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One index key, parsed: enough to sort, page and scope without reading anything."""

    key: str
    owner_uid: int
    name: str
    created_ns: int
    snapshot_id: str

    @property
    def sort_key(self) -> paging.Key:
        return (self.created_ns, self.snapshot_id)

    @classmethod
    def parse(cls, key: str) -> Entry | None:
        m = _KEY_RE.fullmatch(key)
        if m is None or not validate.SNAPSHOT_ID_RE.fullmatch(m.group("id")):
            return None
        name = "" if m.group("name") == UNNAMED else m.group("name")
        return cls(key, int(m.group("uid")), name, int(m.group("ns")), m.group("id"))


def entry_key(snapshot: Snapshot) -> str:
    ns, sid = paging.key(snapshot.created, snapshot.id)
    return f"{INDEX}{snapshot.owner_uid}/{snapshot.name or UNNAMED}/{ns:020d}.{sid}"


class RemoteIndex:
    """The index of one remote store (module docstring); ``threads`` entries are read at once."""

    def __init__(self, objects: ObjectStore, threads: int):
        self.objects = objects
        self.threads = threads

    def put(self, snapshot: Snapshot) -> None:
        self.objects.put(entry_key(snapshot), manifest.encode(snapshot))

    def remove(self, snapshot: Snapshot) -> None:
        self.objects.delete(entry_key(snapshot))

    def entries(self, owner_uid: int | None = None, name: str = "") -> list[Entry]:
        """The entries of ``owner_uid`` (None: everyone's), of snapshots named ``name`` if given, oldest
        first, from a listing alone. Keys that do not parse are skipped."""
        under = INDEX if owner_uid is None else f"{INDEX}{owner_uid}/" + (f"{name}/" if name else "")
        found = [e for e in (Entry.parse(o.key) for o in self.objects.list(under)) if e is not None]
        return sorted(found, key=lambda e: e.sort_key)

    def read(self, entries: Iterable[Entry]) -> list[Snapshot]:
        """The snapshots ``entries`` describe, in their order; unreadable or inconsistent entries are
        logged and left out (so is an entry removed meanwhile)."""

        def one(e: Entry) -> Snapshot | None:
            try:
                data = self.objects.get(e.key, 0, MAX_ENTRY_BYTES + 1)
                snap = manifest.decode(data)
            except NotFoundError:
                return None
            except DataLossError as exc:
                log.warning("remote.index_entry_unusable", key=e.key, error=str(exc)[:300])
                return None
            if (snap.id, snap.owner_uid, snap.name) != (e.snapshot_id, e.owner_uid, e.name) or len(
                data
            ) > MAX_ENTRY_BYTES:
                log.warning("remote.index_entry_unusable", key=e.key, error="its content does not match its key")
                return None
            return snap

        with ThreadPoolExecutor(self.threads, thread_name_prefix="gpusnap-index") as pool:
            return [s for s in pool.map(one, list(entries)) if s is not None]
