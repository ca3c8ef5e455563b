"""TrtLlmAdapter against a fake TensorRT-LLM ``LLM`` with the real signatures (docs/engines.md, "TensorRT-LLM")."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from unittest.mock import call

import pytest

from gpusnap.adapters.base import HelloFacts, RestoreContext
from gpusnap.adapters.engines.trtllm.adapter import TrtLlmAdapter
from tests.adapters.fakes_engines import (
    EngineLoop,
    FakeAsyncLlm,
    FakeTrtLlm,
    FakeTrtLlmPublic,
    SamplingParams,
    calls_between,
    capture_roundtrip,
    install_fake_engine_modules,
    tokens,
)

EOS = 2
WARMUP = call.generate_async(
    [1, 5, 6, 7],
    sampling_params=SamplingParams(
        max_tokens=2, min_tokens=2, top_k=1, ignore_eos=True, detokenize=False, seed=0, end_id=EOS
    ),
)
SLEEP = call._collective_rpc("sleep", args=(["kv_cache"],), kwargs={}, non_block=False)
WAKEUP = call._collective_rpc("wakeup", args=(["kv_cache"],), kwargs={}, non_block=False)


@pytest.fixture(autouse=True)
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_engine_modules(monkeypatch)


@pytest.fixture
def engine_loop() -> Iterator[EngineLoop]:
    loop = EngineLoop()
    yield loop
    loop.close()


def test_module_imports_without_tensorrt_llm() -> None:
    code = (
        "import sys, gpusnap.adapters.engines.trtllm.adapter as m; assert 'tensorrt_llm' not in sys.modules; "
        "assert m.TrtLlmAdapter.engine == 'trtllm'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_warm_up_sends_the_deterministic_request() -> None:
    llm = FakeTrtLlm()
    got = asyncio.run(TrtLlmAdapter(llm, end_id=EOS).warm_up())
    assert llm.calls.mock_calls == [WARMUP]
    assert got == llm.requests[0].outputs[0].token_ids and len(got) == 2


def test_capture_cycle_with_collective_rpc() -> None:
    llm = FakeTrtLlm()
    adapter = TrtLlmAdapter(llm, end_id=EOS)
    assert adapter.api == "collective_rpc", "1.3's LLM has no public release()"

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        await adapter.quiesce()
        assert llm.released == {"kv_cache"} and adapter.quiesced
        with pytest.raises(RuntimeError, match="KV cache is released"):
            llm.generate_async([1, 2, 3])  # what a request during the capture would meet
        llm.calls.reset_mock()
        await adapter.resume(RestoreContext(values={"node": "n2"}))
        after = await adapter.health()
        return before, after

    before, after = asyncio.run(cycle())
    assert before == after
    assert llm.calls.mock_calls == [WAKEUP, WARMUP]
    assert llm.released == set() and not adapter.quiesced


def test_exact_call_sequence_and_no_generate_between_sleep_and_wakeup() -> None:
    llm = FakeTrtLlm()
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> None:
        await adapter.warm_up()
        await adapter.quiesce()
        await adapter.resume(None)
        await adapter.health()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [WARMUP, SLEEP, WAKEUP, WARMUP]
    assert calls_between(llm.calls, SLEEP, WAKEUP) == []
    _, kwargs = llm.calls._collective_rpc.call_args
    assert kwargs["non_block"] is False


def test_public_release_api_is_preferred() -> None:
    llm = FakeTrtLlmPublic()
    adapter = TrtLlmAdapter(llm, end_id=EOS)
    assert adapter.api == "public"

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        await adapter.quiesce()
        assert llm.released == {"kv_cache"}
        await adapter.resume(None)
        return before, await adapter.health()

    before, after = asyncio.run(cycle())
    assert before == after
    assert llm.calls.mock_calls == [WARMUP, call.release(tags=["kv_cache"]), call.resume(tags=["kv_cache"]), WARMUP]


def test_collective_rpc_can_be_forced_on_a_14_llm() -> None:
    llm = FakeTrtLlmPublic()
    adapter = TrtLlmAdapter(llm, end_id=EOS, api="collective_rpc")

    async def cycle() -> None:
        await adapter.quiesce()
        await adapter.resume(None)

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [SLEEP, WAKEUP]


def test_async_llm_is_paused_around_the_release() -> None:
    llm = FakeAsyncLlm()
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        await adapter.quiesce()
        assert llm.paused and llm.released == {"kv_cache"}
        with pytest.raises(RuntimeError, match="paused"):
            llm.generate_async([1, 2, 3])
        await adapter.resume(None)
        return before, await adapter.health()

    before, after = asyncio.run(cycle())
    assert before == after
    assert llm.calls.mock_calls == [
        WARMUP,
        call.pause_generation(),
        call.release(tags=["kv_cache"]),
        call.generate_async([1, 2, 3]),  # refused: AsyncLLM is paused
        call.resume(tags=["kv_cache"]),
        call.resume_generation(),
        WARMUP,
    ]


def test_custom_release_tags() -> None:
    llm = FakeTrtLlm()
    adapter = TrtLlmAdapter(llm, release_tags=["kv_cache", "executor_extra"])

    async def cycle() -> None:
        await adapter.quiesce()
        assert llm.released == {"kv_cache", "executor_extra"}
        await adapter.resume(None)

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [
        call._collective_rpc("sleep", args=(["kv_cache", "executor_extra"],), kwargs={}, non_block=False),
        call._collective_rpc("wakeup", args=(["kv_cache", "executor_extra"],), kwargs={}, non_block=False),
    ]
    with pytest.raises(TypeError):
        TrtLlmAdapter(llm, release_tags="kv_cache")


def test_sleep_failure_raises_and_leaves_the_worker_serving() -> None:
    """sleep fails before releasing anything (e.g. sleep_config missing): the rollback wakeup fails harmlessly."""
    llm = FakeTrtLlm()
    llm.faults.sleep = ValueError("Sleep feature is not enabled (injected)")
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        with pytest.raises(ValueError, match="injected") as err:
            await adapter.quiesce()
        assert any("rollback wakeup also failed" in note for note in err.value.__notes__)
        assert not adapter.quiesced
        mark = len(llm.calls.mock_calls)
        await adapter.resume(None)  # what the agent does after a failed quiesce
        assert llm.calls.mock_calls[mark:] == [], "nothing to undo"
        return before, await adapter.health()

    before, after = asyncio.run(cycle())
    assert before == after
    assert llm.calls.mock_calls == [WARMUP, SLEEP, WAKEUP, WARMUP]


def test_half_done_sleep_is_woken_up_again() -> None:
    llm = FakeTrtLlm()
    llm.faults.sleep, llm.faults.sleep_after_release = RuntimeError("CUDA error after release (injected)"), True
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> list[int]:
        with pytest.raises(RuntimeError, match="injected"):
            await adapter.quiesce()
        assert llm.released == set(), "the rollback re-materialised the KV cache"
        await adapter.resume(None)
        return await adapter.health()

    assert len(asyncio.run(cycle())) == 2
    assert llm.calls.mock_calls == [SLEEP, WAKEUP, WARMUP]


def test_public_release_failure_resumes_whatever_is_parked() -> None:
    llm = FakeTrtLlmPublic()
    llm.faults.sleep, llm.faults.sleep_after_release = RuntimeError("injected"), True

    async def cycle() -> None:
        with pytest.raises(RuntimeError, match="injected"):
            await TrtLlmAdapter(llm, end_id=EOS).quiesce()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [call.release(tags=["kv_cache"]), call.resume()]
    assert llm.released == set()


def test_async_llm_release_failure_resumes_generation() -> None:
    llm = FakeAsyncLlm()
    llm.faults.sleep = RuntimeError("injected")
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> None:
        with pytest.raises(RuntimeError, match="injected"):
            await adapter.quiesce()
        await adapter.resume(None)
        await adapter.health()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [
        call.pause_generation(),
        call.release(tags=["kv_cache"]),
        call.resume(),
        call.resume_generation(),
        WARMUP,
    ]
    assert not llm.paused


def test_async_llm_pause_timeout_resumes_generation() -> None:
    llm = FakeAsyncLlm()
    llm.faults.pause_hang = True
    adapter = TrtLlmAdapter(llm, drain_timeout_s=0.05)

    async def cycle() -> None:
        with pytest.raises(TimeoutError):
            await adapter.quiesce()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [call.pause_generation(), call.resume_generation()]
    assert not llm.paused and not adapter.quiesced


def test_wakeup_failure_raises_and_the_worker_stays_quiesced() -> None:
    """The agent reports the resume as failed; the daemon turns that into a failed restore."""
    llm = FakeTrtLlm()
    adapter = TrtLlmAdapter(llm, end_id=EOS)

    async def cycle() -> None:
        await adapter.quiesce()
        llm.faults.wakeup = RuntimeError("cudaErrorMemoryAllocation (injected)")
        with pytest.raises(RuntimeError, match="injected"):
            await adapter.resume(RestoreContext())
        assert adapter.quiesced and llm.released == {"kv_cache"}
        llm.faults.wakeup = None
        await adapter.resume(RestoreContext())  # a retry does the wakeup again
        assert not adapter.quiesced and llm.released == set()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [SLEEP, WAKEUP, WAKEUP]


def test_warm_up_timeout_aborts_the_request() -> None:
    llm = FakeTrtLlm()
    llm.faults.generate_hang = True

    async def cycle() -> None:
        with pytest.raises(TimeoutError, match="did not finish"):
            await TrtLlmAdapter(llm, end_id=EOS, request_timeout_s=0.05).warm_up()

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [WARMUP, call.abort(0)]
    assert llm.requests[0].aborted


def test_quiesce_twice_and_resume_without_quiesce_are_no_ops() -> None:
    llm = FakeTrtLlm()
    adapter = TrtLlmAdapter(llm)

    async def cycle() -> None:
        await adapter.resume(None)
        await adapter.quiesce()
        await adapter.quiesce()
        await adapter.resume(None)
        await adapter.resume(None)

    asyncio.run(cycle())
    assert llm.calls.mock_calls == [SLEEP, WAKEUP]


def test_info() -> None:
    assert TrtLlmAdapter(FakeTrtLlm(), end_id=EOS).info() == HelloFacts(
        info={"release_tags": "kv_cache", "memory_api": "collective_rpc", "end_id": "2"}
    )


# -- through the real WorkerAgent ------------------------------------------------------------------


def test_agent_round_trip(engine_loop: EngineLoop) -> None:
    llm = FakeTrtLlm()
    during: list[set[str]] = []
    ex = capture_roundtrip(
        TrtLlmAdapter(llm, end_id=EOS),
        engine_loop,
        values={"node": "n2"},
        during_capture=lambda: during.append(set(llm.released)),
    )
    assert ex.hello.engine == "trtllm" and not ex.hello.resumed
    assert dict(ex.hello.info) == {"release_tags": "kv_cache", "memory_api": "collective_rpc", "end_id": "2"}
    assert ex.warm_up.ok and len(tokens(ex.warm_up)) == 2
    assert ex.quiesce.ok, ex.quiesce.error
    assert during == [{"kv_cache"}], "the KV cache was released while the daemon would dump"
    assert ex.resumed_hello is not None and ex.resumed_hello.resumed
    assert ex.resumed_hello.instance_id == ex.hello.instance_id
    assert ex.resume is not None and ex.resume.ok, ex.resume.error
    assert tokens(ex.resume) == tokens(ex.warm_up), "the canary after resume matches the warm-up"
    assert llm.calls.mock_calls == [WARMUP, SLEEP, WAKEUP, WARMUP]


def test_agent_failed_quiesce_leaves_the_worker_serving(engine_loop: EngineLoop) -> None:
    llm = FakeTrtLlm()
    llm.faults.sleep = RuntimeError("release_with_tag failed (injected)")
    ex = capture_roundtrip(TrtLlmAdapter(llm, end_id=EOS), engine_loop)
    assert not ex.quiesce.ok and "RuntimeError: release_with_tag failed (injected)" in ex.quiesce.error
    assert ex.health is not None and ex.health.ok and tokens(ex.health) == tokens(ex.warm_up)
    assert llm.calls.mock_calls == [WARMUP, SLEEP, WAKEUP, WARMUP]


def test_agent_failed_resume_is_reported(engine_loop: EngineLoop) -> None:
    llm = FakeTrtLlm()

    def capture() -> None:
        llm.faults.wakeup = RuntimeError("out of memory (injected)")

    ex = capture_roundtrip(TrtLlmAdapter(llm, end_id=EOS), engine_loop, during_capture=capture)
    assert ex.resume is not None and not ex.resume.ok and "out of memory (injected)" in ex.resume.error
    assert not ex.resume.tokens, "no canary ran"
    assert llm.calls.mock_calls == [WARMUP, SLEEP, WAKEUP]
