"""The gpusnap error tree.

Every error the daemon reports is a :class:`GpusnapError` subclass carrying a machine-readable
``reason`` (``UPPER_SNAKE``), a message that names the cause and the fix, and a ``code`` that mirrors a
gRPC status code (the one mapping to and from gRPC lives in ``gpusnap.daemon.api.status``; this
module imports no gRPC). Pattern from containerd's ``errdefs`` and Temporal's ``RPCStatusCode``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Code(enum.IntEnum):
    """Status codes, numerically equal to ``grpc.StatusCode`` values."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Action(enum.StrEnum):
    """What a program should do about an error (``metadata["action"]`` of its ``google.rpc.ErrorInfo``;
    docs/errors.md lists each reason's)."""

    RETRY = "retry"
    """Transient: the same request may work later (busy tree, daemon restarting, timeout, memory or space
    short for now)."""
    FALL_BACK = "fall_back"
    """This snapshot cannot be used here (damaged, incompatible host/GPU/driver, restore failed): start the
    worker cold, or restore on another node."""
    FIX = "fix"
    """The request or the set-up is wrong (bad argument, unknown name, no permission): retrying it unchanged
    never helps."""


_ACTION_BY_CODE: dict[Code, Action] = {
    Code.ABORTED: Action.RETRY,
    Code.UNAVAILABLE: Action.RETRY,
    Code.DEADLINE_EXCEEDED: Action.RETRY,
    Code.RESOURCE_EXHAUSTED: Action.RETRY,
    Code.CANCELLED: Action.RETRY,
    Code.FAILED_PRECONDITION: Action.FALL_BACK,
    Code.DATA_LOSS: Action.FALL_BACK,
    Code.INTERNAL: Action.FALL_BACK,
    Code.UNKNOWN: Action.FALL_BACK,
}
_ACTION_BY_REASON: dict[str, Action] = {
    # a snapshot that is gone or cannot match this node's GPUs: cold start instead
    "SNAPSHOT_NOT_FOUND": Action.FALL_BACK,
    "GPU_MODEL_MISMATCH": Action.FALL_BACK,
    "GPU_NOT_FOUND": Action.FALL_BACK,
    # failed preconditions that a changed request or set-up cures
    "ADDRESS_IN_USE": Action.FIX,
    "SNAPSHOT_HAS_STANDBYS": Action.FIX,  # drop its standbys first
    "DEV_SHM_NAME_TAKEN": Action.FIX,  # a /dev/shm name a --host-pidns restore needs
    "AGENT_MISSING": Action.FIX,  # an engine process without an agent: install gpusnap into the engine
    "AGENT_NOT_ATTACHED": Action.FIX,  # an agent dialing another socket: fix GPUSNAP_AGENT_SOCKET, or --no-quiesce
    "AGENT_USERS": Action.FIX,
    "IO_URING": Action.FIX,
    "STORE_LOCKED": Action.FIX,
    "SOCKET_IN_USE": Action.FIX,
    "METRICS_ADDRESS_IN_USE": Action.FIX,
    "UNSAFE_SOCKET_DIR": Action.FIX,
    "UNSAFE_RUNTIME_DIR": Action.FIX,
    "CRIU_MISSING": Action.FIX,
    "CRIU_TOO_OLD": Action.FIX,
    "PYCRIU_MISSING": Action.FIX,
    "CAPABILITY_MISSING": Action.FIX,
    "STORE_UNUSABLE": Action.FIX,
    "BAD_DIRECTORY": Action.FIX,
    "EXTERNAL_PIPE": Action.FIX,
    "TERMINAL": Action.FIX,  # a job started from a terminal, restored with --host-pidns
    "FILE_COPY_FAILED": Action.FIX,  # a copy of a file the tree writes that its owner may not create
    "CRIU_UNSUPPORTED": Action.FIX,
    "TCP_ESTABLISHED": Action.FIX,
    "USER_NAMESPACE": Action.FIX,
    "PID_NAMESPACE_INIT": Action.FIX,
    "SESSION_OUTSIDE_NAMESPACE": Action.FIX,
    "NOT_SUSPENDED": Action.FIX,
    "SUSPENDED_TREE_UNKNOWN": Action.FIX,
    "AGENT_ATTACHED": Action.FIX,
    "REMOTE_NOT_CONFIGURED": Action.FIX,
    "BUFFER_BUDGET": Action.FIX,
    "REMOTE_NO_BUCKET": Action.FIX,
    "NOTHING_TO_DELETE": Action.FIX,  # rm of a snapshot that is not there
    # a chunk a remote manifest names is gone: that snapshot cannot be pulled
    "REMOTE_NOT_FOUND": Action.FALL_BACK,
    # the worker went away or broke mid-operation: the same call again may work
    "AGENT_LOST": Action.RETRY,
    "CRIU_DIED": Action.RETRY,
}


