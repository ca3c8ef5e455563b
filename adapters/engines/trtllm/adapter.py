"""TensorRT-LLM adapter: warm-up, KV-cache release and re-materialisation through the LLM API.

This is the in-process form: your code starts one agent, and the executor worker processes, which hold the model,
keep their weights in the image. ``gpusnap.adapters.engines.trtllm.plugin.enable()`` (docs/engines.md) uses this adapter in
the front end and gives each executor worker an agent of its own.

Build the engine for it (docs/engines.md, "TensorRT-LLM"): PyTorch backend, ``sleep_config=SleepConfig()`` (older
releases: ``enable_sleep=True``), ``kv_cache_config.use_kv_cache_manager_v2=False``, and a world size of 1
under MPI (multi-rank sleep needs the Ray orchestrator). Then::

    from gpusnap.adapters import start_agent
    from gpusnap.adapters.engines.trtllm.adapter import TrtLlmAdapter
    start_agent(TrtLlmAdapter(llm, end_id=tokenizer.eos_token_id), loop=asyncio.get_running_loop())

Upstream calls, checked against NVIDIA/TensorRT-LLM (main, 1.3–1.4 era):

- ``tensorrt_llm/llmapi/llm.py``: ``generate_async(inputs, sampling_params=None, lora_request=None,
  prompt_adapter_request=None, streaming=False, …, cache_salt=None, priority=0.5) -> RequestOutput``, a
  ``GenerationResult`` (``tensorrt_llm/executor/result.py``) with ``async aresult()``, ``abort()`` and
  ``outputs[i].token_ids``; ``_collective_rpc(method, args=(), kwargs=None, non_block=False,
  unique_reply_rank=None, target_ranks=None) -> list`` (prototype, synchronous).
- ``tensorrt_llm/executor/base_worker.py``: ``BaseWorker.sleep(sleep_tags: List[str])`` and
  ``wakeup(wakeup_tags: List[str])``; both run inside ``PyExecutor.control_action()``, which drains the
  in-flight requests and pauses the executor loop, then ``release_with_tag`` / ``materialize_with_tag``
  (``tensorrt_llm/_torch/virtual_memory.py``; same virtual addresses). Tags are ``ExecutorMemoryType``
  values (``tensorrt_llm/llmapi/llm_args.py``): ``"kv_cache"``, ``"model"``, ``"executor_extra"``, ….
- 1.4 public API ("Runtime Memory Checkpointing (Prototype)", ``features/sleep-wakeup.md``):
  ``LLM.release(tags=None)``, ``LLM.resume(tags=None)`` (``resume()`` without tags re-materialises every
  tag still parked), ``get_memory_status()``; on ``AsyncLLM`` (``tensorrt_llm/_torch/async_llm.py``) these
  are coroutines, and ``pause_generation()`` / ``resume_generation()`` abort in-flight requests and refuse
  new ones. The adapter prefers that API when the ``LLM`` has it.
- ``tensorrt_llm/sampling_params.py``: ``SamplingParams`` (``max_tokens`` defaults to 32;
  ``top_k=1`` is greedy; ``end_id=None`` is filled from the tokenizer, so pass ``end_id`` when the LLM was
  built with ``skip_tokenizer_init=True``).

Stopping work: TensorRT-LLM's sync ``LLM`` has no pause (``tensorrt_llm/llmapi/llm.py``). ``sleep`` drains whatever
is in flight inside ``control_action()``, and both ``_collective_rpc`` and ``LLM.release`` block the
calling thread, which is the engine's event loop, so nothing new is submitted from that loop while memory
is released. Requests submitted *after* quiesce returns and before the dump would find no KV cache: a
server in front of the LLM should stop admitting requests while :attr:`TrtLlmAdapter.quiesced` is true.
``AsyncLLM`` needs no such care: its ``pause_generation()`` is used.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any, Literal

from gpusnap.adapters.base import WARMUP_MAX_TOKENS, WARMUP_PROMPT_TOKEN_IDS, EngineAdapter, HelloFacts, RestoreContext

log = logging.getLogger(__name__)

DEFAULT_RELEASE_TAGS: tuple[str, ...] = ("kv_cache",)
"""Only the KV cache: the weights stay on the GPU, where the CUDA checkpoint copies them."""
DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""Limit on one warm-up/canary request (Dynamo's warm-up uses the same 600 s)."""
DEFAULT_DRAIN_TIMEOUT_S = 300.0
"""Limit on ``AsyncLLM.pause_generation()`` (abort and drain in-flight requests)."""

