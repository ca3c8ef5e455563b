"""The saved documents' one codec (gpusnap.daemon.store.documents): what the previous release wrote still
loads (tests/daemon/store/previous/: written by its own code, at main 0.1.0 before the codec; the manifest
and the journal by main at fee9775, before they moved to it), what this
release writes reads back as the same value, and a document of a newer gpusnapd or of the wrong types is
refused, naming the field."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import Creds, OperationKind, OperationState, Policy
from gpusnap.daemon.config import ParkConfig
from gpusnap.daemon.operations import provenance
from gpusnap.daemon.park.ladder import Tracked
from gpusnap.daemon.park.policy import Policies, Rule
from gpusnap.daemon.park.standbys import Standby
from gpusnap.daemon.remote import evict, layout
from gpusnap.daemon.remote.layout import Provenance
from gpusnap.daemon.store import documents, facts, manifest
from gpusnap.daemon.store.documents import DocumentError
from gpusnap.daemon.store.facts import (
    CaptureFacts,
    JournaledAgent,
    JournaledBuffers,
    JournaledTree,
    RestoreFacts,
    TransferFacts,
)
from gpusnap.daemon.store.journal import Entry, EntryResult, Journal

PREVIOUS = Path(__file__).parent / "previous"

STANDBY = Standby(
    id="sb-aaaa",
    snapshot_id="s-one",
    owner_uid=1000,
    created=datetime(2026, 12, 3, 19, 11, 29, 123456, tzinfo=UTC),
    init_pid=4100,
    init_start=1764789089.25,
    root=4101,
    root_start=1764789089.5,
    ns_pid=1,
    pids=(4101, 4102),
    restored=(1, 2),
    cuda_pids=(4102,),
    private_network=True,
    host_memory_bytes=8 << 20,
    digests=("ab" * 32,),
    buffer_uid=1000,
)


def test_the_previous_release_s_park_policies_load(tmp_path: Path) -> None:
    shutil.copy(PREVIOUS / "park-policies.json", tmp_path / "p.json")
    policies = Policies(tmp_path / "p.json", ParkConfig())
    policies.load()
    assert policies.rules() == [
        Rule(Policy(keep_warm=2, priority=5), owner_uid=0, snapshot_id="s-pinned"),
        Rule(Policy(standby_idle_s=60.0), owner_uid=1000, labels={"tier": "gold"}),
    ]
    policies.forget_snapshot("s-pinned")  # written back in this release's form, and read back
    again = Policies(tmp_path / "p.json", ParkConfig())
    again.load()
    assert again.rules() == policies.rules()
    assert json.loads((tmp_path / "p.json").read_bytes())["schema_version"] == 1


def test_the_previous_release_s_standbys_load() -> None:
    assert documents.load_items(PREVIOUS / "standbys.json", Standby) == (STANDBY,)
    listing = documents.Listing(items=(STANDBY,))
    assert documents.decode(documents.encode(listing), documents.Listing[Standby]) == listing


def test_the_previous_release_s_tracked_trees_and_remote_record_load() -> None:
    tracked = documents.load_items(PREVIOUS / "park-active.json", Tracked)
    assert tracked == (Tracked("s-one", 4200, 1764789090.75, 1 << 30, True),)
    record = evict.read_record(PREVIOUS)
    assert record == evict.Record("s3://bucket/prefix", {"cd" * 32: ("ef" * 32, "01" * 32)})


def test_the_previous_release_s_provenance_loads() -> None:
    prov = documents.decode((PREVIOUS / "provenance.json").read_bytes(), Provenance)
    assert prov == Provenance(
        node="n1",
        pushed_at="2026-12-03T19:11:29+00:00",
        gpusnap_version="0.1.0",
        machine="x86_64",
        kernel="6.12.0",
        criu_version="4.2",
        cpu_flags=("avx2", "sse4_2"),
        gpu_model="NVIDIA H200",
        gpu_count=2,
        driver_major="580",
    )
    assert documents.decode(provenance.to_bytes(prov), Provenance) == prov
    assert documents.convert(documents.to_builtins(prov), Provenance) == prov


def test_a_newer_or_mistyped_document_is_refused_naming_the_field(tmp_path: Path) -> None:
    newer = documents.encode(documents.Listing(schema_version=2, items=(STANDBY,)))
    with pytest.raises(DocumentError, match="schema_version 2 is newer than this gpusnapd reads"):
        documents.decode(newer, documents.Listing[Standby])
    (tmp_path / "remote.json").write_text('{"remote": "s3://b/p", "buffers": {"ab": [1]}}')
    with pytest.raises(DocumentError, match=r"remote.json: Expected `str`, got `int` - at `\$.buffers\[...\]\[0\]`"):
        documents.load(tmp_path / "remote.json", evict.Record)
    assert evict.read_record(tmp_path) is None, "an unreadable record evicts nothing"


def test_the_previous_release_s_manifest_loads_and_is_written_back_alike(tmp_path: Path) -> None:
    """A manifest the previous release wrote (every field set) reads as this release's Snapshot, and this release
    writes the same document back: other nodes' gpusnapd, of that release, read it by the same names."""
    snap = manifest.read(PREVIOUS / "manifest")
    assert snap.id == "snap-previousreleaseaaaaaaaaaaa" and snap.owner_uid == 1000
    assert snap.created == datetime(2026, 12, 3, 19, 11, 29, 123456, tzinfo=UTC)
    assert snap.source.listening == ("127.0.0.1:8000",) and snap.host.cpu_flags == ("avx2", "sse4_2")
    assert snap.worker is not None and snap.worker.arenas[0].chunk_bytes == (2 << 20, 2 << 20)
    assert snap.worker.released_bytes == 1 << 30 and snap.agents[0].role == "core"
    assert snap.buffers[0].arena == 1 and snap.buffers[1].agent == ""
    assert snap.held_files[0].flags == 32769 and snap.held_files[1].size == -1
    assert snap.owner_creds == Creds(1000, 1000, (1000, 27)) and snap.tree_creds[1].groups == ()
    assert snap.terminals[0].fds == ("4101/0", "4101/1") and snap.terminals[0].controlling
    assert snap.gpu_processes[0].visible_gpu_uuids[1] == "GPU-aa" and snap.process_images[1].image_bytes == 0
    manifest.write(tmp_path, snap)
    old = json.loads((PREVIOUS / "manifest" / manifest.MANIFEST_NAME).read_bytes())
    new = json.loads((tmp_path / manifest.MANIFEST_NAME).read_bytes())
    assert new == {**old, "created": "2026-12-03T19:11:29.123456Z"}, "the same document (UTC written as Z)"
    assert datetime.fromisoformat(new["created"]) == datetime.fromisoformat(old["created"])
    assert manifest.read(tmp_path) == snap


