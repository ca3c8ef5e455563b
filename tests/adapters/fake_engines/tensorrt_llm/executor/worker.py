"""``tensorrt_llm/executor/worker.py``: ``GenerationExecutorWorker`` (a ``BaseWorker``) and ``worker_main``.

The worker's ``engine`` is the ``PyExecutor`` (``model_engine.model``, the KV cache manager,
``active_requests``); ``sleep(sleep_tags)`` / ``wakeup(wakeup_tags)`` as ``BaseWorker``'s: sleep must be
configured (``llm_args.sleep_config``), tags are checked, and the work runs inside the executor's
``control_action()`` (drained, paused). Fake-only knob: ``FAKE_TRTLLM_WORKER_UNSET=NAME`` removes the
variable ``NAME`` in the worker process before its worker class is built.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

MEMORY_TAGS = ("model", "model_weights", "kv_cache", "executor_extra", "model_extra", "sampler")


class ModelEngine:
    def __init__(self, seed: int):
        from fake_lm import TinyLM

        self.model = TinyLM(seed)


class PyExecutor:
    def __init__(self, seed: int):
        from fake_lm import KvCache

        self.model_engine = ModelEngine(seed)
        self.kv_cache_manager = KvCache()
        self.active_requests: list[Any] = []
        self.paused = False

    @contextlib.contextmanager
    def control_action(self) -> Iterator[None]:
        assert not self.active_requests, "control_action drains in-flight requests first"
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        model, kv = self.model_engine.model, self.kv_cache_manager
        self.active_requests.append(prompt)
        try:
            tokens = [kv.prefill(model, prompt)[1]]
            while len(tokens) < max_tokens:
                tokens.append(kv.decode(model, tokens[-1])[1])
        finally:
            self.active_requests.remove(prompt)
        return tokens


class GenerationExecutorWorker:
    def __init__(
        self,
        engine: Any,
        executor_config: Any = None,
        batched_logits_processor: Any = None,
        postproc_worker_config: Any = None,
        is_llm_executor: bool | None = None,
        hf_model_dir: Any = None,
        tokenizer: Any = None,
        llm_args: Any = None,
    ):
        import torch

        torch.set_num_threads(1)
        self.rank = 0
        self.llm_args = llm_args
        self.engine = PyExecutor(getattr(llm_args, "seed", 0))

    def _check_sleep(self, tags: list[str]) -> list[str]:
        if self.llm_args is None or self.llm_args.sleep_config is None:
            raise ValueError("Sleep feature is not enabled, please set sleep_config in the LLM arguments.")
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"Unknown memory tag '{unknown[0]}'.")
        return tags

    def sleep(self, sleep_tags: list[str]) -> None:
        tags = self._check_sleep(sleep_tags)
        with self.engine.control_action():
            if "kv_cache" in tags:
                self.engine.kv_cache_manager.release()

    def wakeup(self, wakeup_tags: list[str]) -> None:
        tags = self._check_sleep(wakeup_tags)
        with self.engine.control_action():
            if "kv_cache" in tags:
                if not self.engine.kv_cache_manager.released:
                    raise RuntimeError("materialize_with_tag: memory tagged 'kv_cache' is not released")
                self.engine.kv_cache_manager.recreate()


def worker_main(
    engine: Any,
    worker_queues: Any,
    log_level: str,
    executor_config: Any = None,
    batched_logits_processor: Any = None,
    worker_cls: type = GenerationExecutorWorker,
    tracer_init_kwargs: dict[str, Any] | None = None,
    _torch_model_class_mapping: dict[str, Any] | None = None,
    postproc_worker_config: Any = None,
    ready_signal: bytes | None = None,
    is_llm_executor: bool | None = True,
    hf_model_dir: Any = None,
    tokenizer: Any = None,
    llm_args: Any = None,
    rpc_addr: str | None = None,
    hmac_key: bytes | None = None,
) -> None:
    unset = os.environ.get("FAKE_TRTLLM_WORKER_UNSET")
    if unset:
        os.environ.pop(unset, None)
    conn = worker_queues
    worker = worker_cls(engine, executor_config, llm_args=llm_args)
    conn.send(ready_signal)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        try:
            if msg[0] == "generate":
                value = worker.engine.generate(msg[1], msg[2])
            else:
                value = getattr(worker, msg[1])(*msg[2], **msg[3])
            conn.send(("ok", value))
        except Exception as exc:
            traceback.print_exc()
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
