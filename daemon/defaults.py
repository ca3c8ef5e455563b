"""Default paths of gpusnapd, in a module of their own: the CLI and the client need the socket's path and
nothing else of ``gpusnap.daemon.config`` (its TOML, address parsing and dataclass cost 10–25 ms of
``gpusnap`` start-up; docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SOCKET = Path("/run/gpusnap/gpusnapd.sock")
DEFAULT_STORE = Path("/var/lib/gpusnap")
DEFAULT_CRIU_PREFIX = Path("/opt/gpusnap/criu")
"""Where ``gpusnap-install-criu`` (and ``make install-service``) put CRIU >= 4.2 and pycriu."""
INSTALL_CRIU = (
    f"install it as root with `gpusnap-install-criu` (into {DEFAULT_CRIU_PREFIX}; `make criu` in a checkout) and "
    f"start gpusnapd with --criu {DEFAULT_CRIU_PREFIX}/bin/criu --pycriu-path {DEFAULT_CRIU_PREFIX}/python"
)
"""The fix every CRIU or pycriu refusal names: what a wheel user can follow as written."""
