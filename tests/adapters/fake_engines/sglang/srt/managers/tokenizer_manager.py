"""``sglang/srt/managers/tokenizer_manager.py``: the front end's ``TokenizerManager``.

Calls gpusnap makes, with SGLang's signatures: ``generate_request(obj, request=None)`` (an async generator;
it starts with ``auto_create_handle_loop()``, which binds the manager to the running loop, and waits while
paused), ``pause_generation(obj)`` (``mode="abort"``: sets ``is_pause``, then waits for in-flight requests),
``continue_generation(obj)``, ``release_memory_occupation(obj, request=None)`` and
``resume_memory_occupation(obj, request=None)`` (to every scheduler; one output per rank),
``flush_cache()`` and ``abort_request(rid="", abort_all=False)``. One request at a time reaches the schedulers.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)


class TokenizerManager:
    def __init__(self, server_args: Any, port_args: Any, scheduler_conns: list[Any] | None = None):
        self.server_args = server_args
        self.port_args = port_args
        self.scheduler_conns = list(scheduler_conns or [])
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self.is_pause = False
        self.in_flight = 0
        self._lock = threading.Lock()

    def auto_create_handle_loop(self) -> None:
        if self.event_loop is None:
            self.event_loop = asyncio.get_running_loop()

    def _all(self, *msg: Any) -> list[Any]:
        with self._lock:
            for conn in self.scheduler_conns:
                conn.send(msg)
            replies = [conn.recv() for conn in self.scheduler_conns]
        errors = [text for status, text in replies if status != "ok"]
        if errors:
            raise RuntimeError(f"scheduler failed: {errors[0]}")
        return [value for _, value in replies]

    def _generate(self, rid: str, prompt: list[int], n: int) -> list[int]:
        from fake_lm import pick

        tokens = [pick(self._all("prefill", rid, prompt))]
        try:
            while len(tokens) < n:
                tokens.append(pick(self._all("decode", tokens[-1])))
        finally:
            self._all("finish")
        return tokens

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> Any:
        self.auto_create_handle_loop()
        while self.is_pause:
            await asyncio.sleep(0.01)
        assert obj.input_ids is not None, "the fake serves token prompts only (skip_tokenizer_init)"
        params = obj.sampling_params or {}
        n = int(params.get("max_new_tokens", 128))
        self.in_flight += 1
        try:
            tokens = await asyncio.to_thread(self._generate, obj.rid or "", list(obj.input_ids), n)
        finally:
            self.in_flight -= 1
        yield {"text": "", "output_ids": tokens, "meta_info": {"id": obj.rid, "finish_reason": {"type": "length"}}}

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.is_pause = True
        while self.in_flight:
            await asyncio.sleep(0.01)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.is_pause = False

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None) -> list[Any]:
        return await asyncio.to_thread(self._all, "release", obj)

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None) -> list[Any]:
        return await asyncio.to_thread(self._all, "resume", obj)

    async def flush_cache(self) -> FlushCacheReqOutput:
        outs = await asyncio.to_thread(self._all, "flush")
        return FlushCacheReqOutput(success=all(o.success for o in outs))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        pass
