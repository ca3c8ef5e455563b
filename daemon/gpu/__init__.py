"""GPU side of a checkpoint or restore: ordering and rollback across a process tree, GPU maps, preflight.

* :mod:`.controller` — :class:`~.controller.GpuTreeController`: lock → checkpoint → (CRIU dump) → restore →
  unlock across all CUDA PIDs of a tree, every driver call under a deadline, group rollback on failure.
* :mod:`.gpumap` — :func:`~.gpumap.resolve_gpu_map`: which GPU each checkpointed GPU restores onto.
* :mod:`.preflight` — pure checks over gathered facts (driver, arch, MIG, MPS, memory, gdrcopy, NCCL env).
"""
