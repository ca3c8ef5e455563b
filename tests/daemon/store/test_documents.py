"""The saved documents' one codec (gpusnap.daemon.store.documents): what the previous release wrote still
loads (tests/daemon/store/previous/: written by its own code, at main 0.1.0 before the codec), what this
release writes reads back as the same value, and a document of a newer gpusnapd or of the wrong types is
refused, naming the field."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpusnap.daemon.api.types import Policy
from gpusnap.daemon.config import ParkConfig
from gpusnap.daemon.operations import provenance
from gpusnap.daemon.park.ladder import Tracked
from gpusnap.daemon.park.policy import Policies, Rule
from gpusnap.daemon.park.standbys import Standby
from gpusnap.daemon.remote import evict
from gpusnap.daemon.remote.layout import Provenance
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError

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
