"""Park policies: how each snapshot's workload is kept, set per snapshot or per labels, over the node's defaults.

A :class:`Policy` has three knobs; an unset one (``None``) inherits. The effective policy of a snapshot is its
snapshot rule over its label rules (in the order they were set, later over earlier) over the node's defaults
(``[park]`` in ``gpusnapd.toml``: :class:`~gpusnap.daemon.config.ParkConfig`):

- ``keep_warm``: standbys kept ready for the snapshot (default 0). The ladder makes them and makes a new one
  once a restore or activation took one.
- ``priority``: budgets take from the lowest priority first (default 0); within one priority, from the
  least recently used.
- ``standby_idle_s``: a standby beyond ``keep_warm`` that has stood this long is dropped (default 3600 s;
  0: never).

A rule belongs to its setter: a label rule of a non-root user applies to that user's snapshots only, a
snapshot rule needs the right to restore that snapshot. Rules live in ``<store>/park-policies.json``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import InvalidArgumentError
from gpusnap.daemon.api.types import Policy, Snapshot
from gpusnap.daemon.config import ParkConfig
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError

log = structlog.get_logger(__name__)

FILE = "park-policies.json"
MAX_RULES = 1024


@dataclasses.dataclass(frozen=True)
class Rule:
    """A policy for one snapshot (``snapshot_id``) or for the snapshots carrying ``labels``, set by
    ``owner_uid``."""

    policy: Policy
    owner_uid: int
    snapshot_id: str = ""
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def applies_to(self, snapshot: Snapshot) -> bool:
        if self.owner_uid != 0 and snapshot.owner_uid != self.owner_uid:
            return False
        if self.snapshot_id:
            return snapshot.id == self.snapshot_id
        return all(snapshot.labels.get(k) == v for k, v in self.labels.items())

    def same_selector(self, other: Rule) -> bool:
        return (self.owner_uid, self.snapshot_id, dict(self.labels)) == (
            other.owner_uid,
            other.snapshot_id,
            dict(other.labels),
        )


class Policies:
    """The node's rules (module docstring), durable in ``path``. Thread-safe."""

    def __init__(self, path: Path, config: ParkConfig):
        self.path = path
        self.config = config
        self._lock = threading.Lock()
        self._rules: list[Rule] = []

    def load(self) -> None:
        """Read the rules file (a missing one: no rules; an unreadable one is logged and ignored)."""
        try:
            rules = list(documents.load_items(self.path, Rule))
            for rule in rules:
                rule.policy.check()
        except FileNotFoundError:
            rules = []
        except (OSError, DocumentError, InvalidArgumentError) as exc:
            log.error("park.policies_unreadable", path=str(self.path), error=str(exc))
            rules = []
        with self._lock:
            self._rules = rules

    def set(self, rule: Rule) -> Rule:
        """Replace the rule with the same selector and owner (or add it); durable before returning.

        Raises:
            InvalidArgumentError: a policy out of range, or more than ``MAX_RULES`` rules (``INVALID_POLICY``).
        """
        rule.policy.check()
        with self._lock:
            rules = [r for r in self._rules if not r.same_selector(rule)] + [rule]
            if len(rules) > MAX_RULES:
                raise InvalidArgumentError(f"at most {MAX_RULES} park policies", reason="INVALID_POLICY")
            self._rules = rules
            documents.save_items(self.path, rules)
        return rule

    def delete(self, rule: Rule) -> bool:
        """Remove the rule with ``rule``'s selector and owner; False when there was none."""
        with self._lock:
            rules = [r for r in self._rules if not r.same_selector(rule)]
            if len(rules) == len(self._rules):
                return False
            self._rules = rules
            documents.save_items(self.path, rules)
        return True

    def rules(self, owner_uid: int | None = None) -> list[Rule]:
        """The rules (of ``owner_uid`` only, when given), in the order they apply."""
        with self._lock:
            return [r for r in self._rules if owner_uid is None or r.owner_uid == owner_uid]

    def effective(self, snapshot: Snapshot) -> Policy:
        """``snapshot``'s policy: its snapshot rules over its label rules over the defaults, every knob set."""
        policy = self.config.defaults
        rules = self.rules()
        for rule in [r for r in rules if not r.snapshot_id] + [r for r in rules if r.snapshot_id]:
            if rule.applies_to(snapshot):
                policy = rule.policy.over(policy)
        return policy

    def forget_snapshot(self, snapshot_id: str) -> None:
        """Drop the rules of snapshot ``snapshot_id`` (it was deleted); durable before returning."""
        with self._lock:
            rules = [r for r in self._rules if r.snapshot_id != snapshot_id]
            if len(rules) != len(self._rules):
                self._rules = rules
                documents.save_items(self.path, rules)
