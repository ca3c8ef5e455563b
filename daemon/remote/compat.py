"""The compatibility gate: may a snapshot made on one node be pulled or restored on this one?

CRIU restores a process onto the kernel and CPU it expects: code that picked instructions by CPUID
faults on a CPU without them, and CRIU images name kernel objects of the kernel they came from; the CUDA
checkpoint API restores only onto the same GPU model with the driver branch that saved it (docs/fleet.md,
"Compatibility gate"). The gate compares a snapshot's :class:`~gpusnap.daemon.remote.layout.Provenance`
with this node and lists *every* difference, so one refusal says all that must change.
"""

from __future__ import annotations

from gpusnap.daemon.api.errors import FailedPreconditionError
from gpusnap.daemon.remote.layout import Provenance


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def differences(snap: Provenance, here: Provenance, gpu_models: dict[str, int]) -> list[str]:
    """What keeps a snapshot of ``snap`` from running on ``here``, one line each; empty when compatible.

    Args:
        snap: the snapshot's provenance.
        here: this node's facts (``gpu_*`` fields unused).
        gpu_models: this node's GPUs, model name -> count.
    """
    out = []
    if snap.machine != here.machine:
        out.append(f"CPU architecture {snap.machine} (here {here.machine})")
    missing = sorted(set(snap.cpu_flags) - set(here.cpu_flags))
    if missing:
        shown = " ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        out.append(f"CPU flags missing here: {shown}")
    if snap.kernel != here.kernel:
        out.append(f"kernel {snap.kernel} (here {here.kernel})")
    if _version(here.criu_version) < _version(snap.criu_version):
        out.append(f"CRIU {snap.criu_version} or newer (here {here.criu_version})")
    if snap.gpu_count:
        have = gpu_models.get(snap.gpu_model, 0)
        if have < snap.gpu_count:
            out.append(
                f"{snap.gpu_count} x {snap.gpu_model} (here {have}"
                + (
                    f"; this node has {', '.join(f'{n} x {m}' for m, n in sorted(gpu_models.items()))}"
                    if gpu_models
                    else ""
                )
                + ")"
            )
        if snap.driver_major != here.driver_major:
            out.append(f"NVIDIA driver {snap.driver_major}.x (here {here.driver_major or 'none'})")
    return out


def check(snapshot_id: str, snap: Provenance, here: Provenance, gpu_models: dict[str, int]) -> None:
    """Refuse a snapshot this node cannot run.

    Raises:
        FailedPreconditionError: reason ``HOST_INCOMPATIBLE``, listing every difference.
    """
    diffs = differences(snap, here, gpu_models)
    if diffs:
        raise FailedPreconditionError(
            f"snapshot {snapshot_id} (made on {snap.node}) cannot run on this node; it needs: "
            + "; ".join(diffs)
            + ". Restore it on a node that matches, or make a snapshot here",
            reason="HOST_INCOMPATIBLE",
            metadata={"snapshot": snapshot_id, "differences": str(len(diffs))},
        )
