"""VllmProcessAdapter: the adapter of one vLLM process, whatever it holds (front end, EngineCore, Workers).

gpusnap's vLLM plugin (``gpusnap.adapters.engines.vllm.plugin``) starts one agent per vLLM process with this
adapter. What each process does at capture (vLLM 0.32–0.33 layout: docs/engines.md, "vLLM"):

- **front end** (``AsyncLLM`` or ``LLM``; the API server under ``vllm serve``): warm-up, then quiesce and
  resume through :class:`~gpusnap.adapters.engines.vllm.adapter.VllmAdapter` (``pause_generation`` … ``resume_generation``);
  its canary is the snapshot's.
- **EngineCore** (``VLLM::EngineCore``, one per data-parallel rank): checks at quiesce that its scheduler
  holds no request (the front end's pause aborted them), so no step can run while the workers are out.
- **Worker** (``VLLM::Worker``, one per TP×PP rank; or inside the EngineCore with the uniprocess executor):
  names the model's weights as buffers, which the daemon keeps in its buffer store, and releases the KV
  cache where no CUDA graph holds its address (see :func:`memory_plan`); resume re-creates the KV cache,
  after the daemon has read the weights back.

Processes that hold several of these (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) do all of their parts. The
hello's ``info`` carries ``role`` (``frontend``, ``core`` or ``worker``; the daemon quiesces front ends
first and resumes them last), ``expect_pids`` (the engine processes this one started, each of which must
have an agent of its own), and ``weights`` (where the weights go, and why).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from gpusnap.adapters import zeroed
from gpusnap.adapters.base import EngineAdapter, HelloFacts, RestoreContext
from gpusnap.adapters.engine_process import MemoryPlan, model_weights, process_title
from gpusnap.adapters.engines.vllm.adapter import Release, VllmAdapter
from gpusnap.adapters.vmm_pool import Policy, Regions

log = logging.getLogger(__name__)


def memory_plan(vllm_config: Any, device_type: str, *, stable: bool = False) -> MemoryPlan:
    """Decide where a worker's weights and KV cache go during a capture.

    - Address-stable (``stable``: the plugin moved the weights and the KV cache into VMM arenas when vLLM
      built them, :meth:`WorkerPart.stabilize_weights` and :meth:`WorkerPart.stabilize_kv`): weights to the
      buffer store, KV cache released, both back at the same addresses, so CUDA graphs captured at start
      replay as they were (and gpusnapd's ``--gpu-prefill`` can fill the weights' memory).
    - CPU: weights to the buffer store, KV cache freed (no graph holds their addresses).
    - CUDA without CUDA graphs (``--enforce-eager``): the same; storages come back at new addresses, which
      eager kernels read at each call.
    - CUDA with CUDA graphs and no arenas (the GPU or driver lacks virtual memory management, or moving
      failed at start): graphs captured at start read both at their addresses, so both stay in the image
      (the CUDA checkpoint copies them) rather than the capture being refused.
    """
    if stable:
        return MemoryPlan(True, True, "offloaded: weights and KV cache in address-stable arenas (CUDA graphs intact)")
    if device_type != "cuda":
        return MemoryPlan(True, True, f"offloaded: {device_type} worker, no CUDA graphs")
    if not graphs_captured(vllm_config):
        return MemoryPlan(True, True, "offloaded: no CUDA graphs (--enforce-eager)")
    return MemoryPlan(
        False,
        False,
        "in image: CUDA graphs captured at start read the weights and KV cache at their addresses, and "
        "they could not be moved into address-stable arenas (see the worker's log)",
    )


def graphs_captured(vllm_config: Any) -> bool:
    """Whether vLLM captures CUDA graphs with this config (not ``--enforce-eager``, a cudagraph mode)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    mode = getattr(getattr(compilation, "cudagraph_mode", None), "name", "NONE")
    eager = bool(getattr(getattr(vllm_config, "model_config", None), "enforce_eager", False))
    return not eager and mode != "NONE"


def _storages(tensors: Iterable[Any]) -> list[Any]:
    """Distinct non-empty storages behind ``tensors`` (nested lists and tuples are walked)."""
    seen: dict[tuple[str, int], Any] = {}
    stack = list(tensors)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
            continue
        if item is None or not hasattr(item, "untyped_storage"):
            continue
        storage = item.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault((str(storage.device), storage.data_ptr()), storage)
    return list(seen.values())


