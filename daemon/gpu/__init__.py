"""GPU side of a checkpoint or restore: ordering and rollback across a process tree, GPU maps.

* :mod:`.support` — :class:`~.support.GpuSupport`: this node's CUDA driver and NVML (or why it has neither), and
  the CUDA side of a tree (:class:`~.support.GpuTree`).
* :mod:`.controller` — :class:`~.controller.GpuTreeController`: lock → checkpoint → (CRIU dump) → restore →
  unlock across all CUDA PIDs of a tree, every driver call under a deadline, group rollback on failure.
* :mod:`.gpumap` — :func:`~.gpumap.resolve_gpu_map`: which GPU each checkpointed GPU restores onto.

The GPU preflight (driver, arch, MIG, MPS, memory, gdrcopy, NCCL env) is ``gpusnap.daemon.preflight.gpu``.
"""
