"""gpusnap's executor worker class for TensorRT-LLM: ``GenerationExecutorWorker`` plus a gpusnap agent.

:func:`gpusnap.adapters.engines.trtllm.plugin.enable` hands this class to ``GenerationExecutorProxy`` as its
``worker_cls``, which the proxy passes to ``worker_main`` in every executor worker process (by reference:
this module is imported there, and only there, so it may import TensorRT-LLM at the top).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from tensorrt_llm.executor.worker import GenerationExecutorWorker

from gpusnap.adapters.patching import guarded

log = logging.getLogger(__name__)


class GpusnapExecutorWorker(GenerationExecutorWorker):  # type: ignore[misc]
    """``GenerationExecutorWorker`` that starts this process's gpusnap agent once it is built."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        guarded("attach to the TensorRT-LLM executor worker", self._gpusnap_start)

    def _gpusnap_start(self) -> None:
        if not os.environ.get("GPUSNAP_AGENT_SOCKET"):
            return
        from gpusnap.adapters import agent
        from gpusnap.adapters.engines.trtllm.processes import TrtLlmWorkerAdapter

        if agent.current() is None:
            agent.start_agent(TrtLlmWorkerAdapter(self))
            log.info("gpusnap: agent started in executor worker %s", os.getpid())

    def gpusnap_process(self) -> int:
        """This worker's PID (asked by the front end over ``_collective_rpc``)."""
        return os.getpid()
