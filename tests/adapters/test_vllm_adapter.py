"""VllmAdapter call order against a recording fake of AsyncLLM's API (vLLM 0.32/0.33 signatures).

The real engine is exercised on CPU by test_vllm_cpu.py; this covers the release modes and the failure
paths that the CPU build cannot reach (``release_kv_cache_memory`` raises there)."""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpusnap.adapters.engines.vllm.adapter import VllmAdapter


class FakeSamplingParams:
    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


@pytest.fixture(autouse=True)
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("vllm")
    module.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)


class FakeAsyncLLM:
    """Records every call; ``fail`` names a method that raises."""

    def __init__(self, fail: str = ""):
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail
        self.paused = False

    def _record(self, name: str, arg: Any = None) -> None:
        self.calls.append((name, arg))
        if name == self.fail:
            raise RuntimeError(f"{name} failed (injected)")

    async def generate(self, prompt: Any, params: Any, request_id: str, **kw: Any) -> AsyncIterator[Any]:
        assert not self.paused, "generate while paused"
        self._record(
            "generate", (tuple(prompt["prompt_token_ids"]), params.kwargs["max_tokens"], kw.get("data_parallel_rank"))
        )
        out = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[42, 7])])
        yield out

    async def reset_prefix_cache(self) -> bool:
        self._record("reset_prefix_cache")
        return True

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self._record("pause_generation", (mode, clear_cache))
        self.paused = True

    async def resume_generation(self) -> None:
        self._record("resume_generation")
        self.paused = False

    async def release_kv_cache_memory(self) -> None:
        self._record("release_kv_cache_memory")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._record("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self._record("wake_up", tags)
        return True

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> list[Any]:
        self._record("collective_rpc", method)
        return [None]

    async def checkpoint_prepare(self) -> None:
        self._record("checkpoint_prepare")

    async def checkpoint_restore(self) -> None:
        self._record("checkpoint_restore")


def _cycle(adapter: VllmAdapter) -> list[int]:
    async def go() -> list[int]:
        before = await adapter.warm_up()
        await adapter.quiesce()
        await adapter.resume(None)
        after = await adapter.health()
        assert after == before
        return before

    return asyncio.run(go())


def test_kv_release_order() -> None:
    llm = FakeAsyncLLM()
    assert _cycle(VllmAdapter(llm)) == [42, 7]
    names = [c[0] for c in llm.calls]
    assert names == [
        "generate",
        "reset_prefix_cache",
        "pause_generation",
        "release_kv_cache_memory",
        "checkpoint_prepare",
        "checkpoint_restore",
        "wake_up",
        "resume_generation",
        "generate",
        "reset_prefix_cache",
    ]
    assert llm.calls[0][1] == ((1, 5, 6, 7), 2, None)
    assert ("pause_generation", ("abort", True)) in llm.calls
    assert ("wake_up", ["kv_cache"]) in llm.calls


def test_sleep_level_2_reloads_weights() -> None:
    llm = FakeAsyncLLM()
    _cycle(VllmAdapter(llm, release="sleep2"))
    names = [c for c in llm.calls if c[0] in ("sleep", "wake_up", "collective_rpc")]
    assert names == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
    ]


def test_warm_up_every_data_parallel_rank() -> None:
    llm = FakeAsyncLLM()
    asyncio.run(VllmAdapter(llm, data_parallel_size=2).warm_up())
    assert [c[1][2] for c in llm.calls if c[0] == "generate"] == [0, 1]


def test_failed_release_resumes_generation() -> None:
    llm = FakeAsyncLLM(fail="release_kv_cache_memory")
    adapter = VllmAdapter(llm)
    with pytest.raises(RuntimeError, match="injected"):
        asyncio.run(adapter.quiesce())
    assert [c[0] for c in llm.calls] == ["pause_generation", "release_kv_cache_memory", "resume_generation"]
    assert not llm.paused
    asyncio.run(adapter.resume(None))  # what the agent does next: nothing left to undo
    assert [c[0] for c in llm.calls][-1] == "resume_generation"
    assert len([c for c in llm.calls if c[0] == "resume_generation"]) == 1


def test_release_none_only_pauses() -> None:
    llm = FakeAsyncLLM()
    _cycle(VllmAdapter(llm, release="none"))
    assert not any(c[0] in ("release_kv_cache_memory", "sleep", "wake_up") for c in llm.calls)


@pytest.mark.parametrize(("block_size", "resets"), [(16, False), (128, False), (6, True), (None, True)])
def test_the_canary_resets_the_prefix_cache_only_where_it_may_fill_a_block(
    block_size: int | None, resets: bool
) -> None:
    """vLLM caches whole KV blocks: a canary of 4 + 2 tokens fills none of 16 (nothing to reset after it), one of
    6 it may; an engine that does not say its block size is reset as the warm-up resets it."""
    llm = FakeAsyncLLM()
    if block_size is not None:
        llm.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(block_size=block_size))  # type: ignore[attr-defined]
    adapter = VllmAdapter(llm, release="none")
    assert asyncio.run(adapter.health()) == [42, 7]
    assert [c for c, _ in llm.calls] == ["generate", *(["reset_prefix_cache"] if resets else [])]
    llm.calls.clear()
    asyncio.run(adapter.warm_up())
    assert [c for c, _ in llm.calls] == ["generate", "reset_prefix_cache"], "the warm-up always resets it"