def action_for(code: Code, reason: str) -> Action:
    """The :class:`Action` for an error of ``code`` with ``reason`` (docs/errors.md)."""
    return _ACTION_BY_REASON.get(reason) or _ACTION_BY_CODE.get(code, Action.FIX)


class GpusnapError(Exception):
    """Root of every gpusnap error.

    Args:
        message: one line naming the cause and what to do about it.
        reason: machine-readable ``UPPER_SNAKE`` reason; defaults to the class's ``default_reason``.
        metadata: string facts for programs (``{"pid": "123"}``); sent as ``google.rpc.ErrorInfo``.
    """

    code: Code = Code.UNKNOWN
    default_reason = "UNKNOWN"

    def __init__(self, message: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.metadata: dict[str, str] = dict(metadata or {})

    def __str__(self) -> str:
        return self.message

    @property
    def action(self) -> Action:
        """Retry, fall back (cold start) or fix the request; see :class:`Action`."""
        return action_for(self.code, self.reason)


class InvalidArgumentError(GpusnapError):
    """The request itself is wrong (bad PID, name, id, map); retrying it unchanged never helps."""

    code = Code.INVALID_ARGUMENT
    default_reason = "INVALID_ARGUMENT"


class NotFoundError(GpusnapError):
    """A named thing (process, snapshot, operation) does not exist."""

    code = Code.NOT_FOUND
    default_reason = "NOT_FOUND"


class AlreadyExistsError(GpusnapError):
    """A snapshot with that name already exists."""

    code = Code.ALREADY_EXISTS
    default_reason = "ALREADY_EXISTS"


class PermissionDeniedError(GpusnapError):
    """The caller may not act on that process or snapshot."""

    code = Code.PERMISSION_DENIED
    default_reason = "PERMISSION_DENIED"


class FailedPreconditionError(GpusnapError):
    """The system is not in a state where the request can work (old CRIU, no GPU, corrupt image…)."""

    code = Code.FAILED_PRECONDITION
    default_reason = "FAILED_PRECONDITION"


class AbortedError(GpusnapError):
    """Conflicting concurrent work, e.g. a second operation on the same process tree."""

    code = Code.ABORTED
    default_reason = "ABORTED"


class DeadlineExceededError(GpusnapError):
    """A bounded step did not finish in time."""

    code = Code.DEADLINE_EXCEEDED
    default_reason = "DEADLINE_EXCEEDED"


class ResourceExhaustedError(GpusnapError):
    """Not enough disk, host RAM or GPU memory."""

    code = Code.RESOURCE_EXHAUSTED
    default_reason = "RESOURCE_EXHAUSTED"


class UnavailableError(GpusnapError):
    """The daemon (or a dependency such as CRIU) cannot serve right now."""

    code = Code.UNAVAILABLE
    default_reason = "UNAVAILABLE"


class UnauthenticatedError(GpusnapError):
    """The caller could not be identified."""

    code = Code.UNAUTHENTICATED
    default_reason = "UNAUTHENTICATED"


class InternalError(GpusnapError):
    """A bug or an unexpected failure of an underlying tool; the message carries its words."""

    code = Code.INTERNAL
    default_reason = "INTERNAL"


class CancelledError(GpusnapError):
    """The caller cancelled the operation (``Cancel``, Ctrl-C in the CLI); it was rolled back."""

    code = Code.CANCELLED
    default_reason = "CANCELLED"


class DataLossError(GpusnapError):
    """Snapshot images are corrupt or missing (checksum mismatch, truncated file)."""

    code = Code.DATA_LOSS
    default_reason = "DATA_LOSS"


_BY_CODE: dict[Code, type[GpusnapError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        FailedPreconditionError,
        AbortedError,
        DeadlineExceededError,
        ResourceExhaustedError,
        UnavailableError,
        InternalError,
        DataLossError,
        UnauthenticatedError,
        CancelledError,
    )
}


def error_for_code(
    code: Code, message: str, *, reason: str | None = None, metadata: Mapping[str, str] | None = None
) -> GpusnapError:
    """Rebuild the domain error for a status code (the client side of the mapping)."""
    cls = _BY_CODE.get(code, GpusnapError)
    err = cls(message, reason=reason, metadata=metadata)
    if cls is GpusnapError:
        err.code = code
    return err
