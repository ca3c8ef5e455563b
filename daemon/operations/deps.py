"""What operations need from the rest of the daemon, built once by ``gpusnap.daemon.server``."""

from __future__ import annotations

import dataclasses

from gpusnap.daemon.config import DaemonConfig
from gpusnap.daemon.drivers.criu import CriuDriver
from gpusnap.daemon.gpu.support import GpuSupport
from gpusnap.daemon.operations.tree_bounds import TreeBounds
from gpusnap.daemon.park.standbys import StandbyRegistry
from gpusnap.daemon.remote.store import RemoteStore
from gpusnap.daemon.store import SnapshotStore
from gpusnap.daemon.weights.prefill import PrefillSupport
from gpusnap.daemon.workers.agents import AgentRegistry


@dataclasses.dataclass(frozen=True)
class Deps:
    config: DaemonConfig
    store: SnapshotStore
    criu: CriuDriver
    criu_version: str
    gpu: GpuSupport
    agents: AgentRegistry
    remote: RemoteStore | None = None
    """The remote store (``--remote``), None when not configured."""
    prefill: PrefillSupport | None = None
    """Device memory filled by gpusnapd at restore (``gpu_prefill``); None: off."""
    standbys: StandbyRegistry | None = None
    """The node's standbys (``gpusnap.daemon.park.standbys``); None: this daemon keeps none (embedders)."""
    tree_bounds: TreeBounds | None = None
    """Per-uid bounds on restored trees and standbys (``operations.tree_bounds``); None: none (embedders)."""
