"""gpusnap's vLLM plugin: a gpusnap agent in every vLLM process, with no change to the engine or its command.

Installed with gpusnap, it is registered in the entry-point group ``vllm.general_plugins``, which vLLM
loads in each process it starts (``vllm/plugins/__init__.py``: ``load_general_plugins``, called from
``EngineArgs.__post_init__`` and ``AsyncEngineArgs.add_cli_args`` in the front end, ``EngineCore.__init__``
and ``WorkerWrapperBase.init_worker``). With ``GPUSNAP_AGENT_SOCKET`` unset, :func:`register` returns at
once and changes nothing. With it set, it:

1. blocks io_uring in the process and its future children (:func:`gpusnap.adapters.io_uring.block_io_uring`;
   the API server's uvloop would otherwise create one, which CRIU cannot dump);
2. applies the capture settings (``gpusnap.adapters.capture_settings``, the table preflight checks):
   the environment defaults at once, for this process and those it starts; and, once the engine's
   arguments are final (``EngineArgs.create_engine_config``), the tensor-parallel rows when
   ``tensor_parallel_size > 1`` (their variables, and engine arguments such as
   ``disable_custom_all_reduce``);
3. hooks where vLLM finishes building each part, and starts the process's one agent there, with a
   :class:`~gpusnap.adapters.vllm_process.VllmProcessAdapter`:

   - front end: the end of ``AsyncLLM.__init__`` (on the running event loop: ``vllm serve`` and user code
     alike) and of ``LLM.__init__`` (the agent's own loop);
   - EngineCore: ``EngineCoreProc.run_busy_loop`` (and the data-parallel subclasses'), entered once the
     executor and KV cache exist;
   - Worker process: ``WorkerProc.worker_busy_loop``, entered once the model is loaded; workers built in
     the EngineCore's own process (uniprocess executor) are found through ``WorkerWrapperBase.init_worker``.

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
from gpusnap.adapters.patching import before as _before
from gpusnap.adapters.patching import when_imported as _when_imported

log = logging.getLogger("gpusnap.vllm_plugin")


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


# -- the process's agent ----------------------------------------------------------------------------


def _process_adapter() -> Any:
    global _adapter
    if _adapter is None:
        from gpusnap.adapters.vllm_process import VllmProcessAdapter

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
    from gpusnap.adapters.capture_settings import engine_args
    from gpusnap.adapters.env import configure_capture_env

    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    if tp <= 1:
        return
    configure_capture_env(tensor_parallel=tp, engine="vllm")
    for field, flag in engine_args("vllm", tensor_parallel=tp).items():
        if hasattr(args, field) and not getattr(args, field):
            setattr(args, field, True)
            log.info("gpusnap: %s set for a capturable tensor-parallel engine", flag)


def _patch_engine_args(module: ModuleType) -> None:
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
    _after(module.AsyncLLM, "__init__", lambda engine: _on_engine(engine, is_async=True))


def _patch_llm(module: ModuleType) -> None:
    _after(module.LLM, "__init__", lambda engine: _on_engine(engine, is_async=False))


def _on_core(core: Any) -> None:
    _process_adapter().add_core(core)
    _start(None)


def _patch_core(module: ModuleType) -> None:
    base = module.EngineCoreProc
    for cls in [base, *_subclasses(module, base)]:
        if "run_busy_loop" in cls.__dict__:
            _before(cls, "run_busy_loop", _on_core)


def _on_worker_proc(proc: Any) -> None:
    inner = getattr(getattr(proc, "worker", None), "worker", None)
    if inner is not None:
        _process_adapter().add_worker(inner)
    _start(None)


def _patch_worker_proc(module: ModuleType) -> None:
    _before(module.WorkerProc, "worker_busy_loop", _on_worker_proc)


def _patch_worker_wrapper(module: ModuleType) -> None:
    def record(wrapper: Any) -> None:
        if getattr(wrapper, "worker", None) is not None:
            _process_adapter().add_worker(wrapper.worker)

    _after(module.WorkerWrapperBase, "init_worker", record)


def _subclasses(module: ModuleType, base: type) -> list[type]:
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, base) and v is not base]
