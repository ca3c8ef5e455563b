"""Two nodes and a bucket: gpusnapd daemons with separate stores sharing one remote store on the real
Ceph RADOS Gateway of the session (``ceph_gateway`` in tests/conftest.py)."""

from __future__ import annotations

import json
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.remote import objects
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.remote.transfer import TransferLimits
from tests import ceph_rgw
from tests.conftest import DaemonProc, start_daemon, stop_daemon


class Fleet:
    def __init__(self, gw: ceph_rgw.Gateway, tmp: Path):
        self.gw = gw
        self.tmp = tmp
        self.bucket = f"fleet-{secrets.token_hex(6)}"
        self.prefix = "gpusnap/test"
        self.s3 = gw.s3_client()
        self.s3.create_bucket(Bucket=self.bucket)
        self.nodes: list[DaemonProc] = []

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def node(self, name: str, **env: str) -> DaemonProc:
        """Start (or restart, same store) the daemon of node ``name``; ``env`` adds GPUSNAP_* settings."""
        (self.tmp / name).mkdir(exist_ok=True)
        d = start_daemon(
            self.tmp / name,
            extra_env={**self.gw.env(), "GPUSNAP_REMOTE": self.url, "GPUSNAP_REMOTE_ENDPOINT": self.gw.endpoint, **env},
        )
        assert d.alive(), d.log.read_text()
        self.nodes.append(d)
        return d

    def kill(self, d: DaemonProc) -> None:
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(timeout=10)

    def keys(self, under: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"
        ):
            for obj in page.get("Contents", []):
                out[obj["Key"]] = obj["Size"]
        return out

    def manifest(self, snapshot_id: str) -> dict[str, Any]:
        body = self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/manifests/{snapshot_id}.json")["Body"]
        return json.loads(body.read())  # type: ignore[no-any-return]

    def put_manifest(self, snapshot_id: str, doc: dict[str, Any]) -> None:
        self.s3.put_object(
            Bucket=self.bucket, Key=f"{self.prefix}/manifests/{snapshot_id}.json", Body=json.dumps(doc).encode()
        )

    def close(self) -> None:
        for d in self.nodes:
            stop_daemon(d)
        for key in self.keys(""):
            self.s3.delete_object(Bucket=self.bucket, Key=key)
        self.s3.delete_bucket(Bucket=self.bucket)


@pytest.fixture
def fleet(ceph_gateway: ceph_rgw.Gateway, tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(ceph_gateway, tmp_path)
    yield f
    f.close()
    for d in f.nodes:
        log = d.log.read_text()
        if "Traceback" in log:
            pytest.fail(f"gpusnapd logged a traceback:\n{log[-4000:]}")


@pytest.fixture
def remote(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> RemoteStore:
    """The fleet's bucket as this test process's own RemoteStore (in-process tests of the remote store)."""
    for k, v in fleet.gw.env().items():
        monkeypatch.setenv(k, v)
    return RemoteStore(objects.connect(fleet.url, fleet.gw.endpoint), TransferLimits(4, 3600))


def cli_json(d: DaemonProc, *args: str, timeout: float = 300) -> Any:
    return json.loads(d.cli("-o", "json", *args, check=True, timeout=timeout).stdout)
