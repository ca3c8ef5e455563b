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
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from gpusnap.daemon.api.errors import DataLossError
from gpusnap.daemon.api.types import (
    ArenaLayout,
    BufferRef,
    Creds,
    GpuProcess,
    HeldFile,
    HostFacts,
    ImageFile,
    PhaseTiming,
    ProcessCreds,
    ProcessFacts,
    ProcessImage,
    Snapshot,
    Terminal,
    WorkerInfo,
)
from gpusnap.daemon.store.checksum import DIGEST_ALGORITHM

MANIFEST_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST_NAME = "manifest.json"
TCP_LABEL = "gpusnap.dev/tcp"
"""Label recording the checkpoint's TCP mode when it is not the default; restore uses the same."""


def to_json(snapshot: Snapshot) -> dict[str, Any]:
    """The manifest document for ``snapshot``."""
    return {
        "manifest_version": MANIFEST_VERSION,
        "id": snapshot.id,
        "name": snapshot.name,
        "created": snapshot.created.isoformat(),
        "labels": dict(snapshot.labels),
        "owner_uid": snapshot.owner_uid,
        "source": _fields(snapshot.source),
        "host": _fields(snapshot.host),
        "digest_algorithm": DIGEST_ALGORITHM,
        "files": [_fields(f) for f in snapshot.files],
        "phases": [_fields(p) for p in snapshot.phases],
        "gpu_processes": [_fields(g) for g in snapshot.gpu_processes],
        "worker": _fields(snapshot.worker) if snapshot.worker else None,
        "agents": [_fields(w) for w in snapshot.agents],
        "buffers": [_fields(b) for b in snapshot.buffers],
        "held_files": [_fields(h) for h in snapshot.held_files],
        "owner_creds": _fields(snapshot.owner_creds) if snapshot.owner_creds else None,
        "tree_creds": [_fields(c) for c in snapshot.tree_creds],
        "process_images": [_fields(i) for i in snapshot.process_images],
        "terminals": [_fields(t) for t in snapshot.terminals],
    }


