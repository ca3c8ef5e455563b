"""Communicators across a checkpoint: one rank's ``torch.distributed`` process groups.

No communicator may be live while its rank is locked (a half-locked communicator hangs the other ranks,
FC-02), and no CUDA IPC or multicast memory may cross the checkpoint (FC-05, FC-07). Each rank therefore,
before the GPU lock, either

* **suspends** its NCCL communicators (``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``, NCCL ≥ 2.29.7, through
  the NCCL backend's ``suspend()``/``resume()`` of PyTorch ≥ 2.12): NCCL releases its dynamic GPU memory,
  the communicator's host side (bootstrap and proxy sockets between the ranks) stays, so the capture must
  keep established TCP connections (``gpusnap dump --tcp established``) and the ranks come back on the
  same host; or
* **tears them down** (``torch.distributed.destroy_process_group()``): every communicator, its GPU memory
  and its sockets go, and after the restore the rank creates them again through ``init``, with the restore
  context (a fresh rendezvous address, say). This works for every backend (gloo on CPU too) and for
  restores on other GPUs or hosts.

``mode="auto"`` suspends when every NCCL backend offers it and the NCCL in use is new enough, and tears down
otherwise. Engines with their own hooks use those instead (vLLM's ``checkpoint_prepare`` /
``checkpoint_restore``, see :mod:`gpusnap.adapters.engines.vllm.adapter`).

Both ways back are collective: ``ncclCommResume`` ends in a bootstrap barrier, and creating a process group
is a rendezvous. Every rank must resume at about the same time; :meth:`ProcessGroups.resume` can return
before the groups are back (``wait=False``) so that a daemon resuming ranks one after another does not
deadlock, and :meth:`ProcessGroups.ready` waits for them (with a deadline).

Sources: NCCL ``src/nccl.h.in`` (``ncclCommSuspend(ncclComm_t, int flags)``, ``NCCL_SUSPEND_MEM = 0x01``,
``ncclCommResume(ncclComm_t)``) and ``src/mem_manager.cc`` (resume re-imports peer buffers, then
``bootstrapBarrier``); PyTorch ``ProcessGroupNCCL`` backend methods ``suspend``/``resume``. Torch is imported
only when used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal

from gpusnap.adapters.base import RestoreContext

#: First NCCL release with ``ncclCommSuspend`` / ``ncclCommResume``.
NCCL_SUSPEND_MIN_VERSION = (2, 29, 7)

Mode = Literal["auto", "suspend", "recreate"]


def nccl_supports_suspend(version: tuple[int, ...] | None) -> bool:
    """Whether an NCCL ``(major, minor, patch)`` has ``ncclCommSuspend``; ``None`` (no NCCL) is false."""
    return version is not None and tuple(version[:3]) >= NCCL_SUSPEND_MIN_VERSION


def nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch uses (``torch.cuda.nccl.version()``), ``None`` without CUDA or NCCL."""
    import torch

    try:
        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return (int(v[0]), int(v[1]), int(v[2])) if isinstance(v, tuple) else None


class ProcessGroups:
    """Suspend or tear down this rank's process groups before a capture; bring them back after it.

    Args:
        init: ``(RestoreContext | None) -> None``: creates this rank's process groups (for instance
            ``dist.init_process_group(backend, init_method=ctx.env.get("GPUSNAP_RDZV", first), …)``); called
            again by :meth:`resume` after a teardown. The caller creates them the first time itself.
        mode: ``"auto"``, ``"suspend"`` (refuse unless every NCCL backend can) or ``"recreate"``.
        timeout_s: deadline of :meth:`ready` after a resume, seconds.
    """

    def __init__(
        self, init: Callable[[RestoreContext | None], None], *, mode: Mode = "auto", timeout_s: float = 120.0
    ) -> None:
        self._init = init
        self.mode: Mode = mode
        self.timeout_s = timeout_s
        self.suspended: Literal["", "suspend", "recreate"] = ""
        self._backends: list[Any] = []
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None

    # ---------------------------------------------------------------------------------------------- capture

    def suspend(self) -> str:
        """Wait for this rank's outstanding GPU work, then suspend or destroy its communicators.

        Returns:
            ``"suspend"`` or ``"recreate"``: what was done (``""`` when no process group exists).

        Raises:
            RuntimeError: ``mode="suspend"`` but a backend or the NCCL version cannot suspend.
        """
        import torch
        import torch.distributed as dist

        if self.suspended:
            return self.suspended
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        backends = self._nccl_backends()
        can_suspend = bool(backends) and all(hasattr(b, "suspend") for b in backends)
        can_suspend = can_suspend and nccl_supports_suspend(nccl_version())
        if self.mode == "suspend" and not can_suspend:
            raise RuntimeError(
                f"cannot suspend NCCL communicators: need NCCL >= {'.'.join(map(str, NCCL_SUSPEND_MIN_VERSION))} "
                f"(have {nccl_version()}) and PyTorch's NCCL backend suspend() (PyTorch >= 2.12); use mode='recreate'"
            )
        if can_suspend and self.mode != "recreate":
            for backend in backends:
                backend.suspend()
            self._backends = backends
            self.suspended = "suspend"
        else:
            dist.destroy_process_group()  # every group: communicators, their memory and sockets
            import gc

            gc.collect()  # drop the last references to the backends, which close their sockets
            self.suspended = "recreate"
        return self.suspended

    # ---------------------------------------------------------------------------------------------- restore

    def resume(self, context: RestoreContext | None, *, wait: bool = True) -> None:
        """Bring the communicators back (collective: every rank must call it).

        Args:
            context: the restore context (``None`` when a failed capture resumes the source).
            wait: block until they are back; with ``False`` return at once and let :meth:`ready` wait.

        Raises:
            Exception: from ``init`` or the backends' ``resume()`` (with ``wait``).
        """
        if not self.suspended:
            return
        self._done.clear()
        self._error = None
        how = self.suspended

        def run() -> None:
            try:
                if how == "suspend":
                    for backend in self._backends:
                        backend.resume()
                else:
                    self._init(context)
            except BaseException as exc:  # noqa: BLE001 - handed to ready()
                self._error = exc
            finally:
                self._backends = []
                self.suspended = ""
                self._done.set()

        if wait:
            run()
            self.ready()
        else:
            threading.Thread(target=run, name="gpusnap-pg-resume", daemon=True).start()

    def ready(self) -> None:
        """Wait until the last :meth:`resume` finished.

        Raises:
            TimeoutError: not back within ``timeout_s`` (a peer rank did not resume: FC-06's hang).
            Exception: what the resume raised.
        """
        if not self._done.wait(self.timeout_s):
            raise TimeoutError(
                f"process groups not back within {self.timeout_s:g} s: every rank must resume (collective)"
            )
        if self._error is not None:
            raise self._error

    # --------------------------------------------------------------------------------------------- internals

    @staticmethod
    def _nccl_backends() -> list[Any]:
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if not torch.cuda.is_available():
            return []
        device = torch.device("cuda", torch.cuda.current_device())
        out = []
        for group in list(c10d._world.pg_group_ranks):
            if "nccl" in str(dist.get_backend(group)).lower():
                out.append(group._get_backend(device))
        return out