Api = Literal["auto", "public", "collective_rpc"]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class TrtLlmAdapter(EngineAdapter):
    """Adapter over a ``tensorrt_llm.LLM`` (or ``AsyncLLM``) object.

    Args:
        llm: the engine; only the methods named in the module docstring are used.
        end_id: the EOS token id for the warm-up's ``SamplingParams`` (``None``: TensorRT-LLM takes it from
            its tokenizer, which then must exist).
        release_tags: memory tags to release on quiesce and re-materialise on resume.
        api: ``"public"`` uses ``llm.release(tags)`` / ``llm.resume(tags)`` (TensorRT-LLM 1.4),
            ``"collective_rpc"`` uses ``llm._collective_rpc("sleep"/"wakeup", …)``; ``"auto"`` picks the
            public API when the ``LLM`` has it.
        request_timeout_s: limit on each warm-up/canary request; a request past it is aborted.
        drain_timeout_s: limit on ``AsyncLLM.pause_generation()``.
    """

    engine = "trtllm"

    def __init__(
        self,
        llm: Any,
        *,
        end_id: int | None = None,
        release_tags: Sequence[str] = DEFAULT_RELEASE_TAGS,
        api: Api = "auto",
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ):
        if isinstance(release_tags, str):
            raise TypeError("release_tags must be a sequence of tag names, not a string")
        if api == "auto":
            api = (
                "public"
                if callable(getattr(llm, "release", None)) and callable(getattr(llm, "resume", None))
                else "collective_rpc"
            )
        self.llm = llm
        self.end_id = end_id
        self.release_tags: tuple[str, ...] = tuple(release_tags)
        self.api: Api = api
        self.request_timeout_s = request_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._can_pause = callable(getattr(llm, "pause_generation", None)) and callable(
            getattr(llm, "resume_generation", None)
        )
        self._released = False
        self._paused = False

    @property
    def quiesced(self) -> bool:
        """True between a successful :meth:`quiesce` and the :meth:`resume` that undoes it."""
        return self._released or self._paused

    def info(self) -> HelloFacts:
        facts = {"release_tags": ",".join(self.release_tags), "memory_api": self.api}
        if self.end_id is not None:
            facts["end_id"] = str(self.end_id)
        return HelloFacts(info=facts)

    async def warm_up(self) -> list[int]:
        """One greedy token-only request: 2 tokens (a prefill and a decode step), EOS ignored."""
        from tensorrt_llm.llmapi import SamplingParams

        params = SamplingParams(
            max_tokens=WARMUP_MAX_TOKENS,
            min_tokens=WARMUP_MAX_TOKENS,
            top_k=1,
            ignore_eos=True,
            detokenize=False,
            seed=0,
            end_id=self.end_id,
        )
        result = self.llm.generate_async(list(WARMUP_PROMPT_TOKEN_IDS), sampling_params=params)
        try:
            done = await asyncio.wait_for(result.aresult(), self.request_timeout_s)
        except TimeoutError:
            _abort(result)
            raise TimeoutError(
                f"TensorRT-LLM warm-up request did not finish within {self.request_timeout_s:g} s"
            ) from None
        tokens = [int(t) for t in done.outputs[0].token_ids]
        if not tokens:
            raise RuntimeError("TensorRT-LLM warm-up request returned no tokens")
        return tokens

    async def quiesce(self) -> None:
        """Pause ``AsyncLLM`` if it can, then release the tagged memory; on failure undo both and re-raise."""
        if self.quiesced:
            return
        if self._can_pause:
            try:
                await asyncio.wait_for(_maybe_await(self.llm.pause_generation()), self.drain_timeout_s)
            except BaseException as exc:
                await self._rollback_pause(exc)
                raise
            self._paused = True
        try:
            await self._release()
        except BaseException as exc:
            await self._rollback_release(exc)
            await self._rollback_pause(exc)
            raise
        self._released = True

    async def resume(self, context: RestoreContext | None) -> None:
        """Re-materialise what :meth:`quiesce` released, then let ``AsyncLLM`` take requests again.

        Nothing to do when the worker was not quiesced (a failed quiesce already rolled back). A failure
        propagates: the memory stays released and the worker must not serve.
        """
        if self._released:
            await self._wake()
            self._released = False
        if self._paused:
            await _maybe_await(self.llm.resume_generation())
            self._paused = False

    # -- memory ------------------------------------------------------------------------------------

    async def _release(self) -> None:
        tags = list(self.release_tags)
        if self.api == "public":
            await _maybe_await(self.llm.release(tags))
        else:
            self.llm._collective_rpc("sleep", args=(tags,), kwargs={}, non_block=False)

    async def _wake(self) -> None:
        tags = list(self.release_tags)
        if self.api == "public":
            await _maybe_await(self.llm.resume(tags))
        else:
            self.llm._collective_rpc("wakeup", args=(tags,), kwargs={}, non_block=False)

    async def _rollback_release(self, cause: BaseException) -> None:
        """After a failed release nothing says how far it got: re-materialise whatever may be parked.

        The public API's ``resume()`` without tags wakes only what is still parked. ``wakeup`` on memory
        that was never released fails, so its error is only logged.
        """
        try:
            if self.api == "public":
                await _maybe_await(self.llm.resume())
            else:
                self.llm._collective_rpc("wakeup", args=(list(self.release_tags),), kwargs={}, non_block=False)
        except Exception as exc:  # the release error is the one to report
            log.warning("gpusnap trtllm: wakeup after the failed release failed too: %s", exc)
            cause.add_note(f"rollback wakeup also failed: {type(exc).__name__}: {exc}")

    async def _rollback_pause(self, cause: BaseException) -> None:
        if not self._can_pause:
            return
        try:
            await _maybe_await(self.llm.resume_generation())
        except Exception as exc:
            log.warning("gpusnap trtllm: resume_generation after a failed quiesce failed: %s", exc)
            cause.add_note(f"rollback resume_generation also failed: {type(exc).__name__}: {exc}")
        self._paused = False


def _abort(result: Any) -> None:
    abort = getattr(result, "abort", None)
    if callable(abort):
        try:
            abort()
        except Exception as exc:
            log.warning("gpusnap trtllm: could not abort the timed-out warm-up request: %s", exc)
