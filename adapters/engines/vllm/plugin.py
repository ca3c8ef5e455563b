"""gpusnap's vLLM plugin: a gpusnap agent in every vLLM process, with no change to the engine or its command.

Installed with gpusnap, it is registered in the entry-point group ``vllm.general_plugins``, which vLLM
loads in each process it starts (``vllm/plugins/__init__.py``: ``load_general_plugins``, called from
``EngineArgs.__post_init__`` and ``AsyncEngineArgs.add_cli_args`` in the front end, ``EngineCore.__init__``
and ``WorkerWrapperBase.init_worker``). With ``GPUSNAP_AGENT_SOCKET`` unset, :func:`register` returns at
once and changes nothing. With it set, it:

1. blocks io_uring in the process and its future children (:func:`gpusnap.adapters.io_uring.block_io_uring`;
   the API server's uvloop would otherwise create one, which CRIU cannot dump);
2. applies the capture settings (``gpusnap.adapters.contract.capture_settings``, the table preflight checks):
   the environment defaults at once, for this process and those it starts; and, once the engine's
   arguments are final (``EngineArgs.create_engine_config``), the tensor-parallel rows when
   ``tensor_parallel_size > 1`` (their variables, and engine arguments such as
   ``disable_custom_all_reduce``);
3. hooks where vLLM finishes building each part, and starts the process's one agent there, with a
   :class:`~gpusnap.adapters.engines.vllm.processes.VllmProcessAdapter`:

   - front end: the end of ``AsyncLLM.__init__`` (on the running event loop: ``vllm serve`` and user code
     alike) and of ``LLM.__init__`` (the agent's own loop);
   - EngineCore: ``EngineCoreProc.run_busy_loop`` (and the data-parallel subclasses'), entered once the
     executor and KV cache exist;
   - Worker process: ``WorkerProc.worker_busy_loop``, entered once the model is loaded; workers built in
     the EngineCore's own process (uniprocess executor) are found through ``WorkerWrapperBase.init_worker``;
4. moves each worker's weights and KV cache into address-stable VMM arenas where vLLM builds them
   (``WorkerWrapperBase.initialize_from_config``: the weights once vLLM has profiled its memory, the KV cache
   as soon as the model runner's ``initialize_kv_cache`` allocated it), before vLLM captures its CUDA graphs,
   so a capture can take both out of the image and bring them back at the same addresses
   (:class:`~gpusnap.adapters.engines.vllm.processes.WorkerPart`); with ``GPUSNAP_VLLM_POOLS=1`` (off by
   default) the CUDA graph pool, persistent buffers and workspaces too (:mod:`~gpusnap.adapters.engines.vllm.pools`:
   ``Platform.get_global_graph_pool`` and the model runner's ``capture_model``);
5. gives the uniprocess executor (one GPU, the model inside ``VLLM::EngineCore``) a ``file://`` rendezvous
   where the release would make a ``tcp://`` one to the node's own address (vLLM ≤ 0.31; later releases do
   the same themselves): torch.distributed then holds no TCP connection a capture would have to carry, so
   the restored server comes up on another node, or in a private network namespace.

A hook this plugin needs that the vLLM release lacks stops vLLM at start-up with the version and the hook
named (:class:`~gpusnap.adapters.patching.HookMissing`), never later at capture. Supported: vLLM 0.26–0.34
(docs/engines.md).

Modules are patched when vLLM imports them (an import hook), so a process imports nothing of vLLM's on
gpusnap's account. The plugin itself imports only the standard library and gpusnap's adapters (protobuf).
"""

from __future__ import annotations

import asyncio
import logging
import os
from types import ModuleType
from typing import Any

from gpusnap.adapters.patching import activate
from gpusnap.adapters.patching import after as _after
from gpusnap.adapters.patching import around as _around
from gpusnap.adapters.patching import before as _before
from gpusnap.adapters.patching import guarded as _guarded
from gpusnap.adapters.patching import missing as _missing
from gpusnap.adapters.patching import require as _require
from gpusnap.adapters.patching import when_imported as _when_imported

