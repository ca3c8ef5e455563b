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

Root's rules are the operator's: a user's rules apply under them (root's label and snapshot rules over the
user's, whenever either was set), and a user's ``priority`` never ranks its workloads above the node's
default priority (``[park] priority``) unless a rule of root's sets theirs: a user may order its own workloads
by lowering some, not take the standby budget from everyone else's (issue 26, item 2: a user's priority of
1000 dropped 3 of root's 4 standbys, and a user's rule set after root's on its snapshot replaced root's).
A non-root uid holds at most ``max_policies_per_caller`` rules (64), and all non-root uids together at most
:data:`MAX_RULES`; root's own rules count apart, so no user can keep root from setting one, and root may
delete any user's rule (``DeletePolicy`` by root with a selector none of root's has removes the users' rules
with that selector).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from pathlib import Path

import structlog

from gpusnap.daemon.api.errors import InvalidArgumentError, ResourceExhaustedError
from gpusnap.daemon.api.types import Policy, Snapshot
from gpusnap.daemon.config import ParkConfig
from gpusnap.daemon.store import documents
from gpusnap.daemon.store.documents import DocumentError

log = structlog.get_logger(__name__)

FILE = "park-policies.json"
MAX_RULES = 1024
"""Rules of all non-root uids together (and, apart, root's)."""
MAX_RULES_PER_USER = 64
"""``max_policies_per_caller``'s default."""


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

    def __init__(self, path: Path, config: ParkConfig, max_per_user: int = MAX_RULES_PER_USER):
        self.path = path
        self.config = config
        self.max_per_user = max_per_user
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
            mine = sum(1 for r in rules if r.owner_uid == rule.owner_uid)
            users = sum(1 for r in rules if r.owner_uid != 0)
            if rule.owner_uid != 0 and self.max_per_user and mine > self.max_per_user:
                raise ResourceExhaustedError(
                    f"uid {rule.owner_uid} has {mine - 1} park policies, the most max_policies_per_caller allows; "
                    "delete one first (`gpusnap park` lists them, `gpusnap park unset` deletes one)",
                    reason="TOO_MANY_POLICIES",
                    metadata={"limit": str(self.max_per_user)},
                )
            if (mine if rule.owner_uid == 0 else users) > MAX_RULES:
                raise ResourceExhaustedError(
                    f"the node holds {MAX_RULES} park policies of {'root' if rule.owner_uid == 0 else 'its users'}, "
                    "the most it keeps; delete one first (`gpusnap park unset`)",
                    reason="TOO_MANY_POLICIES",
                    metadata={"limit": str(MAX_RULES)},
                )
            self._rules = rules
            documents.save_items(self.path, rules)
        return rule

    def delete(self, rule: Rule) -> bool:
        """Remove the rule with ``rule``'s selector and owner; for root with no such rule of its own, every
        user's rule with that selector. False when there was none."""
        with self._lock:
            rules = [r for r in self._rules if not r.same_selector(rule)]
            if len(rules) == len(self._rules) and rule.owner_uid == 0:
                rules = [
                    r for r in self._rules if (r.snapshot_id, dict(r.labels)) != (rule.snapshot_id, dict(rule.labels))
                ]
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
        """``snapshot``'s policy, every knob set: root's snapshot rules over root's label rules over the owner's
        snapshot rules over the owner's label rules over the defaults, with a priority of the owner's no higher
        than the default's unless root's rules set one (module docstring)."""
        defaults = self.config.defaults
        applying = [r for r in self.rules() if r.applies_to(snapshot)]
        policy = defaults
        for rule in sorted(applying, key=lambda r: (r.owner_uid == 0, bool(r.snapshot_id))):  # (stable: set order)
            policy = rule.policy.over(policy)
        if not any(r.owner_uid == 0 and r.policy.priority is not None for r in applying):
            policy = dataclasses.replace(policy, priority=min(policy.priority or 0, defaults.priority or 0))
        return policy

    def forget_snapshot(self, snapshot_id: str) -> None:
        """Drop the rules of snapshot ``snapshot_id`` (it was deleted); durable before returning."""
        with self._lock:
            rules = [r for r in self._rules if r.snapshot_id != snapshot_id]
            if len(rules) != len(self._rules):
                self._rules = rules
                documents.save_items(self.path, rules)
