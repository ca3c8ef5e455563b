"""A snapshot's manifest: versioned JSON written beside its images.

Schema (``manifest_version`` 3; version 1 lacks ``buffers``, version 2 ``agents``, and both are still read)::

    {"manifest_version": 2, "id": "snap-…", "name": "", "created": "2026-11-29T19:40:00+00:00",
     "labels": {}, "owner_uid": 0,
     "source": {pid, comm, cmdline, uid, gid, tree_pids, rss_bytes, cwd},
     "host": {hostname, kernel, machine, criu_version, gpusnap_version, cpu_model, cpu_flags,
              nvidia_driver_version, cuda_driver_version},
     "digest_algorithm": "sha256-list-16MiB",
     "files": [{"path": "pages-1.img", "size_bytes": 4096, "sha256": "…"}],
     "phases": [{"phase": "dump", "duration_seconds": 1.2, "bytes": 0}],
     "gpu_processes": [{"pid": 1234, "gpu_uuids": ["GPU-…"], "gpu_memory_bytes": 0}],
     "worker": {…} or null,
     "agents": [{…}],
     "buffers": [{"name": "model.embed_tokens.weight", "size_bytes": 1050673152, "sha256": "…", "agent": "…",
                  "arena": 1, "arena_offset": 0}],
     "held_files": [{"pid": 1234, "what": "fd 3", "path": "/home/u/log", "dev": 2049, "ino": 131, "access": 2,
                     "size": 18649, "pos": 18649, "flags": 32769}],
     "owner_creds": {"uid": 1000, "gid": 1000, "groups": [1000, 27]},
     "tree_creds": [{"pid": 1234, "uid": 1000, "gid": 1000, "groups": [1000, 27]}],
     "process_images": [{"pid": 1234, "image_bytes": 2042482688}],
     "terminals": [{"path": "/dev/pts/3", "key": "tty[8803:19]", "fds": ["1234/0"], "controlling": true}]}

``worker.arenas``/``agents[].arenas`` (``[{gpu_uuid, size_bytes, granularity, chunk_bytes, storages}]``) and
``buffers[].arena``/``arena_offset`` (optional, absent in older manifests: their restores read every buffer
back) describe address-stable arenas for ``--gpu-prefill``.

``process_images`` (optional, absent in older manifests) and ``agents[].released_bytes`` (likewise) say, per
process, what its images hold and what its quiesce freed without saving (``gpusnap inspect``).

``held_files`` and ``owner_creds`` (optional, absent in older manifests) let a restore check that the
snapshot's owner may still open every file CRIU reopens by path (``gpusnap.daemon.access.file_rights``);
a held file's ``size``, ``pos`` and ``flags`` (regular files held by an fd; optional, -1 or absent in older
manifests) let a restore give the tree a copy of a file it writes that has grown
(``gpusnap.daemon.operations.file_copies``).

``tree_creds`` (optional, absent in older manifests) are the rights each process ran with (its filesystem
uid and gid, and groups): a restore acts with them, whoever took or restores the snapshot
(``gpusnap.daemon.access.tree_rights``, which derives them from ``owner_creds`` for older manifests).

``terminals`` (optional, absent in older manifests) are the terminals a shell's job was started from, left
behind at dump; a restore replaces each descriptor of one by a file (``gpusnap.daemon.api.types.Terminal``).

``buffers`` name blobs of the buffer store (``gpusnap.daemon.store.buffers``) by digest. A daemon that
does not know version 2 would restore such a snapshot without its weights, so the version was raised;
likewise version 3 for ``agents`` (an engine's other processes, each woken and resumed at restore).

``files[].sha256`` is computed with ``digest_algorithm`` (see ``gpusnap.daemon.store.checksum``).
Readers refuse versions and digest algorithms they do not know instead of guessing.

The document is :class:`Manifest`: the snapshot's fields, with ``manifest_version`` and ``digest_algorithm``,
encoded and decoded by the saved documents' one codec (``gpusnap.daemon.store.documents``), which checks every
field's type on the way in. Its version field keeps the name it had before that codec (not ``schema_version``):
manifests travel between nodes through the remote store, and a gpusnapd of an earlier release reads it by that
name.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.checksum import DIGEST_ALGORITHM
from gpusnap.daemon.store.documents import DocumentError

MANIFEST_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
TCP_LABEL = "gpusnap.dev/tcp"
"""Label recording the checkpoint's TCP mode when it is not the default; restore uses the same."""


