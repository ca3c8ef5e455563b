"""What a person types: ``gpusnap standby``, ``ls``/``node``/``standbys`` showing it with its host memory,
``restore`` finding it, ``activate`` of one another activation took, ``drop``, ``rm`` refused while standbys
exist and taking the snapshot's park rule with it, and a standby that survives gpusnapd's restart (real gpusnapd, real CRIU, a CPU tree)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from gpusnap.daemon.drivers import proc
from tests.conftest import DaemonProc, Workloads, phase_seconds, start_daemon, stop_daemon, wait_for
from tests.daemon.test_json_schema import check


def _json(d: DaemonProc, *args: str) -> object:
    """``gpusnap -o json ARGS``, checked against its command's schema (docs/schemas/v1/cli.schema.json)."""
    doc = json.loads(d.cli("-o", "json", *args, check=True).stdout)
    command = {"restore": "restore", "activate": "activate", "standby": "standby", "standbys": "standbys"}
    check(command.get(args[0], args[0]), doc)
    return doc


def test_standby_ls_restore_activate_drop_and_a_restart(
    tmp_path: Path, daemon: DaemonProc, workloads: Workloads
) -> None:
    w = workloads.start("--mem-mb", "8", "--no-listener")
    daemon.cli("dump", str(w.pid), "--name", "counter", check=True)
    dumped_at = w.last("parent.log")

    made = _json(daemon, "standby", "counter", "--count", "2")
    ids = [s["id"] for s in made["standbys"]]  # type: ignore[index]
    assert len(ids) == 2 and all(re.fullmatch(r"sb-[a-z2-7]{26}", i) for i in ids)
    roots = [s["pid"] for s in made["standbys"]]  # type: ignore[index]
    for root in roots:
        workloads.adopt(root)
    assert all(proc.stopped(p) for r in roots for p in proc.tree_pids(r)), "standbys wait stopped"
    assert w.last("parent.log") == dumped_at

    listed = daemon.cli("ls", check=True).stdout
    row = next(line for line in listed.splitlines() if ids[0] in line)
    assert "HOST MEMORY" in listed and re.search(r"[0-9.]+ MiB\s+ready", row), listed
    assert all(s["host_memory_bytes"] > 8 << 20 for s in _json(daemon, "standbys")), "8 MiB of pattern at least"  # type: ignore[union-attr,index]
    node = daemon.cli("node", check=True).stdout
    assert re.search(r"standbys\s+2, [0-9.]+ MiB of host memory", node), node
    assert re.search(r"standby\s+counter\s+0/0/2", node), "the ladder shows the workload on the standby rung"
    assert _json(daemon, "node")["standbys"] == 2  # type: ignore[index]

    # rm is refused while the snapshot has standbys (the standby's only snapshot)
    res = daemon.cli("rm", "counter")
    assert res.returncode == 4 and "drop them first" in res.stderr, res.stderr

    # standbys were made in private network namespaces (--count 2): a default restore does not take them
    restored = _json(daemon, "restore", "counter", "--private-net")
    assert restored["pid"] in roots, "a restore of the snapshot activated one of its standbys"  # type: ignore[index]
    assert "wake" in phase_seconds(restored) and "restore" not in phase_seconds(restored)  # type: ignore[arg-type]
    wait_for(lambda: w.last("parent.log") > dumped_at + 2, 15, "the activated standby does not run")
    moves = [(e.get("from_rung"), e["to_rung"], e["reason"]) for e in _json(daemon, "park")["events"]]  # type: ignore[index]
    assert [m[:2] for m in moves] == [(None, "disk"), ("disk", "standby"), ("standby", "active")], moves
    assert moves[1][2].startswith("standby op-") and moves[2][2].startswith("restore op-"), "each move says why"

    # the standby the restore took is gone: activating it restores the snapshot (from the other standby)
    taken = next(i for i, r in zip(ids, roots, strict=True) if r == restored["pid"])  # type: ignore[index]
    other = next(i for i in ids if i != taken)
    again = _json(daemon, "activate", taken)
    workloads.adopt(again["pid"])  # type: ignore[index]
    assert again["pid"] == roots[ids.index(other)], "it activated the snapshot's other standby"  # type: ignore[index]
    assert _json(daemon, "standbys") == []

    # a standby outlives gpusnapd: the next one adopts it
    third = _json(daemon, "standby", "counter", "--private-net")["standbys"][0]  # type: ignore[index]
    workloads.adopt(third["pid"])
    stop_daemon(daemon)
    second = start_daemon(tmp_path)
    try:
        assert [s["id"] for s in _json(second, "standbys")] == [third["id"]]  # type: ignore[union-attr]
        assert proc.stopped(third["pid"])
        assert _json(second, "drop", third["id"]) == {"dropped": [third["id"]]}
        wait_for(lambda: not proc.alive(third["pid"]), 10, "the dropped standby survived")
        res = second.cli("drop", third["id"])
        assert res.returncode == 3 and "no standby" in res.stderr
        (workload,) = _json(second, "park")["workloads"]  # type: ignore[index]
        assert (workload["rung"], workload["active"], workload["standbys"]) == ("active", 2, 0), workload

        # a snapshot's park rule goes with the snapshot
        second.cli("park", "set", "counter", "--priority", "5", check=True)
        assert [r["snapshot_id"] for r in _json(second, "park")["policies"]] == [workload["snapshot_id"]]  # type: ignore[index]
        second.cli("rm", "counter", check=True)
        assert _json(second, "park")["policies"] == []  # type: ignore[index]
        assert json.loads((second.store / "park-policies.json").read_text())["items"] == [], "and it stays gone"
    finally:
        stop_daemon(second)


