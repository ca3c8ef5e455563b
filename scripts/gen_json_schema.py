#!/usr/bin/env python3
"""Write docs/schemas/v1/cli.schema.json: the JSON Schema (2020-12) of every ``gpusnap -o json`` output.

Message shapes come from the gpusnap.v1 descriptors, in the form daemon/cli/render.py writes them; the
per-command documents are declared below. ``make schemas`` runs this; tests/daemon/test_json_schema.py
validates real outputs against the file and checks that it is current.

Compatibility within v1: keys are only ever added (consumers ignore unknown keys); a key is never
renamed, retyped or removed; that needs v2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "schemas" / "v1" / "cli.schema.json"

# Sub-messages that are always present; any other message field may be absent (unset).
ALWAYS = {"Snapshot.created", "Snapshot.source", "Snapshot.host", "Operation.started", "NodeInfo.host"}
SNAKE = {"pattern": "^[a-z][a-z0-9_]*$"}
PHASES_BY_NAME = {
    "type": "object",
    "additionalProperties": {"type": "number", "minimum": 0},
    "description": "phase name -> seconds, in the order the phases ran",
}


def _scalar(field: Any) -> dict[str, Any]:
    from google.protobuf.descriptor import FieldDescriptor as F

    t = field.type
    if field.enum_type is not None:
        from gpusnap.daemon.cli.render import _enum_names

        return {"enum": sorted(set(_enum_names(field.enum_type).values()))}
    if t in (F.TYPE_INT32, F.TYPE_INT64, F.TYPE_SINT32, F.TYPE_SINT64, F.TYPE_SFIXED32, F.TYPE_SFIXED64):
        return {"type": "integer"}
    if t in (F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_FIXED32, F.TYPE_FIXED64):
        return {"type": "integer", "minimum": 0}
    if t in (F.TYPE_DOUBLE, F.TYPE_FLOAT):
        return {"type": "number"}
    if t == F.TYPE_BOOL:
        return {"type": "boolean"}
    return {"type": "string"}


def _value(field: Any, defs: dict[str, Any]) -> dict[str, Any]:
    msg = field.message_type
    if msg is None:
        return _scalar(field)
    if msg.full_name == "google.protobuf.Timestamp":
        return {"type": "string", "format": "date-time", "description": "RFC 3339, UTC"}
    if msg.full_name == "google.protobuf.Duration":
        return {"type": "number", "description": "seconds"}
    if msg.full_name == "google.rpc.Status":
        return {"$ref": "#/$defs/error"}
    _message(msg, defs)
    return {"$ref": f"#/$defs/{msg.name}"}


def _message(msg: Any, defs: dict[str, Any]) -> None:
    if msg.name in defs:
        return
    defs[msg.name] = {}  # placeholder against recursion
    props: dict[str, Any] = {}
    required = []
    for field in msg.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            props[field.name] = {
                "type": "object",
                "additionalProperties": _value(field.message_type.fields_by_name["value"], defs),
            }
            required.append(field.name)
        elif field.is_repeated:
            props[field.name] = {"type": "array", "items": _value(field, defs)}
            required.append(field.name)
        else:
            props[field.name] = _value(field, defs)
            if field.message_type is None or f"{msg.name}.{field.name}" in ALWAYS:
                required.append(field.name)
    defs[msg.name] = {"type": "object", "properties": props, "required": required, "propertyNames": SNAKE}


def schema() -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "build" / "pkg"))
    from gpusnap.daemon._proto import node_pb2, operations_pb2, types_pb2

    defs: dict[str, Any] = {}
    for msg in (types_pb2.Snapshot, operations_pb2.Operation, node_pb2.NodeInfo):
        _message(msg.DESCRIPTOR, defs)
    # `ls` leaves out the ~100 CPU flags per snapshot; `inspect` has them.
    listed_host = json.loads(json.dumps(defs["HostFacts"]))
    del listed_host["properties"]["cpu_flags"]
    listed_host["required"].remove("cpu_flags")
    listed_host["not"] = {"required": ["cpu_flags"]}
    defs["ListedHostFacts"] = listed_host
    listed = json.loads(json.dumps(defs["Snapshot"]))
    listed["properties"]["host"] = {"$ref": "#/$defs/ListedHostFacts"}
    defs["ListedSnapshot"] = listed
    listed_op = json.loads(json.dumps(defs["Operation"]))
    listed_op["properties"]["snapshot"] = {"$ref": "#/$defs/ListedSnapshot"}
    defs["ListedOperation"] = listed_op
    defs["error"] = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "gRPC status code name, e.g. NOT_FOUND"},
            "reason": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$", "description": "docs/errors.md"},
            "action": {"enum": ["retry", "fall_back", "fix"]},
            "message": {"type": "string"},
            "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["code", "reason", "action", "message", "metadata"],
        "additionalProperties": False,
    }
    ident = {"type": "string", "pattern": "^snap-[a-z2-7]{26}$"}
    op_id = {"type": "string", "pattern": "^op-[a-z2-7]{26}$"}
    pid = {"type": "integer", "minimum": 1}
    count = {"type": "integer", "minimum": 0}
    transfer = {
        "type": "object",
        "properties": {
            "id": ident,
            "remote": {"type": "string", "pattern": "^s3://"},
            "operation": op_id,
            "transferred_bytes": count,
            "skipped_bytes": count,
            "transferred_chunks": count,
            "skipped_chunks": count,
            "buffer_transferred_bytes": count,
            "phases": PHASES_BY_NAME,
        },
        "required": [
            "id",
            "remote",
            "operation",
            "transferred_bytes",
            "skipped_bytes",
            "transferred_chunks",
            "skipped_chunks",
            "buffer_transferred_bytes",
            "phases",
        ],
        "additionalProperties": False,
    }
    commands = {
        "dump": {
            "type": "object",
            "properties": {
                "id": ident,
                "name": {"type": "string"},
                "operation": op_id,
                "size_bytes": {"type": "integer", "minimum": 0},
                "buffer_bytes": {"type": "integer", "minimum": 0},
                "phases": PHASES_BY_NAME,
                "push_operation": op_id,
            },
            "required": ["id", "name", "operation", "size_bytes", "buffer_bytes", "phases"],
        },
        "store": {
            "type": "object",
            "properties": {
                "store_path": {"type": "string"},
                "snapshot_count": count,
                "store_used_bytes": count,
                "remote": {"type": "string"},
                "tiers": {"type": "array", "items": {"$ref": "#/$defs/StoreTier"}},
            },
            "required": ["store_path", "snapshot_count", "store_used_bytes", "remote", "tiers"],
            "additionalProperties": False,
        },
        "push": transfer,
        "pull": transfer,
        "restore": {
            "type": "object",
            "properties": {
                "pid": pid,
                "pids": {"type": "array", "items": pid},
                "namespace_pid": {"type": "integer", "minimum": 0},
                "snapshot_id": ident,
                "operation": op_id,
                "phases": PHASES_BY_NAME,
                "replicas": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "index": {"type": "integer", "minimum": 0},
                            "pid": pid,
                            "pids": {"type": "array", "items": pid},
                            "namespace_pid": {"type": "integer", "minimum": 0},
                        },
                        "required": ["index", "pid", "pids", "namespace_pid"],
                    },
                },
            },
            "required": ["pid", "pids", "namespace_pid", "snapshot_id", "operation", "phases", "replicas"],
        },
        "detached": {"type": "object", "properties": {"operation": op_id}, "required": ["operation"]},
        "rm": {
            "type": "object",
            "properties": {
                "deleted": {"type": "array", "items": ident},
                "failed": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"snapshot": {"type": "string"}, "error": {"$ref": "#/$defs/error"}},
                        "required": ["snapshot", "error"],
                    },
                },
            },
            "required": ["deleted", "failed"],
        },
        "ls": {"type": "array", "items": {"$ref": "#/$defs/ListedSnapshot"}},
        "inspect": {"$ref": "#/$defs/Snapshot"},
        "node": {"$ref": "#/$defs/NodeInfo"},
        "ops": {"type": "array", "items": {"$ref": "#/$defs/ListedOperation"}},
        "wait": {"$ref": "#/$defs/Operation"},
        "suspend": {"$ref": "#/$defs/Operation"},
        "resume": {"$ref": "#/$defs/Operation"},
        "failed": {
            "type": "object",
            "properties": {"error": {"$ref": "#/$defs/error"}},
            "required": ["error"],
            "additionalProperties": False,
        },
    }
    for name, body in commands.items():
        if body.get("type") == "object":
            body["propertyNames"] = SNAKE
        defs[f"command_{name}"] = body
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "gpusnap/v1/cli.schema.json",
        "title": "gpusnap -o json, v1",
        "description": "What `gpusnap -o json COMMAND` prints: validate against #/$defs/command_<COMMAND> "
        "(command_failed for any command that exits non-zero). Keys are only ever added within v1.",
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    return json.dumps(schema(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(OUT.relative_to(REPO))