def test_the_previous_release_s_journal_loads(tmp_path: Path) -> None:
    """Entries the previous release journaled, running and finished, read as this release's entries: their facts
    as written, the running one's phase from its phase file, every result and error; and each reads back the
    same once this release writes it."""
    shutil.copytree(PREVIOUS / "journal", tmp_path / "journal")
    entries = {e.id.removeprefix("op-").rstrip("a"): e for e in Journal(tmp_path / "journal").entries()}
    assert sorted(entries) == [
        "activaterunning",
        "checkpointdone",
        "checkpointrunning",
        "pushfailed",
        "restoredone",
        "restorerunning",
        "resumedone",
        "standbydone",
        "standbyrunning",
        "suspendcancelled",
    ]
    running = entries["checkpointrunning"]
    last = json.loads((tmp_path / "journal" / f"{running.id}.json").read_bytes().splitlines()[-1])
    assert running.running and running.kind is OperationKind.CHECKPOINT and running.facts == last["facts"]
    assert running.phase == "publish" and running.request_id == "req-1" and running.finished == ""
    assert running.started == datetime(2026, 12, 3, 19, 11, 29, 123456, tzinfo=UTC)
    assert entries["restorerunning"].facts["earlier_trees"][0]["validated"] is True
    restore = entries["restoredone"].result
    assert restore is not None and restore.restore is not None
    assert restore.restore.pids == (4802, 4803) and restore.restore.standby_id.startswith("sb-bbbb")
    assert restore.restore.file_copies[0].copy == "/home/u/log.gpusnap-1"
    assert entries["checkpointdone"].result == EntryResult(snapshot_id="snap-previousreleaseaaaaaaaaaaa")
    assert entries["resumedone"].result == EntryResult(gpu_map={"GPU-a": "GPU-b"})
    assert entries["standbydone"].result == EntryResult(standbys=("sb-" + "c" * 26,))
    failed = entries["pushfailed"]
    assert failed.state is OperationState.FAILED and failed.error is not None and failed.error.reason == "REMOTE_DENIED"
    assert entries["suspendcancelled"].state is OperationState.CANCELLED
    for entry in entries.values():
        assert documents.decode(documents.encode(entry), Entry) == entry


