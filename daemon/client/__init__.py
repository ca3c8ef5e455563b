"""The typed Python client of gpusnapd: the only code outside the service layer that touches wire messages."""

from gpusnap.daemon.client.calls import DaemonClient, OperationHandle, raise_if_failed

__all__ = ["DaemonClient", "OperationHandle", "raise_if_failed"]
