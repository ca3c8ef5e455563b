"""docs/errors.md lists every reason the daemon raises, each under the action programs get for it."""

from __future__ import annotations

import re

from gpusnap.daemon.api.errors import Action, Code, DataLossError, InvalidArgumentError, action_for
from gpusnap.daemon.api.status import DOMAIN, from_status_proto, to_status_proto
from tests.conftest import REPO

DOC = REPO / "docs" / "errors.md"


def _raised_reasons() -> set[str]:
    """Every literal ``reason="..."`` in the daemon's source."""
    found: set[str] = set()
    for path in (REPO / "daemon").rglob("*.py"):
        if "_proto" in path.parts:
            continue
        found |= set(re.findall(r'reason="([A-Z][A-Z0-9_]+)"', path.read_text()))
    return found


def _documented() -> dict[str, tuple[Action, list[Code]]]:
    rows: dict[str, tuple[Action, list[Code]]] = {}
    action = None
    for line in DOC.read_text().splitlines():
        if m := re.fullmatch(r"### `(\w+)`", line):
            action = Action(m.group(1))
        elif action and (m := re.match(r"\| `([A-Z0-9_]+)` \| ([A-Z_/]+) \|", line)):
            rows[m.group(1)] = (action, [Code[c] for c in m.group(2).split("/")])
    return rows


def test_every_raised_reason_is_documented() -> None:
    missing = _raised_reasons() - set(_documented())
    assert not missing, f"add these reasons to docs/errors.md: {sorted(missing)}"


def test_documented_actions_are_the_ones_sent() -> None:
    for reason, (action, codes) in _documented().items():
        assert action_for(codes[0], reason) is action, reason


def test_error_info_carries_reason_metadata_and_action() -> None:
    err = DataLossError("damaged", reason="IMAGE_CHECKSUM", metadata={"files": "pages-1.img"})
    status = to_status_proto(err)
    back = from_status_proto(status)
    assert (type(back), back.reason, back.metadata) == (DataLossError, "IMAGE_CHECKSUM", {"files": "pages-1.img"})
    assert back.action is Action.FALL_BACK
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert info.domain == DOMAIN == "gpusnap.dev"
    assert dict(info.metadata) == {"files": "pages-1.img", "action": "fall_back"}
    assert InvalidArgumentError("x", reason="SNAPSHOT_NOT_FOUND").action is Action.FALL_BACK, "reason overrides code"
