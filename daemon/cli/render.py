"""The one JSON form of ``gpusnap -o json`` (schemas: docs/schemas/v1/cli.schema.json).

Conventions, for every command: keys are the proto field names (snake_case); integers are JSON numbers
(protobuf's JSON mapping would send int64 as strings); timestamps are RFC 3339 strings in UTC; durations
are seconds as numbers; enums are their value names without the enum's prefix, lowercased
(``OPERATION_KIND_CHECKPOINT`` -> ``"checkpoint"``); a failed operation's ``google.rpc.Status`` is the
same ``{code, reason, action, message, metadata}`` object as a failed command's ``error``.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor
from google.protobuf.message import Message
from google.rpc import status_pb2

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.status import from_status_proto

SCHEMA_VERSION = "v1"
"""Directory under docs/schemas/ of the schemas this module writes to."""


def error(err: GpusnapError) -> dict[str, Any]:
    """A domain error as the ``error`` object of docs/schemas/v1/cli.schema.json."""
    return {
        "code": err.code.name,
        "reason": err.reason,
        "action": err.action.value,
        "message": err.message,
        "metadata": {k: v for k, v in err.metadata.items() if k != "action"},
    }


def message(msg: Message, omit: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``msg`` as a JSON-ready dict; ``omit`` names fields (``"host.cpu_flags"``) to leave out."""
    if isinstance(msg, status_pb2.Status):
        return error(from_status_proto(msg))
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        if field.name in omit:
            continue
        if field.message_type is not None and not _is_repeated(field) and not msg.HasField(field.name):
            continue  # an unset sub-message (e.g. the result of a running operation)
        sub = frozenset(o.partition(".")[2] for o in omit if o.startswith(field.name + "."))
        out[field.name] = _field(field, getattr(msg, field.name), sub)
    return out


def _is_repeated(field: Any) -> bool:
    return bool(field.is_repeated)


def _field(field: Any, value: Any, omit: frozenset[str]) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        return {str(k): _scalar(value_field, v, omit) for k, v in value.items()}
    if _is_repeated(field):
        return [_scalar(field, v, omit) for v in value]
    return _scalar(field, value, omit)


def _scalar(field: Any, value: Any, omit: frozenset[str]) -> Any:
    if field.message_type is not None:
        return _well_known(field.message_type, value, omit)
    if field.enum_type is not None:
        return _enum_names(field.enum_type).get(value, str(value))
    return value  # int, float, bool and str are JSON as they are


def _well_known(descriptor: Descriptor, value: Any, omit: frozenset[str]) -> Any:
    if descriptor.full_name == "google.protobuf.Timestamp":
        return value.ToJsonString()  # RFC 3339, "Z"
    if descriptor.full_name == "google.protobuf.Duration":
        return value.ToTimedelta().total_seconds()
    return message(value, omit)


@functools.cache
def _enum_names(enum: EnumDescriptor) -> dict[int, str]:
    """Value number -> lowercase name without the prefix its values share (``OPERATION_KIND_``)."""
    names = [v.name for v in enum.values]
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    prefix = prefix[: prefix.rfind("_") + 1]
    return {v.number: v.name[len(prefix) :].lower() for v in enum.values}
