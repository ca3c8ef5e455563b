"""The remote store's content-addressed layout and its manifest document.

Keys under ``s3://BUCKET/PREFIX/``::

    chunks/<2 hex>/<sha256>     one chunk: SHA-256 of its bytes names it; at most checksum.CHUNK_BYTES
    manifests/<snapshot id>.json  a published snapshot; put last, with If-None-Match: *

Image files and buffers (weights) are cut into ``checksum.CHUNK_BYTES`` chunks, the same chunks whose
digests make up their ``checksum.DIGEST_ALGORITHM`` digests: a manifest lists each file's and each
buffer's chunk digests, and a reader checks that they combine to the digest the snapshot records before
it fetches anything. A chunk shared by files, buffers, snapshots or nodes is stored once.

Manifest document (``format`` ``gpusnap-remote/1``)::

    {"format": "gpusnap-remote/1", "snapshot": {the local manifest, see store.manifest},
     "provenance": {node, pushed_at, gpusnap_version, machine, kernel, criu_version, cpu_flags,
                    gpu_model, gpu_count, driver_major},
     "files": [[chunk sha256, …] for each snapshot.files entry, in order],
     "buffers": {buffer digest: [chunk sha256, …]}}

Every field of a document read back is checked: it may come from anyone who can write the bucket.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from gpusnap.daemon.api import validate
from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.api.types import Snapshot
from gpusnap.daemon.store import checksum, documents, manifest

FORMAT = "gpusnap-remote/1"
MANIFESTS = "manifests/"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
MAX_MANIFEST_BYTES = 64 << 20


def chunk_key(digest: str) -> str:
    return f"chunks/{digest[:2]}/{digest}"


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFESTS}{snapshot_id}.json"


def snapshot_id_of(key: str) -> str | None:
    """The snapshot id a ``manifests/…`` key names, or None for anything else."""
    sid = key.removeprefix(MANIFESTS).removesuffix(".json")
    return sid if key.startswith(MANIFESTS) and validate.SNAPSHOT_ID_RE.fullmatch(sid) else None


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where and with what a snapshot was made: what the compatibility gate compares (a document of
    ``gpusnap.daemon.store.documents``: a pulled snapshot's ``provenance.json``, and inside its remote manifest)."""

    node: str
    pushed_at: str
    gpusnap_version: str
    machine: str
    kernel: str
    criu_version: str
    cpu_flags: tuple[str, ...]
    gpu_model: str = ""
    gpu_count: int = 0
    driver_major: str = ""
    schema_version: int = 1


@dataclasses.dataclass(frozen=True)
class RemoteManifest:
    snapshot: Snapshot
    provenance: Provenance
    file_chunks: tuple[tuple[str, ...], ...]
    buffer_chunks: dict[str, tuple[str, ...]]

    def chunks(self) -> set[str]:
        """Every chunk digest the snapshot needs."""
        return {d for c in self.file_chunks for d in c} | {d for c in self.buffer_chunks.values() for d in c}

    def to_bytes(self) -> bytes:
        stored = Stored(
            format=FORMAT,
            snapshot=manifest.to_json(self.snapshot),
            provenance=self.provenance,
            files=self.file_chunks,
            buffers=self.buffer_chunks,
        )
        return documents.encode(stored, indent=1)


@dataclasses.dataclass(frozen=True)
class Stored:
    """A remote manifest as its object holds it (``manifests/<id>.json``): the snapshot's manifest (read by
    ``store.manifest``, which checks its version), its provenance, and the chunk digests of every image file (in
    the manifest's order) and of every buffer (by its digest)."""

    format: str
    snapshot: dict[str, Any]
    provenance: Provenance
    files: tuple[tuple[str, ...], ...]
    buffers: dict[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class _Format:
    """What any remote manifest holds: its format (read only to say why one of another does not decode)."""

    format: Any = None


def parse(data: bytes, key_id: str) -> RemoteManifest:
    """Read and check a manifest fetched from ``manifests/<key_id>.json``.

    Raises:
        DataLossError: malformed, unknown format, unsafe paths, or chunk lists that do not add up to the
            snapshot's digests (reason ``REMOTE_MANIFEST_CORRUPT``).
    """

    def bad(why: str) -> DataLossError:
        return DataLossError(
            f"remote manifest of {key_id} is unusable: {why}; delete it with "
            f"`gpusnap rm --remote {key_id}` and push again",
            reason="REMOTE_MANIFEST_CORRUPT",
            metadata={"snapshot": key_id},
        )

    try:
        found = documents.decode(data, _Format).format
    except documents.DocumentError as exc:
        raise bad(f"not a JSON object ({exc})") from None
    if found != FORMAT:
        raise bad(f"format {found!r}, this gpusnap reads {FORMAT}")
    try:
        doc = documents.decode(data, Stored)
        snap = manifest.from_json(doc.snapshot)
    except documents.DocumentError as exc:
        raise bad(str(exc)) from None
    except DataLossError as exc:
        raise bad(exc.message) from None
    prov, files, buffers = doc.provenance, doc.files, doc.buffers
    if snap.id != key_id:
        raise bad(f"it describes {snap.id}")
    if len(files) != len(snap.files):
        raise bad("chunk lists and files differ in number")
    _check_paths([f.path for f in snap.files], bad)
    for f, chunks in zip(snap.files, files, strict=True):
        _check_chunks(f.path, f.size_bytes, f.sha256, chunks, bad)
    for b in snap.buffers:
        if b.sha256 not in buffers:
            raise bad(f"no chunk list for buffer {b.name!r}")
        _check_chunks(f"buffer {b.name}", b.size_bytes, b.sha256, buffers[b.sha256], bad)
    return RemoteManifest(snap, prov, files, buffers)


def _check_paths(paths: Sequence[str], bad: Any) -> None:
    """Relative, no ``.``/``..``/empty parts, each once, none under another (pulls create them)."""
    seen: set[str] = set()
    for path in paths:
        if path.startswith("/") or "\\" in path or "\0" in path or any(p in ("", ".", "..") for p in path.split("/")):
            raise bad(f"unsafe file path {path[:200]!r}")
        if path in seen:
            raise bad(f"file {path[:200]!r} listed twice")
        seen.add(path)
    for path in paths:
        parts = path.split("/")
        if any("/".join(parts[:i]) in seen for i in range(1, len(parts))):
            raise bad(f"file {path[:200]!r} lies under another file")


def _check_chunks(what: str, size: int, digest: str, chunks: Sequence[str], bad: Any) -> None:
    if size < 0 or len(chunks) != checksum.chunk_count(size):
        raise bad(f"{what}: {len(chunks)} chunks for {size} bytes")
    if not all(HEX64.fullmatch(d) for d in chunks):
        raise bad(f"{what}: a chunk digest is not 64 lowercase hex digits")
    if checksum.combine([bytes.fromhex(d) for d in chunks]) != digest:
        raise bad(f"{what}: its chunks do not make up its digest {digest[:12]}…")
