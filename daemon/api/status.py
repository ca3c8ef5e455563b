"""The one mapping between gpusnap errors and gRPC statuses (both directions).

The server sends a ``google.rpc.Status`` whose details carry a ``google.rpc.ErrorInfo``
(``reason``, ``domain="gpusnap.dev"``, ``metadata`` with ``action``: retry, fall_back or fix, see
docs/errors.md); the client rebuilds the matching
:class:`~gpusnap.daemon.api.errors.GpusnapError` subclass from it.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gpusnap.daemon.api.errors import Code, GpusnapError, error_for_code
from gpusnap.daemon.api.text import cut

DOMAIN = "gpusnap.dev"
MAX_MESSAGE = 1024
MAX_METADATA_VALUE = 256
"""Characters kept of a message and of each metadata value. gRPC sends the status as trailing metadata,
which clients cut at 8-16 KiB (grpc.max_metadata_size): an error echoing a 100 kB argument would
otherwise reach the caller as RESOURCE_EXHAUSTED ("Stream removed") instead of itself."""


def _cap(text: str, limit: int) -> str:
    return cut(text, limit)


def to_status_proto(err: GpusnapError) -> status_pb2.Status:
    """``err`` as a ``google.rpc.Status`` (used for RPC errors and for failed operations)."""
    metadata = {k: _cap(v, MAX_METADATA_VALUE) for k, v in err.metadata.items()} | {"action": err.action.value}
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=int(err.code), message=_cap(err.message, MAX_MESSAGE), details=[detail])


def from_status_proto(status: status_pb2.Status) -> GpusnapError:
    """Rebuild the domain error from a ``google.rpc.Status``."""
    reason, metadata = None, {}
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
            metadata.pop("action", None)  # derived from code and reason again (GpusnapError.action)
    return error_for_code(Code(status.code), status.message, reason=reason, metadata=metadata)


def from_rpc_error(exc: grpc.RpcError) -> GpusnapError:
    """Rebuild the domain error from a failed call (client side)."""
    call: Any = exc  # a failed call is both an RpcError and a grpc.Call
    status = rpc_status.from_call(call)
    if status is not None:
        return from_status_proto(status)
    code = call.code() if hasattr(call, "code") else grpc.StatusCode.UNKNOWN
    details = call.details() if hasattr(call, "details") else str(exc)
    reason = "DAEMON_UNAVAILABLE" if code == grpc.StatusCode.UNAVAILABLE else None
    return error_for_code(Code(code.value[0]), details or str(code), reason=reason)
