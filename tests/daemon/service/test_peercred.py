"""The SO_PEERCRED proxy never treats an unknown proxied connection as root."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusnap.daemon.api.errors import UnauthenticatedError
from gpusnap.daemon.api.types import ROOT_CALLER
from gpusnap.daemon.service.peercred import PeerCredProxy


def test_unknown_abstract_peer_is_refused(tmp_path: Path) -> None:
    proxy = PeerCredProxy(tmp_path / "pub.sock", tmp_path / "priv.sock", "nogroup")
    with pytest.raises(UnauthenticatedError):
        proxy.caller_for("unix-abstract:1a2b3")
    with pytest.raises(UnauthenticatedError):
        proxy.caller_for("ipv4:127.0.0.1:5000")
    assert proxy.caller_for("unix:") == ROOT_CALLER, "direct calls on the 0700 private socket are root's"
