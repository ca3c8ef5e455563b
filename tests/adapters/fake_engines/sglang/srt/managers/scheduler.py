"""``sglang/srt/managers/scheduler.py``: one scheduler process per TP rank, holding the model and the KV cache.

``run_scheduler_process`` has SGLang's parameters, loads the plugins first, titles the process as
``configure_scheduler_process`` does (``sglang::scheduler``, plus ``_DP<d>`` and ``_TP<r>`` when those
sizes exceed 1), dies with its parent, sends its init info down ``pipe_writer`` and runs the event loop.
``Scheduler.release_memory_occupation`` / ``resume_memory_occupation`` follow
``scheduler_update_weights_mixin.py``: assert idle, record ``offload_tags``, pause or resume the
``torch_memory_saver`` regions (here: free or re-allocate the KV cache tensor).

Fake-only knob: ``FAKE_SGLANG_NO_PLUGINS_TP=<r>`` makes rank ``r`` skip ``load_plugins`` (a process where
gpusnap's plugin did not load).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.managers.io_struct import (
    FlushCacheReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
)
from sglang.srt.plugins import load_plugins


class ModelRunner:
    def __init__(self, seed: int, tp_rank: int, tp_size: int):
        from fake_lm import KvCache, TinyLM

        self.model = TinyLM(seed, tp_rank, tp_size)
        self.token_to_kv_pool = KvCache()
        self.device = "cpu"


class TpModelWorker:
    def __init__(self, server_args: Any, tp_rank: int):
        self.model_runner = ModelRunner(server_args.random_seed, tp_rank, server_args.tp_size)


class MemorySaverAdapter:
    """``TorchMemorySaverAdapter``: ``pause(tag)`` / ``resume(tag)`` of a region (KV cache only here)."""

    def __init__(self, model_runner: ModelRunner, enabled: bool):
        self.model_runner = model_runner
        self.enabled = enabled

    def pause(self, tag: str) -> None:
        if self.enabled and tag == GPU_MEMORY_TYPE_KV_CACHE:
            self.model_runner.token_to_kv_pool.release()

    def resume(self, tag: str) -> None:
        if self.enabled and tag == GPU_MEMORY_TYPE_KV_CACHE:
            self.model_runner.token_to_kv_pool.recreate()


class Scheduler:
    def __init__(
        self,
        server_args: Any,
        port_args: Any,
        gpu_id: int,
        tp_rank: int,
        moe_ep_rank: int,
        pp_rank: int,
        attn_cp_rank: int,
        moe_dp_rank: int,
        dp_rank: int | None,
    ):
        import torch

        torch.set_num_threads(1)
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        self.conn = port_args.scheduler_conn
        self.tp_worker = TpModelWorker(server_args, tp_rank)
        self.memory_saver_adapter = MemorySaverAdapter(self.tp_worker.model_runner, server_args.enable_memory_saver)
        self.offload_tags: set[str] = set()
        self.running: str | None = None

    def get_init_info(self) -> dict[str, Any]:
        return {"status": "ready", "max_req_input_len": 128, "pid": os.getpid()}

    def _is_no_request(self) -> bool:
        return self.running is None

    def flush_cache(self) -> bool:
        return self._is_no_request()

    def release_memory_occupation(self, recv_req: ReleaseMemoryOccupationReqInput) -> ReleaseMemoryOccupationReqOutput:
        assert self._is_no_request(), "release_memory_occupation should be called only when no ongoing request."
        tags = recv_req.tags or GPU_MEMORY_ALL_TYPES
        for tag in tags:
            self.offload_tags.add(tag)
        for tag in tags:
            self.memory_saver_adapter.pause(tag)
        return ReleaseMemoryOccupationReqOutput()

    def resume_memory_occupation(self, recv_req: ResumeMemoryOccupationReqInput) -> ResumeMemoryOccupationReqOutput:
        tags = recv_req.tags or GPU_MEMORY_ALL_TYPES
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError for a tag not released: the scheduler dies, as SGLang's
        for tag in tags:
            self.memory_saver_adapter.resume(tag)
        return ResumeMemoryOccupationReqOutput()

    def _handle(self, msg: tuple[Any, ...]) -> Any:
        runner = self.tp_worker.model_runner
        op = msg[0]
        if op == "prefill":
            self.running = msg[1]
            return runner.token_to_kv_pool.prefill(runner.model, msg[2])
        if op == "decode":
            return runner.token_to_kv_pool.decode(runner.model, msg[1])
        if op == "finish":
            self.running = None
            return None
        if op == "release":
            return self.release_memory_occupation(msg[1])
        if op == "resume":
            return self.resume_memory_occupation(msg[1])
        if op == "flush":
            ok = self.flush_cache()
            return FlushCacheReqOutput(success=ok, error_msg="" if ok else "pending requests")
        raise ValueError(f"unknown request {op!r}")

    def run_event_loop(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except EOFError:
                return
            try:
                self.conn.send(("ok", self._handle(msg)))
            except (AssertionError, RuntimeError) as exc:
                self.running = None
                self.conn.send(("error", f"{type(exc).__name__}: {exc}"))


def run_scheduler_process(
    server_args: Any,
    port_args: Any,
    gpu_id: int,
    tp_rank: int,
    attn_cp_rank: int,
    moe_dp_rank: int,
    moe_ep_rank: int,
    pp_rank: int,
    dp_rank: int | None,
    pipe_writer: Any,
) -> None:
    from fake_proc import die_with_parent, set_title

    if os.environ.get("FAKE_SGLANG_NO_PLUGINS_TP") != str(tp_rank):
        load_plugins()
    die_with_parent()
    prefix = ""
    if dp_rank is not None:
        prefix += f" DP{dp_rank}"
    if server_args.tp_size > 1:
        prefix += f" TP{tp_rank}"
    set_title(f"sglang::scheduler{prefix.replace(' ', '_')}")
    try:
        scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, 0, pp_rank, 0, 0, dp_rank)
        pipe_writer.send(scheduler.get_init_info())
        scheduler.run_event_loop()
    except Exception:
        traceback.print_exc()
        raise