def kv_tensors(worker: Any) -> list[Any]:
    """The tensors over a worker's KV cache: the model runner's ``kv_caches`` and each attention layer's
    ``kv_cache`` in the compilation config's static forward context (every vLLM release since 0.8 binds
    them there, ``bind_kv_cache``), nested lists flattened."""
    runner = worker.model_runner
    found: list[Any] = [getattr(runner, "kv_caches", [])]
    context = getattr(getattr(worker.vllm_config, "compilation_config", None), "static_forward_context", {}) or {}
    found.extend(getattr(layer, "kv_cache", None) for layer in context.values())
    flat: list[Any] = []
    stack = list(found)
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif item is not None and hasattr(item, "untyped_storage"):
            flat.append(item)
    return flat


class WorkerPart:
    """One vLLM ``Worker`` object in this process: its weights and KV cache.

    Args:
        worker: a ``vllm.v1.worker`` worker (``model_runner.get_model()``, ``model_runner.kv_caches``).
    """

    def __init__(self, worker: Any):
        self.worker = worker
        self._kv: list[tuple[Any, int]] = []
        self.weights_arenas: list[Any] = []
        """VMM arenas the weights were moved into at start (:meth:`stabilize_weights`); empty: not moved."""
        self.kv_arenas: list[Any] = []
        """VMM arenas the KV cache was moved into at start (:meth:`stabilize_kv`); empty: not moved."""
        self._kv_released = False
        self.regions = Regions()
        """The rest of its device memory in arenas, with ``GPUSNAP_VLLM_POOLS=1`` (``pools.py``): the CUDA graph
        pool, persistent buffers, workspaces."""

    @property
    def rank(self) -> int:
        return int(getattr(self.worker, "rank", 0))

    @property
    def stable(self) -> bool:
        """Weights and KV cache both live in address-stable arenas."""
        return bool(self.weights_arenas) and bool(self.kv_arenas)

    def plan(self) -> MemoryPlan:
        plan = memory_plan(getattr(self.worker, "vllm_config", None), self._device_type(), stable=self.stable)
        held = [r.name for r in self.pools() if r.arenas()]
        if self.stable and held:
            return MemoryPlan(plan.offload_weights, plan.release_kv, f"{plan.why}; also in arenas: {', '.join(held)}")
        return plan

    def pools(self) -> Regions:
        """:attr:`regions`, with the process's graph pool once vLLM asked for it (``pools.graph_pool``)."""
        from gpusnap.adapters.engines.vllm import pools

        graphs = pools.graphs()
        if graphs is not None and "graphs" not in {r.name for r in self.regions}:
            self.regions.add("graphs", Policy.KEEP, graphs)
        return self.regions

    def pool_buffers(self) -> dict[str, Any]:
        """The KEEP arenas (graph pool segments, persistent buffers) as buffers, one each; only where the
        weights and KV cache are address-stable too (otherwise the CUDA checkpoint carries it all)."""
        return self.pools().buffers(f"rank{self.rank}") if self.stable else {}

    def release_scratch(self) -> int:
        """Release the SCRATCH arenas (workspaces; bytes not saved); returns the bytes released."""
        if not self.regions.scratch():
            return 0
        _synchronize(self._device_type())
        return self.regions.release_scratch()

    def remap_scratch(self) -> None:
        """Map the released SCRATCH arenas again (``GPUSNAP_SCRATCH_POISON``: filled with that byte)."""
        from gpusnap.adapters.engines.vllm import pools

        self.regions.remap_scratch(pools.poison())

    def _device_type(self) -> str:
        device = getattr(self.worker, "device", None)
        return str(getattr(device, "type", device or "cpu"))

    def weights(self) -> dict[str, Any]:
        """The model's parameters (name → tensor), prefixed with the worker's rank; empty ones left out
        (vLLM's CPU GEMM dispatch empties linear weights it moved into oneDNN or packed kernels). Under CUDA
        graphs only address-stable ones are named: any other would come back elsewhere."""
        model = self.worker.model_runner.get_model()
        named = model_weights(model, f"rank{self.rank}")
        if self.stable:
            from gpusnap.adapters import vmm

            named = {n: t for n, t in named.items() if vmm.is_stable(t)}
        return named

    def stabilize_weights(self) -> None:
        """Move the model's weights into VMM arenas (:func:`gpusnap.adapters.vmm.stabilize`), once vLLM has
        profiled its memory (moved weights would count twice there) and before it allocates the KV cache and
        captures its CUDA graphs. Only where arenas hold device memory: CUDA workers, or a process whose VMM
        driver provides host memory (the CPU tests' fake)."""
        if not _arenas_available(self._device_type()):
            return
        from gpusnap.adapters import vmm

        model = self.worker.model_runner.get_model()
        done = vmm.stabilize(model_weights(model, f"rank{self.rank}"))
        self.weights_arenas = done.arenas
        log.info(
            "gpusnap: worker rank %d moved %d weight storages (%d bytes, %d tensors) into address-stable arenas",
            self.rank,
            done.moved,
            done.nbytes,
            done.rebound,
        )

    def stabilize_kv(self) -> None:
        """Move the KV cache vLLM just allocated into VMM arenas of its own (released at capture, not saved)."""
        if not self.weights_arenas:
            return
        from gpusnap.adapters import vmm

        tensors = kv_tensors(self.worker)
        done = vmm.stabilize({f"kv{i}": t for i, t in enumerate(tensors)})
        self.kv_arenas = done.arenas
        log.info(
            "gpusnap: worker rank %d moved its KV cache (%d storages, %d bytes, %d tensors) into address-stable arenas",
            self.rank,
            done.moved,
            done.nbytes,
            done.rebound,
        )

    def release_kv(self) -> int:
        """Free the KV cache's memory (its contents are discardable: the front end's pause aborted every
        request and reset the prefix cache); returns the bytes freed. Arenas are released with their
        addresses kept; host memory is discarded in place (:func:`gpusnap.adapters.zeroed.discard`: it then
        reads as zero, as vLLM allocated it, without being written again); other storages are resized to 0
        bytes."""
        if self.kv_arenas:
            _synchronize(self._device_type())
            for arena in self.kv_arenas:
                arena.release()
            self._kv_released = True
            _empty_cache(self._device_type())
            return sum(a.size for a in self.kv_arenas)
        storages = _storages(getattr(self.worker.model_runner, "kv_caches", []))
        if storages and all(s.device.type == "cpu" for s in storages):
            try:
                return zeroed.discard([(s.data_ptr(), s.nbytes()) for s in storages])
            except zeroed.NotAnonymous as exc:
                log.warning("gpusnap: the KV cache is freed, and zeroed again at resume: %s", exc)
        self._kv = [(s, s.nbytes()) for s in storages]
        for storage, _ in self._kv:
            storage.resize_(0)
        return sum(n for _, n in self._kv)

    def recreate_kv(self) -> None:
        """Back the KV cache with memory again, zero-filled: the same arenas at the same addresses (zeroed
        on the device: fresh device memory holds any bytes), or the same storages (new addresses). A
        discarded host KV cache needs nothing: its pages come back zero-filled when first touched
        (docs/engines.md, "The KV cache at resume")."""
        import torch

        if self._kv_released:
            for arena in self.kv_arenas:
                arena.remap()
                arena.bytes_tensor(arena.ptr, arena.size).zero_()
            self._kv_released = False
            return
        for storage, nbytes in self._kv:
            storage.resize_(nbytes)
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).zero_()
        self._kv = []


