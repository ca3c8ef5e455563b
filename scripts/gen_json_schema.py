#!/usr/bin/env python3
"""Write docs/schemas/v1/cli.schema.json: the JSON Schema (2020-12) of every ``gpusnap -o json`` output.

The shapes come from the classes ``gpusnap.daemon.cli.render`` writes: the client's values
(``gpusnap.daemon.client.values``) and the commands' documents (``gpusnap.daemon.cli.documents``,
whose ``COMMANDS`` names each command's document). A field typed ``X | None`` is left out when unset, so
it is not required; every other field is. ``make schemas`` runs this; tests/daemon/test_json_schema.py
validates real outputs against the file and checks that it is current.

Compatibility within v1: keys are only ever added (consumers ignore unknown keys); a key is never
renamed, retyped or removed; that needs v2.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import json
import sys
import types
import typing
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "schemas" / "v1" / "cli.schema.json"
SNAKE = {"pattern": "^[a-z][a-z0-9_]*$"}
ERROR = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "gRPC status code name, e.g. NOT_FOUND"},
        "reason": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$", "description": "docs/errors.md"},
        "action": {"enum": ["retry", "fall_back", "fix"]},
        "message": {"type": "string"},
        "metadata": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "minProperties": 1,
            "description": "left out when the error has none",
        },
    },
    "required": ["code", "reason", "action", "message"],
    "additionalProperties": False,
}


class _Writer:
    def __init__(self) -> None:
        self.defs: dict[str, Any] = {"error": ERROR}

    def type_schema(self, hint: Any, omit: frozenset[str]) -> dict[str, Any]:
        from gpusnap.daemon.api.errors import GpusnapError

        origin = typing.get_origin(hint)
        if origin in (types.UnionType, typing.Union):
            (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
            return self.type_schema(inner, omit)
        if origin in (tuple, list):
            return {"type": "array", "items": self.type_schema(typing.get_args(hint)[0], omit)}
        if origin is collections.abc.Mapping:
            return {"type": "object", "additionalProperties": self.type_schema(typing.get_args(hint)[1], omit)}
        if dataclasses.is_dataclass(hint):
            return {"$ref": f"#/$defs/{self.message(hint, omit)}"}  # type: ignore[arg-type]
        if hint is GpusnapError:
            return {"$ref": "#/$defs/error"}
        if hint is datetime:
            return {"type": "string", "format": "date-time", "description": "RFC 3339, UTC"}
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return {"enum": [m.value for m in hint]}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        return {"type": simple[hint]}

    def message(self, cls: type, omit: frozenset[str]) -> str:
        """The def of ``cls`` (``Listed<Name>`` when fields are left out of it or of its parts)."""
        name = ("Listed" if omit else "") + cls.__name__
        if name in self.defs:
            return name
        self.defs[name] = {}  # placeholder against recursion
        hints = typing.get_type_hints(cls)
        props: dict[str, Any] = {}
        required = []
        for field in dataclasses.fields(cls):
            if field.name in omit:
                continue
            sub = frozenset(o.partition(".")[2] for o in omit if o.startswith(field.name + "."))
            props[field.name] = self.type_schema(hints[field.name], sub) | dict(field.metadata.get("schema", {}))
            optional = typing.get_origin(hints[field.name]) in (types.UnionType, typing.Union)
            if not optional:
                required.append(field.name)
        body: dict[str, Any] = {"type": "object", "properties": props, "required": required, "propertyNames": SNAKE}
        if omit & {f.name for f in dataclasses.fields(cls)}:
            body["not"] = {"required": sorted(omit & {f.name for f in dataclasses.fields(cls)})}
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            body["description"] = " ".join(cls.__doc__.split())
        self.defs[name] = body
        return name


def schema() -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "build" / "pkg"))
    from gpusnap.daemon.cli.documents import COMMANDS

    writer = _Writer()
    for command, (doc, omit) in COMMANDS.items():
        writer.defs[f"command_{command}"] = writer.type_schema(doc, omit)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "gpusnap/v1/cli.schema.json",
        "title": "gpusnap -o json, v1",
        "description": "What `gpusnap -o json COMMAND` prints: validate against #/$defs/command_<COMMAND> "
        "(command_failed for any command that exits non-zero, command_detached for any --detach). "
        "Keys are only ever added within v1.",
        "$defs": dict(sorted(writer.defs.items())),
    }


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(OUT.relative_to(REPO))