log = logging.getLogger(__name__)


_adapter: Any = None  # VllmProcessAdapter, created on first use
_agent: Any = None  # WorkerAgent


def register() -> None:
    """The plugin's entry point (see the module docstring); safe to call more than once."""
    if not activate("vllm"):
        return
    _when_imported("vllm.engine.arg_utils", _patch_engine_args)
    _when_imported("vllm.v1.engine.async_llm", _patch_async_llm)
    _when_imported("vllm.entrypoints.llm", _patch_llm)
    _when_imported("vllm.v1.engine.core", _patch_core)
    _when_imported("vllm.v1.executor.multiproc_executor", _patch_worker_proc)
    _when_imported("vllm.v1.worker.worker_base", _patch_worker_wrapper)
    _when_imported("vllm.v1.executor.uniproc_executor", _patch_uniproc)
    from gpusnap.adapters.engines.vllm import pools

    if pools.enabled():
        _when_imported("vllm.platforms.interface", _patch_platform)


# -- the process's agent ----------------------------------------------------------------------------


def _process_adapter() -> Any:
    global _adapter
    if _adapter is None:
        from gpusnap.adapters.engines.vllm.processes import VllmProcessAdapter

        _adapter = VllmProcessAdapter()
    return _adapter


def _start(loop: asyncio.AbstractEventLoop | None) -> None:
    """Start this process's agent once (the first part to finish decides the event loop)."""
    global _agent
    if _agent is not None:
        return
    from gpusnap.adapters import agent

    if agent.current() is not None:
        log.warning("gpusnap: this process already runs a gpusnap agent; the vLLM plugin starts none")
        return
    _agent = agent.start_agent(_process_adapter(), loop=loop)
    log.info("gpusnap: agent started in %s (role %s)", os.getpid(), _process_adapter().role)


# -- patches ----------------------------------------------------------------------------------------


def _apply_tensor_parallel_settings(args: Any) -> None:
    from gpusnap.adapters.contract.capture_settings import engine_args
    from gpusnap.adapters.env import configure_capture_env

    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    if tp <= 1:
        return
    configure_capture_env(tensor_parallel=tp, engine="vllm")
    for field, flag in engine_args("vllm", tensor_parallel=tp).items():
        if hasattr(args, field) and not getattr(args, field):
            setattr(args, field, True)
            log.info("gpusnap: %s set for a capturable tensor-parallel engine", flag)


def _engine() -> str:
    """``"vLLM <version>"`` of the vLLM this process imported."""
    import sys

    return f"vLLM {getattr(sys.modules.get('vllm'), '__version__', '(unknown version)')}"


def _patch_engine_args(module: ModuleType) -> None:
    _require(module.EngineArgs, "create_engine_config", _engine())
    _before(module.EngineArgs, "create_engine_config", _apply_tensor_parallel_settings)


def _on_engine(engine: Any, *, is_async: bool) -> None:
    loop = None
    if is_async:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            log.warning("gpusnap: AsyncLLM was built outside a running event loop; no agent for it")
            return
    adapter = _process_adapter()
    adapter.add_engine(engine)
    _start(loop)


def _patch_async_llm(module: ModuleType) -> None:
    _require(module.AsyncLLM, "__init__", _engine())
    _after(module.AsyncLLM, "__init__", lambda engine: _on_engine(engine, is_async=True))


def _patch_llm(module: ModuleType) -> None:
    _require(module.LLM, "__init__", _engine())
    _after(module.LLM, "__init__", lambda engine: _on_engine(engine, is_async=False))


def _on_core(core: Any) -> None:
    _process_adapter().add_core(core)
    _start(None)


def _patch_core(module: ModuleType) -> None:
    base = module.EngineCoreProc
    _require(base, "run_busy_loop", _engine())
    for cls in [base, *_subclasses(module, base)]:
        if "run_busy_loop" in cls.__dict__:
            _before(cls, "run_busy_loop", _on_core)


