"""SGLang adapter: warm-up per data-parallel rank, pause + KV-cache release, resume + continue.

This is the in-process form: your code starts one agent, and the scheduler processes, which hold the model, keep
their weights in the image. gpusnap's plugin (``gpusnap.adapters.engines.sglang.plugin``, which SGLang loads in every
process; docs/engines.md) uses this adapter in the front end and gives each scheduler an agent of its own.

Build the engine for it (docs/engines.md, "SGLang"): ``sgl.Engine(…, enable_memory_saver=True)`` with
``torch_memory_saver`` installed (without it the memory calls warn and free nothing). Then::

    from gpusnap.adapters import start_agent
    from gpusnap.adapters.engines.sglang.adapter import SglangAdapter
    start_agent(SglangAdapter(engine, dp_size=engine.server_args.dp_size), loop=asyncio.get_running_loop())

Upstream calls, checked against sgl-project/sglang (main, 0.5.x):

- ``python/sglang/srt/entrypoints/engine.py``: ``async def async_generate(prompt=None, sampling_params=None,
  input_ids=None, …, stream=False, …, routed_dp_rank=None, disagg_prefill_dp_rank=None,
  data_parallel_rank=None (deprecated), external_trace_header=None, rid=None, …)`` returns a dict with
  ``"output_ids"`` and ``"meta_info"``. ``routed_dp_rank=0`` with ``dp_size == 1`` is ignored with a
  warning, so it is only passed when ``dp_size > 1``.
- Same file: ``Engine.release_memory_occupation(tags=None)``, ``resume_memory_occupation(tags=None)`` and
  ``flush_cache()`` are *synchronous* wrappers around ``self.loop.run_until_complete(...)``: they cannot
  run on the engine's loop, where the agent calls the adapter. The adapter awaits what they wrap:
  ``tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=…), None)``,
  ``resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=…), None)`` and ``flush_cache()``
  (``python/sglang/srt/managers/tokenizer_communicator_mixin.py``; the last returns
  ``FlushCacheReqOutput(success, …)``), as verl's and ChatLearn's async engines do.
- ``python/sglang/srt/managers/tokenizer_manager.py``: ``async pause_generation(obj:
  PauseGenerationReqInput)`` (mode ``"abort"`` sets ``is_pause``, so new requests wait, and aborts until
  ``model_update_lock`` is free) and ``async continue_generation(obj: ContinueGenerationReqInput)``.
- ``python/sglang/srt/managers/io_struct.py``: ``PauseGenerationReqInput(mode="abort"|"retract"|
  "in_place")``, ``ContinueGenerationReqInput()``, ``ReleaseMemoryOccupationReqInput(tags=None)``,
  ``ResumeMemoryOccupationReqInput(tags=None)``; tags are ``"kv_cache"``, ``"weights"``, ``"cuda_graph"``
  (``srt/constants.py``).
- The scheduler asserts it is idle before releasing (hence the pause first), and resuming a tag that was
  not released raises in the scheduler subprocess and takes the engine down: the adapter resumes only
  what it released.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from gpusnap.adapters.base import WARMUP_MAX_TOKENS, EngineAdapter, HelloFacts, RestoreContext

log = logging.getLogger(__name__)

SGLANG_WARMUP_INPUT_IDS: tuple[int, ...] = (10, 11, 12)
"""SGLang's own token-only warm-up prompt (``_execute_server_warmup`` with ``skip_tokenizer_init``)."""
DEFAULT_RELEASE_TAGS: tuple[str, ...] = ("kv_cache",)
"""Only the KV cache (releasing it also flushes the radix cache); the weights stay on the GPU."""
DEFAULT_REQUEST_TIMEOUT_S = 600.0
"""Limit on one warm-up/canary request (SGLang's ``SGLANG_WARMUP_TIMEOUT`` default in Dynamo)."""
DEFAULT_DRAIN_TIMEOUT_S = 300.0
"""Limit on ``pause_generation(mode="abort")``, which polls until in-flight requests are gone."""

_request_numbers = itertools.count()