def test_what_a_person_sees_of_standbys_and_the_ladder(tmp_path: Path, workloads: Workloads) -> None:
    """A restore says which path it took and why it did not take a ready standby; `stop` takes the operation id
    `activate` printed; the ladder credits no move to an operation that had nothing to do with it and shows no
    `unspecified` rung; a keep_warm the standby budget can never hold is refused with the sizes `park` shows."""
    budget = 120_000_000  # 114.4 MiB: room for two standbys of an 8 MiB tree (about 30 MiB of images), not eight
    d = start_daemon(tmp_path, extra_env={"GPUSNAP_PARK_STANDBY_RAM_BYTES": str(budget)})
    try:
        w = workloads.start("--mem-mb", "8", "--no-listener")
        d.cli("dump", str(w.pid), "--name", "web", check=True)
        ids = [s["id"] for s in _json(d, "standby", "web", "--count", "2")["standbys"]]  # type: ignore[index]
        for s in _json(d, "standbys"):  # type: ignore[union-attr]
            workloads.adopt(s["pid"])  # type: ignore[index]

        plain = d.cli("restore", "web", check=True)  # the standbys have private networks: from the images
        workloads.adopt(int(plain.stdout.split()[0]))
        said = " ".join(plain.stderr.split())  # (wrapped at 80 columns off a terminal)
        assert re.search(r"^restored snap-\w+ from its images as PID \d+: ", said), said
        assert (
            "not from a standby: its 2 ready standbys have private networks (made with --count > 1 or "
            "--private-net); restore --private-net to activate one" in said
        ), said
        fast = d.cli("restore", "web", "--private-net", check=True)
        said = " ".join(fast.stderr.split())
        assert re.search(rf"^restored snap-\w+ from standby ({ids[0]}|{ids[1]}) as PID \d+", said), said
        workloads.adopt(int(fast.stdout.split()[0]))
        taken = _json(d, "restore", "web", "--private-net")
        assert taken["standby_id"] in ids and "standbys_skipped" not in taken, taken  # type: ignore[index,operator]
        assert _json(d, "standbys") == [], "both standbys were taken"

        again = _json(d, "standby", "web")["standbys"][0]  # type: ignore[index]
        workloads.adopt(again["pid"])
        up = _json(d, "activate", again["id"])
        stopped = d.cli("stop", up["operation"])  # type: ignore[index]
        assert stopped.returncode == 0 and f"stopped PID {up['pid']} " in stopped.stdout, stopped  # type: ignore[index]
        wait_for(lambda: not proc.alive(up["pid"]), 20, "the activated tree survived its stop")  # type: ignore[index]

        other = workloads.start("--mem-mb", "1", "--no-listener", "--no-child")
        dry = json.loads(d.cli("-o", "json", "dump", str(other.pid), "--dry-run", check=True).stdout)
        events = _json(d, "park")["events"]  # type: ignore[index]
        assert not [e for e in events if dry["id"] in e["reason"]], "a dry run of another PID moved nothing"
        assert all(e["reason"] for e in events), events
        spare = _json(d, "standby", "web")["standbys"][0]  # type: ignore[index]
        workloads.adopt(spare["pid"])
        listed = d.cli("standbys", check=True, env={"COLUMNS": ""}).stdout  # 80 columns, off a terminal
        words = listed.split()
        assert spare["id"] in words and spare["snapshot_id"] in words, f"an id is split:\n{listed}"
        assert max(map(len, listed.splitlines())) <= 80, listed
        text = d.cli("park", check=True, env={"COLUMNS": ""}).stdout
        assert max(map(len, text.splitlines())) <= 80, text
        assert re.search(r"\bweb new -> disk: checkpoint op-[a-z2-7]{26}\b", " ".join(text.split())), text
        assert "unspecified" not in text and re.search(r"^ active +web +3/0/1 ", text, re.M), text
        assert re.search(r"standby_ram\s+[\d.]+ (B|[KMG]iB)\s+114\.4 MiB", text), text

        refused = d.cli("park", "set", "web", "--keep-warm", "8")
        assert refused.returncode == 2, refused
        assert re.search(
            r"keep_warm 8 for web needs 8 standbys of [\d.]+ MiB, [\d.]+ MiB of host memory, over the 114\.4 "
            r"MiB \[park\] standby_ram_bytes budget, so it could never be met; keep at most \d+ warm",
            " ".join(refused.stderr.split()),
        ), refused.stderr
        assert _json(d, "park")["policies"] == [], "nothing was set"  # type: ignore[index]
    finally:
        stop_daemon(d)
