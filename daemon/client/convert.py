"""gpusnap.v1 wire messages -> the client's frozen values (``gpusnap.daemon.client.values``).

One generic walk over each value class's fields, by their type hints: a field is read from the message
field of the same name; sub-messages become values (``None`` when unset, for ``X | None`` fields),
``""`` and 0 ``None`` for ``X | None`` fields, repeated fields tuples, maps dicts, timestamps aware datetimes (UTC), enums the value whose ``.value`` is
the proto name without its shared prefix, lowercased (``OPERATION_KIND_CHECKPOINT`` -> ``"checkpoint"``),
and a ``google.rpc.Status`` the matching :class:`~gpusnap.daemon.api.errors.GpusnapError`.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import functools
import os
import types
import typing
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message

from gpusnap.daemon.api.errors import GpusnapError
from gpusnap.daemon.api.status import from_status_proto

V = TypeVar("V")


def value(cls: type[V], msg: Message) -> V:
    """``msg`` as a ``cls`` (a dataclass of ``gpusnap.daemon.client.values``).

    Raises:
        KeyError: ``msg`` has no field named as one of ``cls``'s (a value class out of step with the proto).
    """
    fields = msg.DESCRIPTOR.fields_by_name
    kwargs = {name: _field(hint, msg, fields[name]) for name, hint in _hints(cls).items()}
    return cls(**kwargs)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s fields and their resolved types, in order (computed once per class)."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _field(hint: Any, msg: Message, field: Any) -> Any:
    raw = getattr(msg, field.name)
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):  # X | None: an unset sub-message, an empty string or a 0
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        present = msg.HasField(field.name) if field.has_presence else bool(raw)
        return _one(inner, raw, field) if present else None
    if origin is tuple:
        return tuple(_one(typing.get_args(hint)[0], v, field) for v in raw)
    if origin is collections.abc.Mapping:
        return dict(raw)
    return _one(hint, raw, field)


def _one(hint: Any, raw: Any, field: Any) -> Any:
    if dataclasses.is_dataclass(hint):
        return value(hint, raw)  # type: ignore[arg-type]
    if hint is datetime:
        return raw.ToDatetime(tzinfo=UTC)
    if hint is GpusnapError:
        return from_status_proto(raw)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(enum_names(field.enum_type)[raw])
    return hint(raw)  # int, str, float, bool


@functools.cache
def enum_names(enum_type: EnumDescriptor) -> dict[int, str]:
    """Value number -> lowercase name without the prefix its values share (``OPERATION_KIND_``)."""
    names = [v.name for v in enum_type.values]
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    prefix = prefix[: prefix.rfind("_") + 1]
    return {v.number: v.name[len(prefix) :].lower() for v in enum_type.values}
