"""The adapters of TensorRT-LLM's processes: the LLM API front end and each executor worker.

TensorRT-LLM's layout (PyTorch backend; ``tensorrt_llm/executor/proxy.py``, ``executor/worker.py``; docs/engines.md):
the ``LLM`` in your process builds a ``GenerationExecutorProxy``, which starts the executor workers through an
MPI session (``MpiPoolSession(n_workers=world_size)``, mpi4py's pool; ``MpiCommSession`` under ``mpirun`` /
``trtllm-llmapi-launch``) and runs ``worker_main`` in each rank. ``worker_main`` builds the worker class it is
given (``worker_cls``, default ``GenerationExecutorWorker``); the worker's ``engine`` is the ``PyExecutor``
that holds the model and its KV cache. Requests and results travel over ZMQ IPC queues.

- **front end** (:class:`TrtLlmFrontEnd`): warm-up, then the KV release through the engine's own API
  (``LLM.release(["kv_cache"])`` in 1.4, else ``_collective_rpc("sleep", …)``: ``BaseWorker.sleep`` in every
  rank, inside ``PyExecutor.control_action()``); resume re-materialises it, last. Its hello names the
  executor worker processes (``expect_pids``, from each worker's ``gpusnap_process`` over
  ``_collective_rpc``), each of which must have an agent. Under MPI, TensorRT-LLM sleeps only at
  ``world_size == 1`` (``BaseWorker._check_sleep_supported``; more ranks need the Ray orchestrator).
- **executor worker** (:class:`TrtLlmWorkerAdapter`): checks at quiesce that its executor holds no request,
  and names the model's weights as buffers (:func:`gpusnap.adapters.engine_process.graph_plan`: not while
  CUDA graphs read them, i.e. unless ``cuda_graph_config=None``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gpusnap.adapters.base import HelloFacts
from gpusnap.adapters.engine_process import ModelProcessAdapter, process_title
from gpusnap.adapters.engines.trtllm.adapter import TrtLlmAdapter

PID_METHOD = "gpusnap_process"
"""The method of gpusnap's worker class that answers its PID (``gpusnap.adapters.engines.trtllm.worker``)."""


class TrtLlmFrontEnd(TrtLlmAdapter):
    """The front end's adapter: :class:`TrtLlmAdapter`, naming the executor worker processes.

    Args:
        llm: the ``LLM`` / ``AsyncLLM``.
        worker_pids: the executor workers' PIDs (see :func:`worker_pids`).
    """

    def __init__(self, llm: Any, worker_pids: Sequence[int], **kwargs: Any):
        super().__init__(llm, **kwargs)
        self.worker_pids = sorted(set(worker_pids))

    def info(self) -> HelloFacts:
        return dataclasses.replace(
            super().info(), role="frontend", process=process_title(), expect_pids=tuple(self.worker_pids)
        )


def worker_pids(llm: Any) -> list[int]:
    """Each executor worker's PID, asked over ``LLM._collective_rpc`` (``[]`` in-process,
    ``TLLM_WORKER_USE_SINGLE_PROCESS=1``, where the worker is this process)."""
    answers = llm._collective_rpc(PID_METHOD, args=(), kwargs={}, non_block=False)
    return [int(p) for p in answers or [] if p]


class TrtLlmWorkerAdapter(ModelProcessAdapter):
    """The adapter of one executor worker process.

    Args:
        worker: the ``GenerationExecutorWorker`` (``engine`` the ``PyExecutor``, ``llm_args``, ``rank``).
    """

    engine = "trtllm"
    remedy = "build the LLM with cuda_graph_config=None to offload them"

    def __init__(self, worker: Any):
        self.worker = worker

    @property
    def rank(self) -> str:
        return f"rank{int(getattr(self.worker, 'rank', 0))}"

    @property
    def model(self) -> Any:
        return self.worker.engine.model_engine.model

    def graphs(self) -> bool:
        return getattr(getattr(self.worker, "llm_args", None), "cuda_graph_config", None) is not None

    async def quiesce(self) -> None:
        """Refuse while the executor still holds requests (the front end's release drains them first)."""
        active = len(getattr(self.worker.engine, "active_requests", ()) or ())
        if active:
            raise RuntimeError(f"TensorRT-LLM executor {self.rank} still holds {active} requests after the KV release")
