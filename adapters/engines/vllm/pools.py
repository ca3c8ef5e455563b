"""A vLLM worker's memory besides weights and KV cache, in address-stable arenas (opt-in: ``GPUSNAP_VLLM_POOLS=1``).

Where each part of it goes (:mod:`gpusnap.adapters.vmm_pool`; docs/engines.md, "The rest of device memory in arenas"):

- **The CUDA graph pool** (KEEP): vLLM captures every graph into one pool, ``current_platform.
  get_global_graph_pool()`` (``vllm/platforms/interface.py``; read by ``CUDAGraphWrapper`` in
  ``vllm/compilation/cuda_graph.py`` and the V2 runner's ``CudaGraphManager`` in
  ``vllm/v1/worker/gpu/cudagraph_utils.py``, both built before any capture). :func:`graph_pool` hooks that
  method to hand out a ``torch.cuda.MemPool`` over gpusnap's arenas instead of torch's private pool. Its bytes
  are saved at capture and filled back: a graph pool holds state replays read and never write
  (sgl-project/sglang PR #32718).
- **Persistent buffers** (KEEP): when ``capture_model`` starts (every buffer exists, no graph has recorded an
  address yet), every tensor the worker holds in torch's default pool (the runner's input buffers, block
  tables, the sampler's and the model's non-parameter buffers such as rotary tables) moves into an arena
  (:func:`move_before_capture`). Their bytes are saved: some are written once (``arange``-like tables), and
  SGLang kept exactly those out of what it released (sgl-project/sglang PR #30474).
- **Workspaces** (SCRATCH): vLLM's ``WorkspaceManager`` buffers (``vllm/v1/worker/workspace.py``: temporary
  storage that kernels take through ``get_simultaneous`` for one call; the manager is locked after warm-up, so
  they no longer move) go into an arena of their own, released at capture and mapped again at resume unsaved.
- **torch's reserved-but-free segments**: given back with ``torch.cuda.empty_cache()`` when the KV cache is
  released (``processes._empty_cache``); the move above empties the segments the buffers leave.

``GPUSNAP_SCRATCH_POISON`` (a byte, e.g. ``165``) fills scratch memory with that byte each time it is mapped
again, so that a test shows no replay reads it before writing it. The CPU tests drive all of this against the
fake driver (tests/adapters/test_vmm_pool.py); nothing here runs unless ``GPUSNAP_VLLM_POOLS`` is ``1``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from gpusnap.adapters import vmm
from gpusnap.adapters.vmm_pool import ALLOC_FN, FREE_FN, ArenaPool, Policy, default_pool_tensors

log = logging.getLogger(__name__)

ENV = "GPUSNAP_VLLM_POOLS"
POISON_ENV = "GPUSNAP_SCRATCH_POISON"

_graphs: ArenaPool | None = None
_declined = False
"""The graph pool stays vLLM's in this process (said once in the log)."""


def enabled() -> bool:
    """``GPUSNAP_VLLM_POOLS=1`` (off by default)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "on", "yes")


def poison() -> int | None:
    """The byte ``GPUSNAP_SCRATCH_POISON`` names (0–255), if any.

    Raises:
        ValueError: the value is not a byte.
    """
    raw = os.environ.get(POISON_ENV, "").strip()
    if not raw:
        return None
    value = int(raw, 0)
    if not 0 <= value <= 255:
        raise ValueError(f"{POISON_ENV}={raw!r} is not a byte (0-255)")
    return value


def graphs() -> ArenaPool | None:
    """This process's graph pool, once :func:`graph_pool` made it."""
    return _graphs


def graph_pool(original: Any, platform: Any, *args: Any, **kwargs: Any) -> Any:
    """``Platform.get_global_graph_pool``, hooked: the id of a ``torch.cuda.MemPool`` over gpusnap's arenas,
    made on the first call (and also stored where vLLM keeps its own, ``type(platform)._global_graph_pool``).
    Where arenas cannot back it (not CUDA, no virtual memory management, a torch without custom allocators,
    expandable segments), vLLM's own pool, with the reason in the log once."""
    global _graphs, _declined
    if _graphs is None and not _declined:
        why = _unsupported(platform)
        pool = ArenaPool("graphs", Policy.KEEP)
        if why is None:
            try:
                _probe(pool)
                mem = pool.mem_pool()
            except Exception as exc:  # noqa: BLE001 (vLLM then captures into its own pool, as without gpusnap)
                why = str(exc)
        if why is not None:
            _declined = True
            if why:
                log.warning("gpusnap: CUDA graphs keep torch's own pool (captured with the process): %s", why)
        else:
            _graphs = pool
            type(platform)._global_graph_pool = mem.id
            log.info("gpusnap: CUDA graphs are captured into address-stable arenas (pool %s)", mem.id)
    if _graphs is None:
        return original(platform, *args, **kwargs)
    return _graphs.mem_pool().id


