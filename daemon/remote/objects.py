"""ObjectStore: what the remote store needs of an object storage service, and the backend a remote URL names.

The remote store (``store``, ``transfer``, ``index``, ``evict``) uses nothing but this protocol: objects
named relative to one prefix, put whole (a chunk is at most ``checksum.CHUNK_BYTES``; a manifest or an
index entry is smaller), read whole or by range, looked at, listed by name prefix, deleted, one conditional
put that publishes a manifest atomically (``if_absent``), and a touch that renews a modification time.
Parallelism is the caller's: many objects in flight, one request each (``transfer``).

A backend is one module (``s3``: any S3-compatible service, through boto3) with a class that implements
:class:`ObjectStore`, ``URL_FORM`` (the URLs it takes, for messages), ``parse_url(url)`` (raises
``InvalidArgumentError`` for a URL it does not take) and ``connect(url, endpoint, ca_bundle, connections)``;
:data:`BACKENDS` names it by URL scheme. ``docs/architecture.md`` ("Adding a
storage backend") says what a new one must keep.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from datetime import datetime
from typing import Protocol

from gpusnap.daemon.api.errors import InvalidArgumentError

BACKENDS = {"s3": "gpusnap.daemon.remote.s3"}
"""URL scheme -> the module of its backend, imported only when a remote is configured (the CLI and a daemon
without ``--remote`` never load an SDK)."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """An object: its ``key`` (relative to the store's prefix), ``size`` in bytes and last ``modified`` time
    (timezone-aware)."""

    key: str
    size: int
    modified: datetime


class ObjectStore(Protocol):
    """One prefix of an object storage service. Names are relative to the prefix and use ``/`` as separator.

    Every method raises, for any request that fails, a domain error naming the object and the fix:
    ``NotFoundError`` (``REMOTE_NOT_FOUND``: no such object), ``FailedPreconditionError`` (``REMOTE_EXISTS``:
    a conditional put lost; ``REMOTE_NO_BUCKET``), ``PermissionDeniedError`` (``REMOTE_DENIED``: credentials
    refused or missing) or ``UnavailableError`` (``REMOTE_UNAVAILABLE``: the service cannot be reached or
    failed; a retry may succeed).
    """

    def __str__(self) -> str:
        """The store's URL, as configured (e.g. ``s3://BUCKET/PREFIX``)."""
        ...

    def where(self) -> str:
        """The URL and the service's endpoint, for messages."""
        ...

    def put(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write object ``name`` whole; with ``if_absent`` only if no such object exists, atomically (S3's
        ``If-None-Match: *``). Returns False when ``if_absent`` and the object exists, else True."""
        ...

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """The bytes of object ``name``: all of them, or ``length`` bytes from ``start`` (fewer at its end)."""
        ...

    def head(self, name: str) -> ObjectInfo | None:
        """Size and modification time of object ``name``; None if it does not exist."""
        ...

    def touch(self, name: str) -> None:
        """Renew object ``name``'s modification time, keeping its bytes (garbage collection's grace period then
        starts again for a chunk that a new manifest is about to reference)."""
        ...

    def list(self, under: str) -> Iterator[ObjectInfo]:
        """The objects whose name starts with ``under``, page by page as the caller iterates."""
        ...

    def delete(self, name: str) -> None:
        """Remove object ``name``; removing one that does not exist is no error."""
        ...


def _backend(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    module = BACKENDS.get(scheme) if sep else None
    if module is None:
        forms = " or ".join(importlib.import_module(m).URL_FORM for m in BACKENDS.values())
        raise InvalidArgumentError(f"remote {url!r} is not {forms}", reason="BAD_CONFIG")
    return module


def check_url(url: str) -> None:
    """Raise ``InvalidArgumentError`` (``BAD_CONFIG``) unless a backend takes ``url``."""
    importlib.import_module(_backend(url)).parse_url(url)


def connect(url: str, endpoint: str = "", ca_bundle: str = "", connections: int = 16) -> ObjectStore:
    """The store ``url`` names, through its backend.

    Args:
        url: where snapshots go, e.g. ``s3://BUCKET/PREFIX``.
        endpoint: the service's URL (e.g. a Ceph RADOS Gateway); empty = the backend's default service.
        ca_bundle: PEM file of CAs to trust for ``endpoint``; empty = the backend's default.
        connections: HTTP connections to keep (at least the transfer threads).

    Raises:
        InvalidArgumentError: no backend takes ``url`` (``BAD_CONFIG``).
    """
    store: ObjectStore = importlib.import_module(_backend(url)).connect(url, endpoint, ca_bundle, connections)
    return store
