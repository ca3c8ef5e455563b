"""The S3 backend of the remote store: :class:`S3ObjectStore` makes the few S3 calls the remote store needs
(``gpusnap.daemon.remote.objects.ObjectStore``), through boto3, with errors as domain errors.

boto3 was chosen over obstore by measurement (bench/s3_clients.py, bench/results/s3-clients-*.json):
on the Ceph RADOS Gateway both move 16 MiB chunks at the gateway's speed, so the difference lies
elsewhere: boto3 reads credentials from the SDK's usual chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the shared files, web identity for Kubernetes service
accounts, instance roles), honours ``AWS_CA_BUNDLE``, and has typed stubs (docs/fleet.md).

Objects are put whole (chunks are at most ``checksum.CHUNK_BYTES``); the store's parallelism comes
from many chunks in flight, each one request (see ``gpusnap.daemon.remote.transfer``). The backend is named
by the scheme ``s3://`` (``gpusnap.daemon.remote.objects.BACKENDS``).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gpusnap.daemon.api.errors import (
    FailedPreconditionError,
    GpusnapError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from gpusnap.daemon.remote.objects import ObjectInfo

if TYPE_CHECKING:
    import botocore.exceptions
    from mypy_boto3_s3 import S3Client

URL_FORM = "s3://BUCKET/PREFIX (bucket: 3-63 of a-z, 0-9, '.', '-'; prefix: A-Z, a-z, 0-9, '.', '_', '-', '/')"
"""The URLs this backend takes, for messages."""
URL_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[A-Za-z0-9._/-]{0,512}))?$")


@dataclasses.dataclass(frozen=True)
class RemoteUrl:
    """``s3://BUCKET/PREFIX``: every key the remote store writes starts with ``PREFIX/``."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> RemoteUrl:
        """Parse ``s3://BUCKET[/PREFIX]``.

        Raises:
            InvalidArgumentError: not of that form, or a prefix with empty, ``.`` or ``..`` parts
                (reason ``BAD_CONFIG``).
        """
        m = URL_RE.fullmatch(url)
        prefix = (m.group("prefix") or "").strip("/") if m else ""
        if m is None or any(part in ("", ".", "..") for part in prefix.split("/") if prefix):
            raise InvalidArgumentError(f"remote {url!r} is not {URL_FORM}", reason="BAD_CONFIG")
        return cls(bucket=m.group("bucket"), prefix=prefix)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_url(url: str) -> RemoteUrl:
    """``RemoteUrl.parse``: the backend's URL check (``gpusnap.daemon.remote.objects``)."""
    return RemoteUrl.parse(url)


def connect(url: str, endpoint: str, ca_bundle: str, connections: int) -> S3ObjectStore:
    """The backend's constructor (``gpusnap.daemon.remote.objects.connect``). Raises as :meth:`RemoteUrl.parse`."""
    return S3ObjectStore(RemoteUrl.parse(url), endpoint, ca_bundle, connections=connections)


