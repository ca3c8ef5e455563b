"""Default paths of gpusnapd, in a module of their own: the CLI and the client need the socket's path and
nothing else of ``gpusnap.daemon.config`` (its TOML, address parsing and dataclass cost 10–25 ms of
``gpusnap`` start-up; docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SOCKET = Path("/run/gpusnap/gpusnapd.sock")
DEFAULT_STORE = Path("/var/lib/gpusnap")
