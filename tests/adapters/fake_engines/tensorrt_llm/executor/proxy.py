"""``tensorrt_llm/executor/proxy.py``: ``GenerationExecutorProxy`` starts the executor workers.

Signature as upstream: ``(worker_kwargs, model_world_size=1, mpi_session=None, *, worker_cls=
GenerationExecutorWorker, postproc_worker_config=None, is_llm_executor=None)``; it runs ``worker_main(
**worker_kwargs, worker_queues=…, log_level=…, worker_cls=self.worker_cls, ready_signal=READY)`` in
``model_world_size`` processes and waits for their ready signal. Upstream starts them through an MPI pool
(``MpiPoolSession``, mpi4py) and talks over ZMQ IPC queues; the fake spawns them with ``multiprocessing``
and talks over pipes. The fake serves ``model_world_size == 1`` only (as TensorRT-LLM's sleep under MPI).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

from tensorrt_llm.executor.worker import GenerationExecutorWorker, worker_main


class GenerationExecutorProxy:
    READY_SIGNAL = b"READY"

    def __init__(
        self,
        worker_kwargs: dict[str, Any],
        model_world_size: int = 1,
        mpi_session: Any = None,
        *,
        worker_cls: type = GenerationExecutorWorker,
        postproc_worker_config: Any = None,
        is_llm_executor: bool | None = None,
    ):
        if model_world_size != 1:
            raise NotImplementedError("the fake TensorRT-LLM runs one executor worker")
        self.worker_cls = worker_cls
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self.workers = [
            ctx.Process(
                target=worker_main,
                kwargs=dict(
                    **worker_kwargs,
                    worker_queues=theirs,
                    log_level="error",
                    worker_cls=worker_cls,
                    ready_signal=self.READY_SIGNAL,
                ),
            )
        ]
        for proc in self.workers:
            proc.start()
        theirs.close()
        if not self._conn.poll(300) or self._conn.recv() != self.READY_SIGNAL:
            raise RuntimeError("Executor worker died during initialization")

    def _call(self, *msg: Any) -> Any:
        with self._lock:
            self._conn.send(msg)
            status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self._call("generate", prompt, max_tokens)  # type: ignore[no-any-return]

    def collective_rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        return [self._call("rpc", method, args, kwargs)]

    def shutdown(self) -> None:
        self._conn.close()