class SglangAdapter(EngineAdapter):
    """Adapter over an ``sglang.Engine`` (``sglang.srt.entrypoints.engine.Engine``).

    Args:
        engine: the engine; the adapter uses ``async_generate``, ``tokenizer_manager`` and the request classes
            of ``sglang.srt.managers.io_struct``.
        dp_size: data-parallel size; the warm-up sends one request to each rank.
        release_tags: memory tags to release on quiesce and resume on resume.
        warmup_input_ids: the warm-up prompt (token ids, no tokenizer needed).
        request_timeout_s: limit on each warm-up/canary request; a request past it is aborted.
        drain_timeout_s: limit on ``pause_generation``.
    """

    engine = "sglang"

    def __init__(
        self,
        engine: Any,
        *,
        dp_size: int = 1,
        release_tags: Sequence[str] = DEFAULT_RELEASE_TAGS,
        warmup_input_ids: Sequence[int] = SGLANG_WARMUP_INPUT_IDS,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if isinstance(release_tags, str):
            raise TypeError("release_tags must be a sequence of tag names, not a string")
        server_dp = getattr(getattr(engine, "server_args", None), "dp_size", None)
        if isinstance(server_dp, int) and server_dp != dp_size:
            log.warning(
                "gpusnap sglang: dp_size=%d but the engine's server_args.dp_size is %d; the warm-up reaches %d rank(s)",
                dp_size,
                server_dp,
                dp_size,
            )
        self.sgl_engine = engine
        self.dp_size = dp_size
        self.release_tags: tuple[str, ...] = tuple(release_tags)
        self.warmup_input_ids: tuple[int, ...] = tuple(warmup_input_ids)
        self.request_timeout_s = request_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self._paused = False
        self._released = False

    @property
    def quiesced(self) -> bool:
        """True between a successful :meth:`quiesce` and the :meth:`resume` that undoes it."""
        return self._paused or self._released

    def info(self) -> HelloFacts:
        return HelloFacts(info={"dp_size": str(self.dp_size), "release_tags": ",".join(self.release_tags)})

    async def warm_up(self) -> list[int]:
        """One greedy request per DP rank (2 tokens, EOS ignored), then a cache flush; rank 0's tokens."""
        per_rank = [await self._generate(rank) for rank in range(self.dp_size)]
        for rank, tokens in enumerate(per_rank[1:], start=1):
            if tokens != per_rank[0]:
                log.warning("gpusnap sglang: DP rank %d's warm-up gave %s, rank 0's %s", rank, tokens, per_rank[0])
        await self._flush_cache()
        return per_rank[0]

    async def quiesce(self) -> None:
        """Pause generation (abort mode), then release the tagged memory; on failure continue and re-raise."""
        if self.quiesced:
            return
        from sglang.srt.managers.io_struct import PauseGenerationReqInput, ReleaseMemoryOccupationReqInput

        tm = self.sgl_engine.tokenizer_manager
        self._paused = True  # pause_generation sets is_pause before it drains: undo it even if it fails
        try:
            await asyncio.wait_for(tm.pause_generation(PauseGenerationReqInput(mode="abort")), self.drain_timeout_s)
            result = await tm.release_memory_occupation(
                ReleaseMemoryOccupationReqInput(tags=list(self.release_tags)), None
            )
            _check(result, "release_memory_occupation")
        except BaseException as exc:
            await self._continue_after_failure(exc)
            raise
        self._released = True

    async def resume(self, context: RestoreContext | None) -> None:
        """Resume the released memory, then continue generation; a no-op when not quiesced.

        A failure propagates with generation still paused: without its KV cache the engine must not serve.
        """
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, ResumeMemoryOccupationReqInput

        tm = self.sgl_engine.tokenizer_manager
        if self._released:
            obj = ResumeMemoryOccupationReqInput(tags=list(self.release_tags))
            result = await tm.resume_memory_occupation(obj, None)
            _check(result, "resume_memory_occupation")
            self._released = False
        if self._paused:
            await tm.continue_generation(ContinueGenerationReqInput())
            self._paused = False

    # -- helpers -----------------------------------------------------------------------------------

    async def _generate(self, rank: int) -> list[int]:
        rid = f"gpusnap-warmup-{rank}-{next(_request_numbers)}"
        kwargs: dict[str, Any] = {}
        if self.dp_size > 1:
            kwargs["routed_dp_rank"] = rank
        request = self.sgl_engine.async_generate(
            input_ids=list(self.warmup_input_ids),
            sampling_params={"temperature": 0, "max_new_tokens": WARMUP_MAX_TOKENS, "ignore_eos": True},
            rid=rid,
            **kwargs,
        )
        try:
            out = await asyncio.wait_for(request, self.request_timeout_s)
        except TimeoutError:
            try:
                self.sgl_engine.tokenizer_manager.abort_request(rid=rid)
            except Exception as exc:
                log.warning("gpusnap sglang: could not abort the timed-out warm-up request %s: %s", rid, exc)
            raise TimeoutError(
                f"SGLang warm-up request to DP rank {rank} did not finish within {self.request_timeout_s:g} s"
            ) from None
        if not isinstance(out, dict) or "output_ids" not in out:
            raise RuntimeError(f"SGLang warm-up returned no output_ids: {out!r:.200}")
        tokens = [int(t) for t in out["output_ids"]]
        if not tokens:
            raise RuntimeError(f"SGLang warm-up request to DP rank {rank} returned no tokens")
        return tokens

    async def _flush_cache(self) -> None:
        """Drop the warm-up's prefix-cache entries; SGLang refuses while busy, which is only logged."""
        try:
            result = await self.sgl_engine.tokenizer_manager.flush_cache()
        except Exception as exc:
            log.warning("gpusnap sglang: flush_cache after the warm-up failed: %s", exc)
            return
        if getattr(result, "success", True) is False:
            log.info(
                "gpusnap sglang: flush_cache after the warm-up refused (engine busy): %s",
                getattr(result, "error_msg", "") or result,
            )

    async def _continue_after_failure(self, cause: BaseException) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        try:
            await self.sgl_engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput())
        except Exception as exc:
            log.warning("gpusnap sglang: continue_generation after a failed quiesce failed: %s", exc)
            cause.add_note(f"rollback continue_generation also failed: {type(exc).__name__}: {exc}")
        self._paused = False


def _check(result: Any, what: str) -> None:
    """Raise if ``result`` (or any item of a per-rank list) reports ``success=False``."""
    for item in result if isinstance(result, list) else [result]:
        if getattr(item, "success", True) is False:
            raise RuntimeError(f"SGLang {what} failed: {getattr(item, 'message', '') or item}")