def _on_worker_proc(proc: Any) -> None:
    inner = getattr(getattr(proc, "worker", None), "worker", None)
    if inner is not None:
        _process_adapter().add_worker(inner)
    _start(None)


def _patch_worker_proc(module: ModuleType) -> None:
    _require(module.WorkerProc, "worker_busy_loop", _engine())
    _before(module.WorkerProc, "worker_busy_loop", _on_worker_proc)


def _patch_worker_wrapper(module: ModuleType) -> None:
    def record(wrapper: Any) -> None:
        if getattr(wrapper, "worker", None) is not None:
            _process_adapter().add_worker(wrapper.worker)

    for name in ("init_worker", "initialize_from_config"):
        _require(module.WorkerWrapperBase, name, _engine())
    _after(module.WorkerWrapperBase, "init_worker", record)
    _around(module.WorkerWrapperBase, "initialize_from_config", _initialize_from_config)


def _initialize_from_config(original: Any, wrapper: Any, *args: Any, **kwargs: Any) -> Any:
    """``WorkerWrapperBase.initialize_from_config`` (vLLM has profiled its memory; it now allocates the KV
    cache, then warms up and captures CUDA graphs): the weights move into arenas first, the KV cache right
    after the model runner allocated it, before anything records its addresses."""
    worker = getattr(wrapper, "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return original(wrapper, *args, **kwargs)
    part = _process_adapter().add_worker(worker)
    allocate = getattr(runner, "initialize_kv_cache", None)
    if allocate is None:
        raise _missing(f"{type(runner).__module__}.{type(runner).__qualname__}.initialize_kv_cache", _engine())
    _guarded("move the weights into address-stable arenas", part.stabilize_weights)

    def initialize_kv_cache(*a: Any, **kw: Any) -> Any:
        result = allocate(*a, **kw)
        _guarded("move the KV cache into address-stable arenas", part.stabilize_kv)
        return result

    runner.initialize_kv_cache = initialize_kv_cache  # this call only: the instance attribute shadows the method
    try:
        result = original(wrapper, *args, **kwargs)
    finally:
        del runner.initialize_kv_cache
    from gpusnap.adapters.engines.vllm import pools

    if pools.enabled() and part.stable:
        pools.wrap_capture(runner, part)
    return result


def _patch_platform(module: ModuleType) -> None:
    """``GPUSNAP_VLLM_POOLS=1``: vLLM's one CUDA graph pool comes from gpusnap's arenas (``pools.graph_pool``)."""
    from gpusnap.adapters.engines.vllm import pools

    _require(module.Platform, "get_global_graph_pool", _engine())
    _around(module.Platform, "get_global_graph_pool", pools.graph_pool)


def _patch_uniproc(module: ModuleType) -> None:
    """vLLM ≤ 0.31's uniprocess executor rendezvouses over ``tcp://<node address>:<port>`` (a TCPStore whose
    server and client are both in the EngineCore: an established TCP connection to the node's own address);
    later releases use a ``file://`` store (vLLM PR #50999). Give the old ones the file store too."""
    cls = getattr(module, "UniProcExecutor", None)
    if cls is None or "_distributed_args" not in cls.__dict__:
        return  # a release that rendezvouses otherwise

    def distributed_args(original: Any, executor: Any, *args: Any, **kwargs: Any) -> Any:
        method, rank, local_rank = original(executor, *args, **kwargs)
        if isinstance(method, str) and method.startswith("tcp://"):
            import tempfile
            import uuid

            method = f"file://{tempfile.gettempdir()}/gpusnap_dist_{uuid.uuid4().hex}"
            log.info("gpusnap: torch.distributed rendezvous through %s (no TCP connection in the image)", method)
        return method, rank, local_rank

    _around(cls, "_distributed_args", distributed_args)


def _subclasses(module: ModuleType, base: type) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, base) and v is not base]