def from_json(doc: dict[str, Any]) -> Snapshot:
    """Parse a manifest document.

    Raises:
        DataLossError: unknown version or malformed document (reason ``MANIFEST_CORRUPT``).
    """
    version = doc.get("manifest_version")
    if version not in READABLE_VERSIONS:
        raise DataLossError(
            f"manifest version {version!r} is not supported by this gpusnap (knows {', '.join(map(str, READABLE_VERSIONS))}); "
            "upgrade gpusnap or delete the snapshot",
            reason="MANIFEST_VERSION",
        )
    if doc.get("digest_algorithm") != DIGEST_ALGORITHM:
        raise DataLossError(
            f"manifest digest algorithm {doc.get('digest_algorithm')!r} is not supported (knows {DIGEST_ALGORITHM}); "
            "upgrade gpusnap or delete the snapshot",
            reason="MANIFEST_VERSION",
        )
    try:
        source = doc["source"]
        host = doc["host"]
        return Snapshot(
            id=str(doc["id"]),
            name=str(doc["name"]),
            created=datetime.fromisoformat(doc["created"]),
            labels={str(k): str(v) for k, v in doc["labels"].items()},
            owner_uid=int(doc["owner_uid"]),
            source=ProcessFacts(
                pid=int(source["pid"]),
                comm=str(source["comm"]),
                cmdline=tuple(source["cmdline"]),
                uid=int(source["uid"]),
                gid=int(source["gid"]),
                tree_pids=tuple(int(p) for p in source["tree_pids"]),
                rss_bytes=int(source["rss_bytes"]),
                cwd=str(source["cwd"]),
                listening=tuple(source.get("listening", ())),
            ),
            host=HostFacts(**{**host, "cpu_flags": tuple(host["cpu_flags"])}),
            files=tuple(ImageFile(**f) for f in doc["files"]),
            phases=tuple(PhaseTiming(**p) for p in doc["phases"]),
            gpu_processes=tuple(
                GpuProcess(
                    pid=int(g["pid"]),
                    gpu_uuids=tuple(g["gpu_uuids"]),
                    gpu_memory_bytes=int(g["gpu_memory_bytes"]),
                    visible_gpu_uuids=tuple(g.get("visible_gpu_uuids", ())),
                )
                for g in doc.get("gpu_processes", [])
            ),
            worker=_worker(doc["worker"]) if doc.get("worker") else None,
            agents=tuple(_worker(w) for w in doc.get("agents", [])),
            buffers=tuple(
                BufferRef(
                    name=str(b["name"]),
                    size_bytes=int(b["size_bytes"]),
                    sha256=str(b["sha256"]),
                    agent=str(b.get("agent", "")),
                    arena=int(b.get("arena", 0)),
                    arena_offset=int(b.get("arena_offset", 0)),
                )
                for b in doc.get("buffers", [])
            ),
            held_files=tuple(HeldFile(**h) for h in doc.get("held_files", [])),
            owner_creds=(
                Creds(**{**doc["owner_creds"], "groups": tuple(doc["owner_creds"]["groups"])})
                if doc.get("owner_creds")
                else None
            ),
            tree_creds=tuple(
                ProcessCreds(
                    pid=int(c["pid"]), uid=int(c["uid"]), gid=int(c["gid"]), groups=tuple(int(g) for g in c["groups"])
                )
                for c in doc.get("tree_creds", [])
            ),
            process_images=tuple(
                ProcessImage(pid=int(i["pid"]), image_bytes=int(i["image_bytes"]))
                for i in doc.get("process_images", [])
            ),
            terminals=tuple(
                Terminal(
                    path=str(t["path"]),
                    key=str(t["key"]),
                    fds=tuple(str(f) for f in t.get("fds", [])),
                    controlling=bool(t.get("controlling", False)),
                )
                for t in doc.get("terminals", [])
            ),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataLossError(f"manifest is malformed ({type(exc).__name__}: {exc})", reason="MANIFEST_CORRUPT") from exc


def _worker(doc: dict[str, Any]) -> WorkerInfo:
    arenas = tuple(
        ArenaLayout(
            gpu_uuid=str(a["gpu_uuid"]),
            size_bytes=int(a["size_bytes"]),
            granularity=int(a["granularity"]),
            chunk_bytes=tuple(int(c) for c in a["chunk_bytes"]),
            storages=int(a["storages"]),
        )
        for a in doc.get("arenas", ())
    )
    return WorkerInfo(**{**doc, "arenas": arenas})


def write(directory: Path, snapshot: Snapshot, *, sync: bool = True) -> None:
    """Write ``directory/manifest.json``; fsync it unless ``sync`` is false (the caller syncs it with
    the rest of the directory)."""
    path = directory / MANIFEST_NAME
    data = json.dumps(to_json(snapshot), indent=2, sort_keys=True).encode()
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        if sync:
            os.fsync(fh.fileno())


def read(directory: Path) -> Snapshot:
    """Read ``directory/manifest.json``.

    Raises:
        DataLossError: missing, unreadable or malformed manifest (reason ``MANIFEST_CORRUPT``).
    """
    path = directory / MANIFEST_NAME
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise DataLossError(
            f"manifest {path} cannot be read ({exc}); the snapshot is damaged: delete it with `gpusnap rm`",
            reason="MANIFEST_CORRUPT",
            metadata={"snapshot": directory.name, "file": MANIFEST_NAME},
        ) from exc
    if not isinstance(doc, dict):
        raise DataLossError(
            f"manifest {path} is not a JSON object",
            reason="MANIFEST_CORRUPT",
            metadata={"snapshot": directory.name, "file": MANIFEST_NAME},
        )
    return from_json(doc)


def _fields(obj: object) -> dict[str, Any]:
    out = dataclasses.asdict(obj)  # type: ignore[call-overload]
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