def _unsupported(platform: Any) -> str | None:
    """Why the graph pool cannot be gpusnap's (``""``: not a CUDA platform, nothing to say), or ``None``."""
    if not _is_cuda(platform):
        return ""
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        return (
            "a memory pool with its own allocator does not work with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "(pytorch/pytorch#147851); leave expandable segments off to move the graph pool"
        )
    return None


def _is_cuda(platform: Any) -> bool:
    check = getattr(platform, "is_cuda", None)
    return bool(check()) if callable(check) else False


def _probe(pool: ArenaPool) -> None:
    """Make and give back one segment through the pool's C functions, as torch calls them, on the current device
    (fails where the GPU or driver lacks virtual memory management)."""
    import torch

    alloc, free = pool.function_pointers
    device, size = torch.cuda.current_device(), 2 << 20
    ptr = int(ALLOC_FN(alloc)(size, device, None) or 0)
    if not ptr:
        raise RuntimeError("the driver refused a 2 MiB arena (see the error above)")
    FREE_FN(free)(ptr, size, device, None)


def workspaces() -> list[Any]:
    """The tensors vLLM's ``WorkspaceManager`` holds (``vllm.v1.worker.workspace``; none where the release has
    no such module or the manager was never made)."""
    module = sys.modules.get("vllm.v1.worker.workspace")
    manager = getattr(module, "_manager", None)
    held = getattr(manager, "_current_workspaces", None) or []
    return [t for t in held if t is not None and hasattr(t, "untyped_storage")]


def move_before_capture(part: Any, device: int) -> None:
    """Move the worker's workspaces (SCRATCH) and then every other tensor it holds in torch's default pool
    (KEEP) into arenas, before ``capture_model`` captures graphs (``part``: the worker's
    :class:`~gpusnap.adapters.engines.vllm.processes.WorkerPart`)."""
    spaces = [t for t in workspaces() if vmm.movable(t)]
    if spaces:
        done = vmm.stabilize({f"workspace{i}": t for i, t in enumerate(spaces)})
        part.regions.add("workspaces", Policy.SCRATCH, done.arenas)
        log.info("gpusnap: %d workspace storages (%d bytes) moved into scratch arenas", done.moved, done.nbytes)
    state = default_pool_tensors(device)
    if state:
        done = vmm.stabilize(state)
        part.regions.add("state", Policy.KEEP, done.arenas)
        log.info(
            "gpusnap: %d persistent storages (%d bytes, %d tensors) moved into address-stable arenas",
            done.moved,
            done.nbytes,
            done.rebound,
        )


def repoint(runner: Any) -> None:
    """Rebuild the device tables in which vLLM keeps raw addresses of its buffers, after they moved.

    vLLM 0.26's V2 model runner keeps ``data_ptr()`` values of its block tables in device tensors
    (``BlockTables.block_table_ptrs`` and ``input_block_table_ptrs``, ``vllm/v1/worker/gpu/block_table.py``), which
    its Triton kernels (``_compute_slot_mappings_kernel``, the staged writes) follow. vLLM rebuilds them with
    ``init_block_table_layout_tensors()`` when its own buffers move (``post_kv_cache_wake_up`` after a CuMem
    wake-up); a move into arenas needs the same, or the next step reads the freed memory: an illegal memory
    access on the H200 (``bench/results/gpu-vllm-h200-8b-pools-*``, issue 29). A runner without such tables
    (vLLM's V1 runner, CPU) is left alone. Not rebuilt: ``PCPManager._local_block_table_ptrs`` (prefill context
    parallel only), which vLLM's own wake-up does not rebuild either."""
    refresh = getattr(getattr(runner, "block_tables", None), "init_block_table_layout_tensors", None)
    if callable(refresh):
        refresh()


def wrap_capture(runner: Any, part: Any) -> None:
    """Make ``runner.capture_model`` move the worker's buffers first (:func:`move_before_capture`) and then
    rebuild vLLM's tables of their addresses (:func:`repoint`); the instance attribute shadows the method for
    the runner's life. A runner without ``capture_model`` (CPU) is left alone."""
    original = getattr(runner, "capture_model", None)
    if original is None or getattr(original, "_gpusnap", False):
        return

    def capture_model(*args: Any, **kwargs: Any) -> Any:
        device = getattr(getattr(part.worker, "device", None), "index", None) or 0
        try:
            move_before_capture(part, device)
        except Exception:  # noqa: BLE001 (what did not move stays where it was: captured with the process)
            log.exception("gpusnap: moving the worker's buffers into arenas failed; the rest stay in place")
        repoint(runner)  # also after a move that stopped part-way: what moved until then has new addresses
        return original(*args, **kwargs)

    capture_model._gpusnap = True  # type: ignore[attr-defined]
    runner.capture_model = capture_model
