"""The operation journal: what each operation has done so far, durable before each step with side effects.

One JSON file per operation under ``<store>/journal/<op-id>.json``, replaced atomically (temporary file,
``fsync``, ``rename``, ``fsync`` of the directory) every time it changes. An operation writes it when it
starts, at the start of every phase, and whenever it learns something recovery needs (the PIDs it froze or
locked, the tree it restored); it ends with its final state. At start the daemon reads every entry:
unfinished ones are recovered (``gpusnap.daemon.operations.recovery``), finished ones answer retries of
their idempotency key and ``GetOperation`` across a restart. The newest ``KEEP_FINISHED`` finished entries
are kept.

Entry fields: ``id``, ``kind``, ``owner_uid``, ``request_id``, ``started`` (ISO 8601), ``state``
(``running``/``succeeded``/``failed``), ``phase``, ``facts`` (what recovery needs, by operation kind),
``error`` (``{"code", "reason", "message"}``) and ``result`` (JSON of the operation's result).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import structlog

from gpusnap.daemon.api import validate
from gpusnap.daemon.store.durable import fsync_dir

log = structlog.get_logger(__name__)

KEEP_FINISHED = 256
JOURNAL = "journal"


class Journal:
    """Operation entries in ``directory`` (created mode 0700)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self._lock = threading.Lock()

    def open(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def write(self, entry: dict[str, Any]) -> None:
        """Persist ``entry`` (replacing the operation's previous one) before returning."""
        path = self.dir / f"{entry['id']}.json"
        tmp = path.with_suffix(".tmp")
        data = json.dumps(entry, sort_keys=True).encode()
        with self._lock:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            fsync_dir(self.dir)

    def entries(self) -> list[dict[str, Any]]:
        """Every readable entry, oldest first; unreadable ones are logged and removed."""
        out = []
        for path in self.dir.glob("op-*.json"):
            try:
                entry = json.loads(path.read_bytes())
                validate.operation_id(entry["id"])
                if path.name != f"{entry['id']}.json":
                    raise ValueError("entry named after another operation")
                out.append(entry)
            except Exception as exc:  # a torn or foreign file: it cannot be recovered from
                log.warning("journal.entry_unreadable", path=str(path), error=str(exc))
                path.unlink(missing_ok=True)
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)
        return sorted(out, key=lambda e: (e.get("started", ""), e["id"]))

    def trim(self) -> None:
        """Remove all but the newest ``KEEP_FINISHED`` finished entries."""
        finished = [e for e in self.entries() if e.get("state") != "running"]
        for entry in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            (self.dir / f"{entry['id']}.json").unlink(missing_ok=True)
