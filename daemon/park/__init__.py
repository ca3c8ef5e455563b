"""Standby replicas and the park ladder: where each workload of the node waits, and what moves it.

* :mod:`.standbys` — :class:`~.standbys.StandbyRegistry`: snapshots restored ahead (CPU side only, stopped,
  CUDA-checkpointed), claimed by one activation each, durable across gpusnapd restarts.
* :mod:`.policy` — :class:`~.policy.Policy`: keep-warm count, priority and idle limits per snapshot or label,
  with the node's defaults and budgets (``[park]`` in ``gpusnapd.toml``).
* :mod:`.ladder` — :class:`~.ladder.Ladder`: each workload's rung (active, suspended, standby, ram, disk,
  remote), the moves its policy asks for, an event for every move.
"""
