"""Ending an RPC with a gpusnap error (the status mapping itself: ``gpusnap.daemon.api.status``)."""

from __future__ import annotations

import grpc
from grpc_status import rpc_status

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.status import to_status_proto


def abort(context: grpc.ServicerContext, err: GpusnapError) -> None:
    """End the RPC with ``err``'s status (raises, as ``context.abort_with_status`` does)."""
    context.abort_with_status(rpc_status.to_status(to_status_proto(err)))
