"""Every command's ``-o json`` output validates against docs/schemas/v1/cli.schema.json (jsonschema)."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import jsonschema
import pytest

from tests.conftest import REPO, DaemonProc, Workloads

SCHEMA = json.loads((REPO / "docs" / "schemas" / "v1" / "cli.schema.json").read_text())
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("date-time")
def _rfc3339(value: object) -> bool:
    if not isinstance(value, str) or not RFC3339.match(value):
        return False
    datetime.fromisoformat(value)
    return True


def check(command: str, doc: Any) -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    schema = {"$defs": SCHEMA["$defs"], "$ref": f"#/$defs/command_{command}"}
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(doc)


MAPS = {"labels", "metadata", "gpu_map"}
"""Keys whose objects are maps of the user's own keys and values (a label may be empty)."""


def absent_not_empty(doc: Any, where: str = "") -> list[str]:
    """Where ``doc`` has an empty string or a 0 standing for "none" instead of leaving the key out."""
    found: list[str] = []
    if isinstance(doc, dict):
        for key, value in doc.items():
            if value == "" or (key in ("target_pid", "target_snapshot") and not value):
                found.append(f"{where}.{key}")
            elif key not in MAPS:
                found += absent_not_empty(value, f"{where}.{key}")
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            found += absent_not_empty(value, f"{where}[{i}]")
    return found


def run(daemon: DaemonProc, *args: str, ok: bool = True) -> Any:
    res = daemon.cli("-o", "json", *args)
    assert (res.returncode == 0) is ok, res.stderr
    doc = json.loads(res.stdout)
    assert not absent_not_empty(doc), f"{args}: absent values are left out, not empty: {absent_not_empty(doc)}"
    return doc


def test_every_command_matches_the_schema(daemon: DaemonProc, workloads: Workloads) -> None:
    w = workloads.start("--mem-mb", "8", "--no-child")
    dump = run(daemon, "dump", str(w.pid), "--name", "schema", "--label", "team=ops", "--leave-running")
    check("dump", dump)
    names = [p["phase"] for p in dump["phases"]]
    assert names.index("dump") < names.index("publish") < names.index("finish"), "phases: one list, in order"
    restored = run(daemon, "restore", "schema", "--private-net")
    workloads.adopt(restored["pid"])
    check("restore", restored)
    detached = run(daemon, "restore", "schema", "--private-net", "--detach")
    check("detached", detached)
    waited = run(daemon, "wait", detached["operation"])
    check("wait", waited)
    workloads.adopt(waited["restore"]["pid"])
    assert waited["kind"] == "restore" and waited["state"] == "succeeded"

    listed = run(daemon, "ls")
    check("ls", listed)
    trees = [t for t in run(daemon, "ls", "--running") if t["snapshot_id"] == dump["id"]]
    check("ls_running", trees)
    assert sorted(t["pid"] for t in trees) == sorted([restored["pid"], waited["restore"]["pid"]])
    assert "cpu_flags" not in listed[0]["host"], "per-snapshot CPU flags stay out of ls"
    inspected = run(daemon, "inspect", "schema")
    check("inspect", inspected)
    assert inspected["host"]["cpu_flags"], "inspect keeps them"
    assert isinstance(inspected["size_bytes"], int) and inspected["size_bytes"] == dump["size_bytes"]
    assert isinstance(inspected["source"]["rss_bytes"], int)
    assert datetime.fromisoformat(inspected["created"]).tzinfo is not None

    node = run(daemon, "node")
    check("node", node)
    assert node["gpu_prefill"]["enabled"] is False and node["gpu_prefill"]["reason"], node["gpu_prefill"]
    store = run(daemon, "store")
    check("store", store)
    assert "remote" not in store, "no remote store: no remote key"
    ops = run(daemon, "ops")
    check("ops", ops)
    assert [o["kind"] for o in ops] == ["checkpoint", "restore", "restore"]
    assert all(isinstance(p["bytes"], int) for o in ops for p in o["phases"])

    # Failures: one error object, whatever the command.
    for args in (
        ["inspect", "no-such"],
        ["restore", "snap-aaaaaaaaaaaaaaaaaaaaaaaaaa"],
        ["wait", "op-bad"],
        ["suspend", str(w.pid)],
        ["resume", str(w.pid)],
    ):
        failed = run(daemon, *args, ok=False)
        check("failed", failed)
    partly = run(daemon, "rm", "no-such", ok=False)  # rm reports each snapshot it could not delete
    check("rm", partly)
    assert partly["deleted"] == [] and partly["failed"][0]["error"]["reason"] == "NOTHING_TO_DELETE"
    assert partly["failed"][0]["error"]["action"] == "fix", "nothing to delete is not a cue to cold-start a worker"
    failed_op = run(daemon, "restore", "schema", ok=False)  # the source still holds its port
    check("failed", failed_op)
    assert failed_op["error"]["reason"] == "ADDRESS_IN_USE"
    ops = run(daemon, "ops")
    check("ops", ops)
    error = ops[-1]["error"]
    assert ops[-1]["state"] == "failed" and (error["reason"], error["action"]) == ("ADDRESS_IN_USE", "fix")

    stopped = run(daemon, "stop", str(restored["pid"]))
    check("stop", stopped)
    removed = run(daemon, "rm", "schema")
    check("rm", removed)
    assert removed == {"deleted": [dump["id"]], "failed": []}


@pytest.mark.parametrize(
    "bad",
    [
        {"id": "snap-x", "name": "", "operation": "op-y", "size_bytes": "12", "buffer_bytes": 0, "phases": {}},
        {"sizeBytes": 1},
    ],
)
def test_schema_rejects_the_old_forms(bad: dict[str, object]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        check("dump", bad)
    with pytest.raises(jsonschema.ValidationError):
        check("inspect", {"id": "snap-x", "created": "yesterday"})


def test_schema_file_is_what_the_generator_writes() -> None:
    """docs/schemas/v1/cli.schema.json is generated (`make schemas`); a stale copy fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_json_schema", REPO / "scripts" / "gen_json_schema.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render() == (REPO / "docs" / "schemas" / "v1" / "cli.schema.json").read_text(), "run `make schemas`"
