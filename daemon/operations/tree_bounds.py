"""Per-uid bounds on the trees gpusnapd keeps for a user: its restored trees and standbys, by count and by memory.

Every restore into a fresh PID namespace (a copy of ``--replicas``, a standby) leaves a tree with a namespace
init of root's (``gpusnap-init``, about 10 MiB) that outlives the operation, so one operation slot said nothing
of what a user holds: ``standby --count 64`` gave one user 64 root-owned inits (774 MB), sequential
``restore --replicas 16`` calls 64 copies (issue 26, item 3). So a non-root uid may hold at most
``max_trees_per_caller`` such trees at once, and their memory may not exceed ``max_tree_memory_per_caller``,
both counted **live** when an operation that would add trees starts (:meth:`TreeBounds.admit`): every tree
running as the uid that :func:`gpusnap.daemon.drivers.restored.trees` finds (standbys included: they are
stopped trees under such an init), its resident memory read now from every process of its namespace, the
init included, plus what operations of the uid admitted and not yet ended will add (their copies at the
snapshot's resident size at dump). A tree that grew since it was made counts as it is now. Root is not bounded
(its trees, and the trees root restores of a user's snapshot, are the operator's). The park ladder makes a
snapshot's keep-warm standbys as the snapshot's owner, so they count here too.

Refusals are ``RESOURCE_EXHAUSTED``: ``TOO_MANY_TREES`` or ``TREE_MEMORY_LIMIT``, naming what the uid holds and
how to free it (``gpusnap ls --running``, ``gpusnap stop``, ``gpusnap drop``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from gpusnap.daemon.api.errors import ResourceExhaustedError
from gpusnap.daemon.api.sizes import human_size
from gpusnap.daemon.drivers import proc, restored


@dataclasses.dataclass(frozen=True)
class TreeUse:
    """What a uid's trees hold now: how many, and their resident memory (bytes, inits included)."""

    trees: int
    memory_bytes: int


def use(uid: int, table: proc.ProcessTable | None = None) -> TreeUse:
    """The trees running as ``uid`` now (see the module docstring), from one listing of the processes."""
    found = [pids for tree, pids in restored.trees(table) if tree.uid == uid]
    return TreeUse(len(found), sum(proc.rss_bytes(pids) for pids in found))


class TreeBounds:
    """The bounds of the module docstring. Thread-safe.

    Args:
        max_trees: trees a non-root uid may hold at once (0: no bound).
        max_memory_bytes: their memory, measured live (0: no bound).
    """

    def __init__(self, max_trees: int, max_memory_bytes: int):
        self.max_trees = max_trees
        self.max_memory_bytes = max_memory_bytes
        self._lock = threading.Lock()
        self._admitted: dict[int, dict[int, TreeUse]] = {}
        self._next = 0

    def admit(self, uid: int, copies: int, bytes_each: int, what: str) -> Callable[[], None]:
        """Admit an operation of ``uid`` that adds ``copies`` trees of about ``bytes_each`` each (``what`` names
        it in a refusal); the returned release ends its admission (the operation's end: its trees then count
        live). Root is always admitted.

        Raises:
            ResourceExhaustedError: ``TOO_MANY_TREES`` or ``TREE_MEMORY_LIMIT`` (module docstring).
        """
        if uid == 0 or copies <= 0 or not (self.max_trees or self.max_memory_bytes):
            return _nothing
        with self._lock:  # one admission at a time: two cannot both pass on the same room
            live = use(uid)
            pending = list(self._admitted.get(uid, {}).values())
            trees = live.trees + sum(p.trees for p in pending)
            memory = live.memory_bytes + sum(p.memory_bytes for p in pending)
            adds = TreeUse(copies, copies * bytes_each)
            if self.max_trees and trees + adds.trees > self.max_trees:
                raise ResourceExhaustedError(
                    f"{what} would make {adds.trees} more restored tree{'s' if adds.trees > 1 else ''} of uid {uid}, "
                    f"which has {trees} (restored copies and standbys, each with a namespace init of root's) of "
                    f"the {self.max_trees} max_trees_per_caller allows; stop one (`gpusnap ls --running`, `gpusnap "
                    "stop PID`) or drop a standby (`gpusnap standbys`, `gpusnap drop ID`)",
                    reason="TOO_MANY_TREES",
                    metadata={"uid": str(uid), "trees": str(trees), "limit": str(self.max_trees)},
                )
            if self.max_memory_bytes and memory + adds.memory_bytes > self.max_memory_bytes:
                raise ResourceExhaustedError(
                    f"{what} would add about {human_size(adds.memory_bytes)} to the restored trees and standbys of "
                    f"uid {uid}, which hold {human_size(memory)} now (measured live, their namespace inits "
                    f"included) of the {human_size(self.max_memory_bytes)} max_tree_memory_per_caller allows; "
                    "stop one (`gpusnap ls --running`, `gpusnap stop PID`) or drop a standby (`gpusnap drop ID`)",
                    reason="TREE_MEMORY_LIMIT",
                    metadata={
                        "uid": str(uid),
                        "used_bytes": str(memory),
                        "needed_bytes": str(adds.memory_bytes),
                        "limit_bytes": str(self.max_memory_bytes),
                    },
                )
            self._next += 1
            key = self._next
            self._admitted.setdefault(uid, {})[key] = adds

        def release() -> None:
            with self._lock:
                mine = self._admitted.get(uid, {})
                mine.pop(key, None)
                if not mine:
                    self._admitted.pop(uid, None)

        return release


def _nothing() -> None:
    """Nothing admitted (root, or no bound)."""