def _arenas_available(device_type: str) -> bool:
    """Whether VMM arenas hold this worker's memory: on CUDA, or where the process's VMM driver gives host
    memory (a driver object with ``bytes_tensor``, installed with ``vmm.set_default_driver``)."""
    from gpusnap.adapters import vmm

    if device_type == "cuda":
        return True
    return getattr(vmm.installed_driver(), "bytes_tensor", None) is not None


def _synchronize(device_type: str) -> None:
    if device_type == "cuda":
        import torch

        torch.cuda.synchronize()


def _empty_cache(device_type: str) -> None:
    """Give torch's cached, unused device blocks back to the driver, so the CUDA checkpoint does not copy
    them (CUDA graph pools are not touched)."""
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


class VllmProcessAdapter(EngineAdapter):
    """The adapter of one vLLM process (see the module docstring); parts are added as vLLM builds them.

    Args:
        release: what the front end's quiesce frees (``VllmAdapter``'s ``release``).
    """

    engine = "vllm"

    def __init__(self, *, release: Release = "none"):
        self.release = release
        self.front: VllmAdapter | None = None
        self.core: Any = None
        self.workers: list[WorkerPart] = []
        self.expect_pids: list[int] = []
        self._released_kv: list[WorkerPart] = []
        self._released_bytes = 0

    # -- parts ------------------------------------------------------------------------------------

    def add_engine(self, engine: Any) -> None:
        """The front end: an ``AsyncLLM`` or ``LLM``; the engine processes it started must have agents."""
        config = getattr(engine, "vllm_config", None) or getattr(
            getattr(engine, "llm_engine", None), "vllm_config", None
        )
        dp = getattr(getattr(config, "parallel_config", None), "data_parallel_size", 1)
        sleep_mode = bool(getattr(getattr(config, "model_config", None), "enable_sleep_mode", False))
        # Sleep mode frees the KV cache at the same addresses (vLLM's CuMem allocator), graphs or not.
        self.front = VllmAdapter(engine, data_parallel_size=int(dp or 1), release="kv" if sleep_mode else self.release)
        self.expect_pids.extend(_engine_core_pids(engine))

    def add_core(self, core: Any) -> None:
        """An EngineCore (``EngineCoreProc``); the worker processes of its executor must have agents."""
        self.core = core
        self.expect_pids.extend(_worker_pids(getattr(core, "model_executor", None)))

    def add_worker(self, worker: Any) -> WorkerPart:
        """A vLLM worker living in this process; returns its part (the same one for the same worker)."""
        for part in self.workers:
            if part.worker is worker:
                return part
        part = WorkerPart(worker)
        self.workers.append(part)
        return part

    @property
    def role(self) -> str:
        return "frontend" if self.front else "core" if self.core is not None else "worker"

    def info(self) -> HelloFacts:
        return HelloFacts(
            role=self.role,
            process=_title(),
            expect_pids=tuple(sorted(set(self.expect_pids))),
            weights="; ".join(sorted({w.plan().why for w in self.workers})),
            info=self.front.info().info if self.front else {},
        )

    # -- EngineAdapter ----------------------------------------------------------------------------

    async def warm_up(self) -> list[int]:
        return await self.front.warm_up() if self.front else []

    async def quiesce(self) -> None:
        if self.front:
            await self.front.quiesce()
        self._released_bytes = 0
        try:
            if self.core is not None:
                _check_idle(self.core)
            for part in self.workers:
                if part.plan().release_kv:
                    freed = part.release_kv()
                    self._released_kv.append(part)
                    scratch = part.release_scratch()
                    self._released_bytes += freed + scratch
                    log.info(
                        "gpusnap: worker rank %d released %d bytes of KV cache, %d of scratch",
                        part.rank,
                        freed,
                        scratch,
                    )
        except BaseException:
            self._recreate_kv()
            if self.front:
                await self.front.resume(None)
            raise

    def buffers(self) -> Mapping[str, Any]:
        named: dict[str, Any] = {}
        for part in self.workers:
            if part.plan().offload_weights:
                named.update(part.weights())
                named.update(part.pool_buffers())
        return named

    async def resume(self, context: RestoreContext | None) -> None:
        self._recreate_kv()
        if self.front:
            await self.front.resume(context)

    async def health(self) -> list[int]:
        return await self.front.health() if self.front else []

    def released_bytes(self) -> int:
        return self._released_bytes

    def _recreate_kv(self) -> None:
        while self._released_kv:
            part = self._released_kv.pop()
            part.remap_scratch()
            part.recreate_kv()


def _check_idle(core: Any) -> None:
    scheduler = getattr(core, "scheduler", None)
    count = getattr(scheduler, "get_num_unfinished_requests", None)
    pending = int(count()) if callable(count) else 0
    if pending:
        raise RuntimeError(f"the EngineCore still holds {pending} unfinished requests after the front end's pause")


def _engine_core_pids(engine: Any) -> list[int]:
    """PIDs of the EngineCore processes an ``AsyncLLM`` / ``LLM`` started (none when in-process)."""
    client = getattr(engine, "engine_core", None) or getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return [int(p.pid) for p in getattr(manager, "processes", []) if getattr(p, "pid", None)]


def _worker_pids(executor: Any) -> list[int]:
    """PIDs of a ``MultiprocExecutor``'s worker processes (none for the uniprocess executor)."""
    return [
        int(h.proc.pid)
        for h in getattr(executor, "workers", None) or []
        if getattr(getattr(h, "proc", None), "pid", None)
    ]


def _title() -> str:
    """The process's title as vLLM set it (``VLLM::Worker_TP0``…), else its command name."""
    return process_title()