class S3ObjectStore:
    """One bucket and prefix of an S3-compatible service: a ``gpusnap.daemon.remote.objects.ObjectStore``.

    Args:
        url: where snapshots go.
        endpoint: service URL (e.g. a Ceph RADOS Gateway); empty = AWS from the SDK's configuration.
        ca_bundle: PEM file of CAs to trust for ``endpoint``; empty = the SDK's default (``AWS_CA_BUNDLE``).
        connections: HTTP connections kept (at least the transfer threads).
        timeout_s: connect and read timeout of one request, seconds.
    """

    def __init__(
        self, url: RemoteUrl, endpoint: str = "", ca_bundle: str = "", connections: int = 16, timeout_s: float = 30.0
    ):
        self.url = url
        self.endpoint = endpoint
        import boto3  # here, not at import: a daemon without --remote (and its GPU tests) never loads boto3
        from botocore.config import Config

        config = Config(
            s3={"addressing_style": "path"},  # gateways are reached by address, not by bucket DNS names
            max_pool_connections=connections,
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"mode": "standard", "max_attempts": 3},
        )
        session = boto3.session.Session()
        self._s3: S3Client = session.client(
            "s3",
            endpoint_url=endpoint or None,
            verify=ca_bundle or None,
            config=config,
            region_name=session.region_name or "us-east-1",
        )

    def __str__(self) -> str:
        return str(self.url)

    def where(self) -> str:
        return f"{self.url}" + (f" at {self.endpoint}" if self.endpoint else "")

    def put(self, name: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write object ``name``; with ``if_absent`` only if no such object exists (``If-None-Match: *``).

        Returns False when ``if_absent`` and the object exists. Raises as :meth:`_call`.
        """
        args: dict[str, Any] = {"Bucket": self.url.bucket, "Key": self.url.key(name), "Body": data}
        if if_absent:
            args["IfNoneMatch"] = "*"
        try:
            self._call("PUT", name, lambda: self._s3.put_object(**args))
        except FailedPreconditionError as err:
            if if_absent and err.reason == "REMOTE_EXISTS":
                return False
            raise
        return True

    def get(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        """The bytes of object ``name`` (a range when ``length`` is given). Raises as :meth:`_call`."""
        args: dict[str, Any] = {"Bucket": self.url.bucket, "Key": self.url.key(name)}
        if length is not None:
            args["Range"] = f"bytes={start}-{start + length - 1}"
        data: bytes = self._call("GET", name, lambda: bytes(self._s3.get_object(**args)["Body"].read()))
        return data

    def head(self, name: str) -> ObjectInfo | None:
        """Size and modification time of object ``name``, or None if it does not exist."""
        try:
            resp = self._call(
                "HEAD", name, lambda: self._s3.head_object(Bucket=self.url.bucket, Key=self.url.key(name))
            )
        except NotFoundError:
            return None
        return ObjectInfo(name, int(resp["ContentLength"]), resp["LastModified"])

    def touch(self, name: str) -> None:
        """Renew object ``name``'s modification time (a copy onto itself), so garbage collection's grace
        period starts again for a chunk that a new manifest is about to reference."""
        self._call(
            "COPY",
            name,
            lambda: self._s3.copy_object(
                Bucket=self.url.bucket,
                Key=self.url.key(name),
                CopySource={"Bucket": self.url.bucket, "Key": self.url.key(name)},
                MetadataDirective="REPLACE",
            ),
        )

    def list(self, under: str) -> Iterator[ObjectInfo]:
        """Objects whose name starts with ``under`` (names relative to the prefix)."""
        base = self.url.key("")
        paginator = self._s3.get_paginator("list_objects_v2")
        pages = self._call(
            "LIST", under, lambda: iter(paginator.paginate(Bucket=self.url.bucket, Prefix=self.url.key(under)))
        )
        while True:
            page = self._call("LIST", under, lambda: next(pages, None))
            if page is None:
                return
            for obj in page.get("Contents", []):
                yield ObjectInfo(obj["Key"][len(base) :], int(obj["Size"]), obj["LastModified"])

    def delete(self, name: str) -> None:
        self._call("DELETE", name, lambda: self._s3.delete_object(Bucket=self.url.bucket, Key=self.url.key(name)))

    def _call(self, verb: str, name: str, fn: Any) -> Any:
        """Run one request; S3 and network failures become domain errors naming the object and the fix.

        Raises:
            NotFoundError: ``REMOTE_NOT_FOUND`` (no such object).
            FailedPreconditionError: ``REMOTE_EXISTS`` (a conditional put lost), ``REMOTE_NO_BUCKET``.
            PermissionDeniedError: ``REMOTE_DENIED`` (credentials refused or missing).
            UnavailableError: ``REMOTE_UNAVAILABLE`` (the service cannot be reached or failed).
        """
        import botocore.exceptions

        try:
            return fn()
        except botocore.exceptions.ClientError as exc:
            raise self._client_error(verb, name, exc) from None
        except botocore.exceptions.NoCredentialsError:
            raise PermissionDeniedError(
                f"no credentials for the remote store {self.where()}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE, or an instance role) in gpusnapd's environment",
                reason="REMOTE_DENIED",
            ) from None
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            raise UnavailableError(
                f"the remote store {self.where()} cannot be reached ({type(exc).__name__}: {exc}); "
                "check that it is up and --remote-endpoint, then try again (finished chunks are kept)",
                reason="REMOTE_UNAVAILABLE",
            ) from None

    def _client_error(self, verb: str, name: str, exc: botocore.exceptions.ClientError) -> GpusnapError:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
        if code in ("NoSuchKey", "404", "NotFound") or (status == 404 and code != "NoSuchBucket"):
            return NotFoundError(f"{name} is not in the remote store {self.where()}", reason="REMOTE_NOT_FOUND")
        if code in ("PreconditionFailed", "412") or status == 412:
            return FailedPreconditionError(f"{name} exists already in {self.where()}", reason="REMOTE_EXISTS")
        if code == "NoSuchBucket":
            return FailedPreconditionError(
                f"bucket {self.url.bucket} does not exist at {self.endpoint or 'the S3 service'}; create it once "
                f"(`{sys.executable} -c \"import boto3; boto3.client('s3'"
                + (f", endpoint_url='{self.endpoint}'" if self.endpoint else "")
                + f").create_bucket(Bucket='{self.url.bucket}')\"`, with the same credentials) or fix --remote",
                reason="REMOTE_NO_BUCKET",
            )
        if status in (401, 403) or code in ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId"):
            return PermissionDeniedError(
                f"the remote store {self.where()} refused {verb} {name} ({code}); check gpusnapd's credentials "
                "and the bucket's policy",
                reason="REMOTE_DENIED",
            )
        return UnavailableError(
            f"the remote store {self.where()} failed {verb} {name} ({code or status}); try again",
            reason="REMOTE_UNAVAILABLE",
        )


if TYPE_CHECKING:
    from gpusnap.daemon.remote.objects import ObjectStore

    def _an_object_store(store: S3ObjectStore) -> ObjectStore:
        return store  # mypy checks that S3ObjectStore implements the protocol
