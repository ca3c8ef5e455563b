"""The typed Python client of gpusnapd: the only code outside the service layer that touches wire messages.

``DaemonClient``, ``OperationHandle`` and ``raise_if_failed`` (``gpusnap.daemon.client.calls``) are loaded on
first use, with gRPC: importing ``gpusnap.daemon.client.values`` (what the CLI's commands name at start-up)
loads neither, so ``gpusnap --help`` and ``gpusnap --version`` never import gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpusnap.daemon.client.calls import DaemonClient, OperationHandle, raise_if_failed

__all__ = ["DaemonClient", "OperationHandle", "raise_if_failed"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpusnap.daemon.client import calls

        return getattr(calls, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
