"""The one JSON form of ``gpusnap -o json``: every command's document passes through :func:`render`.

Conventions, for every command (schemas: docs/schemas/v1/cli.schema.json, written from the same
classes by scripts/gen_json_schema.py): keys are the field names of the client's values
(``gpusnap.daemon.client.values``, named as the proto fields: snake_case); integers are JSON numbers;
timestamps are RFC 3339 strings in UTC; enums are their lowercase names (``"kind": "checkpoint"``); a
failed operation's error is the same ``{code, reason, action, message, metadata}`` object as a failed
command's ``error``; a field whose value is ``None`` is left out.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from gpusnap.daemon.api.errors import GpusnapError

SCHEMA_VERSION = "v1"
"""Directory under docs/schemas/ of the schemas this module writes to."""


def render(doc: Any, omit: frozenset[str] = frozenset()) -> str:
    """``doc`` (a value, a command's document, or a list of them) as indented JSON text.

    ``omit`` names fields to leave out of each value, dotted for nested ones (``"host.cpu_flags"``).
    """
    return json.dumps(plain(doc, omit), indent=2)


def error(err: GpusnapError) -> dict[str, Any]:
    """A domain error as the ``error`` object of docs/schemas/v1/cli.schema.json."""
    metadata = {k: v for k, v in err.metadata.items() if k != "action"}
    return {
        "code": err.code.name,
        "reason": err.reason,
        "action": err.action.value,
        "message": err.message,
        **({"metadata": metadata} if metadata else {}),  # a value that is not there is left out
    }


def plain(doc: Any, omit: frozenset[str] = frozenset()) -> Any:
    """``doc`` as JSON-ready dicts, lists and scalars."""
    if dataclasses.is_dataclass(doc) and not isinstance(doc, type):
        out: dict[str, Any] = {}
        for field in dataclasses.fields(doc):
            item = getattr(doc, field.name)
            if field.name in omit or item is None:
                continue
            sub = frozenset(o.partition(".")[2] for o in omit if o.startswith(field.name + "."))
            out[field.name] = plain(item, sub)
        return out
    if isinstance(doc, GpusnapError):
        return error(doc)
    if isinstance(doc, enum.Enum):
        return doc.value
    if isinstance(doc, datetime):
        return doc.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(doc, Mapping):
        return {str(k): plain(v, omit) for k, v in doc.items()}
    if isinstance(doc, list | tuple):
        return [plain(v, omit) for v in doc]
    return doc  # int, float, bool and str are JSON as they are
