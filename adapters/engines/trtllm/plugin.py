"""gpusnap for TensorRT-LLM: one startup call gives the LLM API front end and every executor worker an agent.

TensorRT-LLM loads no third-party plugins (it has no entry-point group for them), so a program calls, first thing
(before it creates an event loop, since uvloop's loops hold an io_uring, and before it builds its ``LLM``)::

    import gpusnap.adapters.engines.trtllm.plugin as gpusnap_trtllm; gpusnap_trtllm.enable()

With ``GPUSNAP_AGENT_SOCKET`` unset it does nothing. With it set, it blocks io_uring in the process and its
children, applies the capture settings (``gpusnap.adapters.contract.capture_settings``), and patches two classes when
TensorRT-LLM imports them (:mod:`gpusnap.adapters.patching`):

- ``GenerationExecutorProxy.__init__`` (``tensorrt_llm/executor/proxy.py``) gets gpusnap's worker class,
  :class:`gpusnap.adapters.engines.trtllm.worker.GpusnapExecutorWorker`, as its ``worker_cls`` (the default
  ``GenerationExecutorWorker`` plus an agent), which ``worker_main`` builds in every executor worker process;
- after ``LLM.__init__`` (``tensorrt_llm/llmapi/llm.py``; the workers are up), the front end's agent
  (:class:`~gpusnap.adapters.engines.trtllm.processes.TrtLlmFrontEnd`) starts, on the running event loop if there is one
  (``AsyncLLM``, async user code), else on its own.

``trtllm-serve`` runs no user code before it builds its ``LLM``, so it is not covered. Standard library only
until TensorRT-LLM is imported.
"""

from __future__ import annotations

import asyncio
import logging
import os
from types import ModuleType
from typing import Any

from gpusnap.adapters.patching import activate, after, around, when_imported

log = logging.getLogger(__name__)


def enable() -> None:
    """See the module docstring; safe to call more than once."""
    if not activate("trtllm"):
        return
    when_imported("tensorrt_llm.executor.proxy", _patch_proxy)
    when_imported("tensorrt_llm.llmapi.llm", _patch_llm)


def _patch_proxy(module: ModuleType) -> None:
    from tensorrt_llm.executor.worker import GenerationExecutorWorker

    def init(original: Any, proxy: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = kwargs.get("worker_cls", GenerationExecutorWorker)
        if chosen is GenerationExecutorWorker:
            from gpusnap.adapters.engines.trtllm.worker import GpusnapExecutorWorker

            kwargs["worker_cls"] = GpusnapExecutorWorker
        else:
            log.warning("gpusnap: the executor proxy was given worker_cls=%s; its workers get no gpusnap agent", chosen)
        return original(proxy, *args, **kwargs)

    around(module.GenerationExecutorProxy, "__init__", init)


def _patch_llm(module: ModuleType) -> None:
    cls = next(c for c in module.LLM.__mro__ if "__init__" in c.__dict__)
    after(cls, "__init__", _on_llm)


def _on_llm(llm: Any) -> None:
    from gpusnap.adapters import agent
    from gpusnap.adapters.engines.trtllm.processes import TrtLlmFrontEnd, worker_pids

    if agent.current() is not None:
        return
    try:
        pids = worker_pids(llm)
    except Exception as exc:  # an executor without gpusnap's worker class: the workers keep their weights
        log.warning("gpusnap: could not ask the TensorRT-LLM executor workers for their PIDs: %s", exc)
        pids = []
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    end_id = getattr(getattr(llm, "tokenizer", None), "eos_token_id", None)
    agent.start_agent(TrtLlmFrontEnd(llm, [p for p in pids if p != os.getpid()], end_id=end_id), loop=loop)
    log.info("gpusnap: agent started in the TensorRT-LLM front end %s (workers %s)", os.getpid(), pids)
