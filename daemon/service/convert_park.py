"""Conversions between the park ladder's domain types (standbys, policies, rungs) and gpusnap.v1 messages."""

from __future__ import annotations

from gpusnap.daemon._proto import operations_pb2, park_pb2
from gpusnap.daemon.api.types import Policy, RestoreOptions
from gpusnap.daemon.operations.standby import StandbyOptions
from gpusnap.daemon.park.ladder import Budget, Event, Rung, Workload
from gpusnap.daemon.park.policy import Rule
from gpusnap.daemon.service.convert import seconds, timestamp


def standby_options(req: operations_pb2.StandbyRequest) -> StandbyOptions:
    return StandbyOptions(
        snapshot=req.snapshot,
        count=max(1, req.count),
        private_network=req.private_network,
        timeout_s=seconds("timeout", req.timeout) if req.HasField("timeout") else None,
    )


def activate_options(req: operations_pb2.ActivateRequest) -> RestoreOptions:
    """An activation's restore options (its snapshot is filled in from the standby)."""
    return RestoreOptions(
        snapshot="",
        gpu_map=dict(req.gpu_map),
        timeout_s=seconds("timeout", req.timeout) if req.HasField("timeout") else None,
        env=dict(req.context.env),
        unset_env=tuple(req.context.unset_env),
        values=dict(req.context.values),
        verify_buffers=req.verify_buffers,
    )


def rung(r: Rung | None) -> park_pb2.Rung.ValueType:
    return park_pb2.Rung.ValueType(int(r)) if r is not None else park_pb2.RUNG_UNSPECIFIED


def policy(p: Policy) -> park_pb2.Policy:
    return park_pb2.Policy(keep_warm=p.keep_warm, priority=p.priority, standby_idle_seconds=p.standby_idle_s)


def policy_of(msg: park_pb2.Policy) -> Policy:
    return Policy(
        keep_warm=msg.keep_warm if msg.HasField("keep_warm") else None,
        priority=msg.priority if msg.HasField("priority") else None,
        standby_idle_s=msg.standby_idle_seconds if msg.HasField("standby_idle_seconds") else None,
    )


def rule(r: Rule) -> park_pb2.PolicyRule:
    return park_pb2.PolicyRule(
        selector=park_pb2.PolicySelector(labels=dict(r.labels)),
        policy=policy(r.policy),
        owner_uid=r.owner_uid,
        snapshot_id=r.snapshot_id,
    )


def workload(w: Workload) -> park_pb2.Workload:
    return park_pb2.Workload(
        snapshot_id=w.snapshot.id,
        name=w.snapshot.name,
        rung=rung(w.rung),
        active=w.active,
        suspended=w.suspended,
        standbys=w.standbys,
        policy=policy(w.policy),
        host_memory_bytes=w.host_memory_bytes,
        gpu_memory_bytes=w.gpu_memory_bytes,
        ram_tier_bytes=w.ram_tier_bytes,
        note=w.note,
    )


def budget(b: Budget) -> park_pb2.Budget:
    return park_pb2.Budget(name=b.name, used_bytes=b.used_bytes, budget_bytes=b.budget_bytes)


def event(e: Event) -> park_pb2.ParkEvent:
    return park_pb2.ParkEvent(
        time=timestamp(e.time),
        snapshot_id=e.snapshot_id,
        from_rung=rung(e.from_rung),
        to_rung=rung(e.to_rung),
        reason=e.reason,
    )
