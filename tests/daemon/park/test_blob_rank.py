"""``park.ladder.blob_rank``, the buffer store's eviction rank as ``build_daemon`` wires it: a blob ranks
as the highest park priority of the snapshots that use it, by snapshot rule over label rule over the
default, and only for snapshots of the blob's owner."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from gpusnap.daemon.api.types import Policy
from gpusnap.daemon.config import ParkConfig
from gpusnap.daemon.park.ladder import blob_rank
from gpusnap.daemon.park.policy import Policies, Rule


def _snap(sid: str, uid: int, digests: list[str], labels: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        id=sid,
        owner_uid=uid,
        buffer_uid=uid,
        labels=labels or {},
        buffers=[SimpleNamespace(sha256=d) for d in digests],
    )


def test_a_blob_ranks_as_the_highest_priority_of_the_snapshots_using_it(tmp_path: Path) -> None:
    policies = Policies(tmp_path / "policies.json", ParkConfig(priority=1))
    policies.set(Rule(Policy(priority=5), owner_uid=0, labels={"tier": "gold"}))
    policies.set(Rule(Policy(priority=9), owner_uid=0, snapshot_id="s-pinned"))
    store = SimpleNamespace(
        list=lambda: [
            _snap("s-plain", 1000, ["aa", "shared"]),
            _snap("s-gold", 1000, ["bb", "shared"], {"tier": "gold"}),
            _snap("s-pinned", 1001, ["cc"], {"tier": "gold"}),
        ]
    )
    rank = {key: blob_rank(policies, store, key) for key in ("1000/aa", "1000/bb", "1000/shared", "1001/cc")}  # type: ignore[arg-type]
    assert rank == {"1000/aa": 1, "1000/bb": 5, "1000/shared": 5, "1001/cc": 9}
    assert blob_rank(policies, store, "1001/aa") == 0, "another user's blob of the same content is not used"  # type: ignore[arg-type]
    assert blob_rank(policies, store, "1000/gone") == 0, "a blob no snapshot uses ranks lowest"  # type: ignore[arg-type]