def test_the_previous_release_s_recovery_facts_read_as_their_kind_s_types(tmp_path: Path) -> None:
    """What recovery reads of each unfinished operation the previous release journaled: one type per kind
    (gpusnap.daemon.store.facts), every fact as it wrote it (its agents' other keys are not read)."""
    shutil.copytree(PREVIOUS / "journal", tmp_path / "journal")
    entries = {e.id.removeprefix("op-").rstrip("a"): e for e in Journal(tmp_path / "journal").entries()}
    read = {name: facts.read(e.kind, e.facts) for name, e in entries.items()}
    assert read["checkpointrunning"] == CaptureFacts(
        tree_pids=(4101, 4102),
        starts=(1764789089.25, 1764789089.5),
        control_dir="/home/u/ctl",
        agents=(JournaledAgent(pid=4101, uid=1000, instance_id="ab" * 16, wake_dir="/run/gpusnap/wake"),),
        staged=(
            JournaledBuffers(
                instance_id="ab" * 16,
                uid=1000,
                names=("model.embed",),
                paths=("/var/lib/gpusnap/buffers/staging/x.buf",),
                digests=("12" * 32,),
            ),
        ),
        cuda_pids=(4102,),
        staging="snap-previousreleasebbbbbbbbbbb",
        criu_helper=4300,
        criu_helper_start=1764789095.5,
        snapshot_id="snap-previousreleasebbbbbbbbbbb",
    )
    restore = read["restorerunning"]
    assert isinstance(restore, RestoreFacts) and restore.env == {"A": "1"} and restore.unset_env == ("B",)
    assert restore.earlier_trees == (
        JournaledTree(
            helper_pid=4400,
            helper_start=1764789100.5,
            init_pid=4401,
            init_start=1764789100.75,
            ns_pid=1,
            root=4402,
            root_start=1764789100.8,
            cuda_pids=(4403,),
            validated=True,
            pids=(4402, 4403),
        ),
    )
    assert restore.tree == JournaledTree(helper_pid=4500, helper_start=1764789101.5, expect_pids=(4101, 4102))
    activate = read["activaterunning"]
    assert isinstance(activate, RestoreFacts) and activate.standby == "sb-" + "a" * 26
    assert activate.tree is not None and activate.tree.cuda_pids == (4602,) and not activate.tree.validated
    assert isinstance(read["standbyrunning"], RestoreFacts) and read["standbyrunning"].tree is not None
    assert read["suspendcancelled"] == CaptureFacts() and read["pushfailed"] == TransferFacts()
    for name, entry in entries.items():  # and what this release writes reads back the same
        assert facts.read(entry.kind, facts.raw(read[name])) == read[name]


def test_the_previous_release_s_remote_manifest_and_index_entry_load() -> None:
    """What another node of the previous release pushed reads here, and what this release pushes reads as the same
    (its own code is gone: the document's shape is compared)."""
    data = (PREVIOUS / "remote-manifest.json").read_bytes()
    doc = layout.parse(data, "snap-previousremoteaaaaaaaaaaaa")
    assert doc.snapshot.buffers[0].arena == 1 and doc.provenance.gpu_model == "NVIDIA H200"
    assert doc.file_chunks == (("01" * 32,),) and len(doc.chunks()) == 3
    assert layout.parse(doc.to_bytes(), doc.snapshot.id) == doc
    old, new = json.loads(data), json.loads(doc.to_bytes())
    assert new == {**old, "snapshot": {**old["snapshot"], "created": "2026-12-03T19:11:29.123456Z"}}
    entry = (PREVIOUS / "remote-index-entry.json").read_bytes()
    assert manifest.decode(entry) == doc.snapshot
    assert json.loads(manifest.encode(doc.snapshot)) == {**json.loads(entry), "created": "2026-12-03T19:11:29.123456Z"}