@dataclasses.dataclass(frozen=True)
class Manifest(Snapshot):
    """The manifest document: a snapshot's fields, with the version of the format and the algorithm of its
    files' digests (the module docstring)."""

    manifest_version: int = MANIFEST_VERSION
    digest_algorithm: str = DIGEST_ALGORITHM

    @staticmethod
    def of(snapshot: Snapshot) -> Manifest:
        """The manifest this release writes for ``snapshot``."""
        return Manifest(**_snapshot_fields(snapshot))

    def snapshot(self) -> Snapshot:
        """The snapshot it describes."""
        return Snapshot(**_snapshot_fields(self))


@dataclasses.dataclass(frozen=True)
class _Header:
    """What a manifest of any version holds: its version and digest algorithm (read only to say why a
    manifest of another version does not decode)."""

    manifest_version: Any = None
    digest_algorithm: Any = None


def _snapshot_fields(snapshot: Snapshot) -> dict[str, Any]:
    return {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(Snapshot)}


def to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The manifest document for ``snapshot``, as JSON's types (for a document that carries it: the remote
    manifest, the remote index)."""
    return documents.to_builtins(Manifest.of(snapshot))  # type: ignore[no-any-return]


def from_json(doc: Any) -> Snapshot:
    """The snapshot of a manifest document given as JSON's types (:func:`to_json`).

    Raises:
        DataLossError: unknown version or digest algorithm (reason ``MANIFEST_VERSION``), or a malformed
            document (reason ``MANIFEST_CORRUPT``).
    """
    try:
        manifest = documents.convert(doc, Manifest)
    except DocumentError as exc:
        _check_version(documents.convert(doc, _Header) if isinstance(doc, dict) else _Header())
        raise _malformed(exc) from exc
    _check_version(manifest)
    return manifest.snapshot()


def _check_version(header: Manifest | _Header) -> None:
    """Raises DataLossError (``MANIFEST_VERSION``) for a version or digest algorithm this release does not
    read."""
    version = header.manifest_version
    if version not in READABLE_VERSIONS:
        raise DataLossError(
            f"manifest version {version!r} is not supported by this gpusnap (knows {', '.join(map(str, READABLE_VERSIONS))}); "
            "upgrade gpusnap or delete the snapshot",
            reason="MANIFEST_VERSION",
        )
    if header.digest_algorithm != DIGEST_ALGORITHM:
        raise DataLossError(
            f"manifest digest algorithm {header.digest_algorithm!r} is not supported (knows {DIGEST_ALGORITHM}); "
            "upgrade gpusnap or delete the snapshot",
            reason="MANIFEST_VERSION",
        )


def _malformed(exc: DocumentError) -> DataLossError:
    return DataLossError(f"manifest is malformed ({exc})", reason="MANIFEST_CORRUPT")


def encode(snapshot: Snapshot, indent: int = 0) -> bytes:
    """The manifest of ``snapshot``, as this release writes it (``indent``: for people, in a snapshot's
    directory; compact in the remote index)."""
    return documents.encode(Manifest.of(snapshot), indent=indent)


def decode(data: bytes, unreadable: Callable[[DocumentError], DataLossError] | None = None) -> Snapshot:
    """The snapshot of a manifest's bytes.

    Raises:
        DataLossError: ``unreadable(error)`` for bytes that are no JSON object (default: ``MANIFEST_CORRUPT``), a
            version or digest algorithm this release does not read (``MANIFEST_VERSION``), or a malformed
            manifest (``MANIFEST_CORRUPT``).
    """
    try:
        manifest = documents.decode(data, Manifest)
    except DocumentError as exc:
        try:
            header = documents.decode(data, _Header)
        except DocumentError:
            raise (unreadable or _malformed)(exc) from exc  # not JSON, or not an object
        _check_version(header)
        raise _malformed(exc) from exc
    _check_version(manifest)
    return manifest.snapshot()


def write(directory: Path, snapshot: Snapshot, *, sync: bool = True) -> None:
    """Write ``directory/manifest.json``; fsync it unless ``sync`` is false (the caller syncs it with
    the rest of the directory)."""
    path = directory / MANIFEST_NAME
    data = encode(snapshot, indent=2)
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        if sync:
            os.fsync(fh.fileno())


def read(directory: Path) -> Snapshot:
    """Read ``directory/manifest.json``.

    Raises:
        DataLossError: missing, unreadable or malformed manifest (reason ``MANIFEST_CORRUPT``), or one of a
            version this release does not read (``MANIFEST_VERSION``).
    """
    path = directory / MANIFEST_NAME

    def corrupt(why: object) -> DataLossError:
        return DataLossError(
            f"manifest {path} cannot be read ({why}); the snapshot is damaged: delete it with `gpusnap rm`",
            reason="MANIFEST_CORRUPT",
            metadata={"snapshot": directory.name, "file": MANIFEST_NAME},
        )

    try:
        data = path.read_bytes()
    except OSError as exc:
        raise corrupt(exc) from exc
    return decode(data, corrupt)
