"""The optional TCP listener: TLS only, with mutual TLS when a client CA is set."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import grpc
import pytest

from gpusnap.daemon.api.errors import PermissionDeniedError, UnavailableError
from gpusnap.daemon.client import DaemonClient
from tests.conftest import start_daemon, stop_daemon

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not installed")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _pki(d: Path) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=gpusnap-test-ca",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.pem"),
    )
    for name, subject in (
        ("server", "/CN=localhost"),
        ("client", "/CN=orchestrator"),
        ("stranger", "/CN=stranger"),
        ("two-names", "/CN=orchestrator/CN=stranger"),  # gRPC's x509_common_name: the first only
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            subject,
            "-keyout",
            str(d / f"{name}.key"),
            "-out",
            str(d / f"{name}.csr"),
        )
        ext = d / f"{name}.ext"
        ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(d / f"{name}.csr"),
            "-CA",
            str(d / "ca.pem"),
            "-CAkey",
            str(d / "ca.key"),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            str(ext),
            "-out",
            str(d / f"{name}.pem"),
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_mutual_tls_listener(tmp_path: Path) -> None:
    _pki(tmp_path)
    port = _free_port()
    env = {
        "GPUSNAP_LISTEN": f"127.0.0.1:{port}",
        "GPUSNAP_TLS_CERT": str(tmp_path / "server.pem"),
        "GPUSNAP_TLS_KEY": str(tmp_path / "server.key"),
        "GPUSNAP_TLS_CLIENT_CA": str(tmp_path / "ca.pem"),
        "GPUSNAP_TLS_CLIENT_IDENTITIES": "orchestrator:0",
    }
    d = start_daemon(tmp_path, extra_env=env)
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        assert d.alive(), d.log.read_text()
        ca = (tmp_path / "ca.pem").read_bytes()
        good = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.pem").read_bytes()
        )
        with DaemonClient(f"localhost:{port}", credentials=good) as client:
            assert client.node_info().host.criu_version.startswith("4.")
        # Signed by the same CA but not mapped to any rights: anonymous, not root.
        stranger = grpc.ssl_channel_credentials(
            ca, (tmp_path / "stranger.key").read_bytes(), (tmp_path / "stranger.pem").read_bytes()
        )
        with DaemonClient(f"localhost:{port}", credentials=stranger) as client:
            with pytest.raises(PermissionDeniedError) as err:
                client.checkpoint(sleeper.pid)
            assert err.value.reason == "ANONYMOUS"
            assert client.list_snapshots() == []
        # Issue 19: a certificate with two common names acted as its first (the one-name check never saw
        # the second); which one names the client is ambiguous, so it gets no rights.
        two = grpc.ssl_channel_credentials(
            ca, (tmp_path / "two-names.key").read_bytes(), (tmp_path / "two-names.pem").read_bytes()
        )
        with DaemonClient(f"localhost:{port}", credentials=two) as client:
            with pytest.raises(PermissionDeniedError) as err:
                client.node_info()
            assert err.value.reason == "ANONYMOUS"
        no_cert = grpc.ssl_channel_credentials(ca)  # refused by the TLS handshake: a client CA is set
        with DaemonClient(f"localhost:{port}", credentials=no_cert) as client, pytest.raises(UnavailableError):
            client.node_info()
    finally:
        sleeper.kill()
        sleeper.wait()
        stop_daemon(d)


def test_tls_without_client_certificates_is_anonymous(tmp_path: Path) -> None:
    _pki(tmp_path)
    port = _free_port()
    env = {
        "GPUSNAP_LISTEN": f"127.0.0.1:{port}",
        "GPUSNAP_TLS_CERT": str(tmp_path / "server.pem"),
        "GPUSNAP_TLS_KEY": str(tmp_path / "server.key"),
    }
    d = start_daemon(tmp_path, extra_env=env)
    sleeper = subprocess.Popen(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "600"], start_new_session=True
    )  # owned by nobody: anonymous must not be nobody
    try:
        creds = grpc.ssl_channel_credentials((tmp_path / "ca.pem").read_bytes())
        with DaemonClient(f"localhost:{port}", credentials=creds) as client:
            assert client.list_snapshots() == []
            with pytest.raises(PermissionDeniedError) as err:
                client.checkpoint(sleeper.pid)
            assert err.value.reason == "ANONYMOUS"
            with pytest.raises(PermissionDeniedError) as err:  # issue 19: it answered with the node's facts
                client.node_info()
            assert err.value.reason == "ANONYMOUS"
            with pytest.raises(PermissionDeniedError) as err:  # issue 26 item 9: the node's budget use
                client.ladder()
            assert err.value.reason == "ANONYMOUS"
    finally:
        sleeper.kill()
        sleeper.wait()
        stop_daemon(d)


def test_listen_without_tls_is_refused(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, extra_env={"GPUSNAP_LISTEN": "127.0.0.1:1"})
    try:
        assert d.proc.wait(timeout=30) == 2
        assert "--listen needs TLS" in d.log.read_text()
    finally:
        stop_daemon(d)
