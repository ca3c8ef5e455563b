"""SglangAdapter against a fake SGLang ``Engine`` with the real signatures (docs/engines.md, "SGLang")."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from unittest.mock import ANY, call

import pytest

from gpusnap.adapters.base import HelloFacts, RestoreContext
from gpusnap.adapters.engines.sglang.adapter import SglangAdapter
from tests.adapters.fakes_engines import (
    ContinueGenerationReqInput,
    EngineLoop,
    FakeSglangEngine,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    calls_between,
    capture_roundtrip,
    install_fake_engine_modules,
    tokens,
)

PARAMS = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def generate(rank: int | None = None) -> Any:
    if rank is None:
        return call.async_generate(input_ids=[10, 11, 12], sampling_params=PARAMS, rid=ANY)
    return call.async_generate(input_ids=[10, 11, 12], sampling_params=PARAMS, routed_dp_rank=rank, rid=ANY)


WARMUP = [generate(), call.tokenizer_manager.flush_cache()]
PAUSE = call.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode="abort"))
RELEASE = call.tokenizer_manager.release_memory_occupation(
    ReleaseMemoryOccupationReqInput(tags=["kv_cache"]), request=None
)
RESUME = call.tokenizer_manager.resume_memory_occupation(
    ResumeMemoryOccupationReqInput(tags=["kv_cache"]), request=None
)
CONTINUE = call.tokenizer_manager.continue_generation(ContinueGenerationReqInput())


@pytest.fixture(autouse=True)
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_engine_modules(monkeypatch)


@pytest.fixture
def engine_loop() -> Iterator[EngineLoop]:
    loop = EngineLoop()
    yield loop
    loop.close()


def test_module_imports_without_sglang() -> None:
    code = (
        "import sys, gpusnap.adapters.engines.sglang.adapter as m; assert 'sglang' not in sys.modules; "
        "assert m.SglangAdapter.engine == 'sglang'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_warm_up_request_then_flush() -> None:
    engine = FakeSglangEngine()
    got = asyncio.run(SglangAdapter(engine).warm_up())
    assert len(got) == 2
    assert engine.calls.mock_calls == WARMUP
    assert engine.warnings == [], "routed_dp_rank is not sent when dp_size == 1"
    rid = engine.calls.async_generate.call_args.kwargs["rid"]
    assert rid.startswith("gpusnap-warmup-0-")


def test_warm_up_goes_to_every_dp_rank() -> None:
    engine = FakeSglangEngine(dp_size=3)
    got = asyncio.run(SglangAdapter(engine, dp_size=3).warm_up())
    assert len(got) == 2
    assert engine.calls.mock_calls == [generate(0), generate(1), generate(2), call.tokenizer_manager.flush_cache()]


def test_capture_cycle() -> None:
    engine = FakeSglangEngine()
    adapter = SglangAdapter(engine)
    tm = engine.tokenizer_manager

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        await adapter.quiesce()
        assert tm.is_pause and tm.released == {"kv_cache"} and adapter.quiesced
        await adapter.resume(RestoreContext(values={"node": "n2"}))
        assert not tm.is_pause and tm.released == set() and not adapter.quiesced
        return before, await adapter.health()

    before, after = asyncio.run(cycle())
    assert before == after
    assert engine.calls.mock_calls == [*WARMUP, PAUSE, RELEASE, RESUME, CONTINUE, *WARMUP]
    assert calls_between(engine.calls, RELEASE, RESUME) == [], "no generate between release and resume"
    assert not tm.dead


def test_sync_engine_wrappers_cannot_run_on_the_engine_loop() -> None:
    """Why the adapter awaits the tokenizer manager: Engine's wrappers call run_until_complete."""
    engine = FakeSglangEngine()

    async def call_wrapper() -> None:
        engine.release_memory_occupation(tags=["kv_cache"])

    with pytest.raises(RuntimeError, match="already running"):
        asyncio.run(call_wrapper())


def test_the_fake_scheduler_refuses_a_release_while_not_idle() -> None:
    engine = FakeSglangEngine()
    with pytest.raises(AssertionError, match="not idle"):
        asyncio.run(engine.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(["kv_cache"])))


def test_custom_release_tags() -> None:
    engine = FakeSglangEngine()
    adapter = SglangAdapter(engine, release_tags=("kv_cache", "cuda_graph"))

    async def cycle() -> None:
        await adapter.quiesce()
        assert engine.tokenizer_manager.released == {"kv_cache", "cuda_graph"}
        await adapter.resume(None)

    asyncio.run(cycle())
    tags = ["kv_cache", "cuda_graph"]
    assert engine.calls.mock_calls == [
        PAUSE,
        call.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), request=None),
        call.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), request=None),
        CONTINUE,
    ]


def test_release_failure_continues_generation_and_raises() -> None:
    engine = FakeSglangEngine()
    engine.faults.release = RuntimeError("torch_memory_saver pause failed (injected)")
    adapter = SglangAdapter(engine)

    async def cycle() -> tuple[list[int], list[int]]:
        before = await adapter.warm_up()
        with pytest.raises(RuntimeError, match="injected"):
            await adapter.quiesce()
        assert not adapter.quiesced and not engine.tokenizer_manager.is_pause
        mark = len(engine.calls.mock_calls)
        await adapter.resume(None)  # what the agent does after a failed quiesce
        assert engine.calls.mock_calls[mark:] == [], "nothing to undo; above all no resume of unreleased memory"
        return before, await adapter.health()

    before, after = asyncio.run(cycle())
    assert before == after
    assert engine.calls.mock_calls == [*WARMUP, PAUSE, RELEASE, CONTINUE, *WARMUP]
    assert not engine.tokenizer_manager.dead


def test_release_reporting_failure_is_an_error() -> None:
    engine = FakeSglangEngine()

    async def refuse(obj: Any, request: Any = None) -> Any:
        from types import SimpleNamespace

        return [SimpleNamespace(success=True, message=""), SimpleNamespace(success=False, message="rank 1 busy")]

    engine.tokenizer_manager.release_memory_occupation = refuse  # type: ignore[method-assign]

    async def cycle() -> None:
        with pytest.raises(RuntimeError, match="rank 1 busy"):
            await SglangAdapter(engine).quiesce()

    asyncio.run(cycle())
    assert engine.calls.mock_calls == [PAUSE, CONTINUE]


def test_drain_timeout_continues_generation() -> None:
    engine = FakeSglangEngine()
    engine.faults.pause_hang = True
    adapter = SglangAdapter(engine, drain_timeout_s=0.05)

    async def cycle() -> None:
        with pytest.raises(TimeoutError):
            await adapter.quiesce()

    asyncio.run(cycle())
    assert engine.calls.mock_calls == [PAUSE, CONTINUE]
    assert not engine.tokenizer_manager.is_pause and not adapter.quiesced


def test_resume_failure_raises_and_keeps_generation_paused() -> None:
    """The worker must not serve without its KV cache; the daemon turns this into a failed restore."""
    engine = FakeSglangEngine()
    adapter = SglangAdapter(engine)

    async def cycle() -> None:
        await adapter.quiesce()
        engine.faults.resume = RuntimeError("resume failed (injected)")
        with pytest.raises(RuntimeError, match="injected"):
            await adapter.resume(RestoreContext())
        assert adapter.quiesced and engine.tokenizer_manager.is_pause
        engine.faults.resume = None
        await adapter.resume(RestoreContext())
        assert not adapter.quiesced

    asyncio.run(cycle())
    assert engine.calls.mock_calls == [PAUSE, RELEASE, RESUME, RESUME, CONTINUE]


def test_warm_up_timeout_aborts_the_request() -> None:
    engine = FakeSglangEngine()
    engine.faults.generate_hang = True

    async def cycle() -> None:
        with pytest.raises(TimeoutError, match="DP rank 0 did not finish"):
            await SglangAdapter(engine, request_timeout_s=0.05).warm_up()

    asyncio.run(cycle())
    rid = engine.calls.async_generate.call_args.kwargs["rid"]
    assert engine.calls.mock_calls == [generate(), call.tokenizer_manager.abort_request(rid=rid)]


def test_busy_flush_is_tolerated(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeSglangEngine()
    engine.tokenizer_manager.in_flight = 1  # a user request keeps the engine busy
    with caplog.at_level("INFO", logger="gpusnap.adapters.engines.sglang.adapter"):
        assert len(asyncio.run(SglangAdapter(engine).warm_up())) == 2
    assert "flush_cache after the warm-up refused" in caplog.text
    assert engine.calls.mock_calls == WARMUP


def test_quiesce_twice_and_resume_without_quiesce_are_no_ops() -> None:
    engine = FakeSglangEngine()
    adapter = SglangAdapter(engine)

    async def cycle() -> None:
        await adapter.resume(None)
        await adapter.quiesce()
        await adapter.quiesce()
        await adapter.resume(None)
        await adapter.resume(None)

    asyncio.run(cycle())
    assert engine.calls.mock_calls == [PAUSE, RELEASE, RESUME, CONTINUE]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        SglangAdapter(FakeSglangEngine(), dp_size=0)
    with pytest.raises(TypeError):
        SglangAdapter(FakeSglangEngine(), release_tags="kv_cache")
    assert SglangAdapter(FakeSglangEngine(dp_size=2), dp_size=2).info() == HelloFacts(
        info={"dp_size": "2", "release_tags": "kv_cache"}
    )


# -- through the real WorkerAgent ------------------------------------------------------------------


def test_agent_round_trip(engine_loop: EngineLoop) -> None:
    engine = FakeSglangEngine(dp_size=2)
    tm = engine.tokenizer_manager
    during: list[tuple[bool, set[str]]] = []
    ex = capture_roundtrip(
        SglangAdapter(engine, dp_size=2),
        engine_loop,
        values={"node": "n2"},
        during_capture=lambda: during.append((tm.is_pause, set(tm.released))),
    )
    assert ex.hello.engine == "sglang" and dict(ex.hello.info) == {"dp_size": "2", "release_tags": "kv_cache"}
    assert ex.warm_up.ok and len(tokens(ex.warm_up)) == 2
    assert ex.quiesce.ok, ex.quiesce.error
    assert during == [(True, {"kv_cache"})]
    assert ex.resumed_hello is not None and ex.resumed_hello.resumed
    assert ex.resume is not None and ex.resume.ok, ex.resume.error
    assert tokens(ex.resume) == tokens(ex.warm_up)
    warm = [generate(0), generate(1), call.tokenizer_manager.flush_cache()]
    assert engine.calls.mock_calls == [*warm, PAUSE, RELEASE, RESUME, CONTINUE, *warm]


def test_agent_failed_capture_resumes_the_source(engine_loop: EngineLoop) -> None:
    engine = FakeSglangEngine()
    ex = capture_roundtrip(SglangAdapter(engine), engine_loop, restored=False)
    assert ex.resume is not None and ex.resume.ok and tokens(ex.resume) == tokens(ex.warm_up)
    assert engine.calls.mock_calls == [*WARMUP, PAUSE, RELEASE, RESUME, CONTINUE, *WARMUP]


def test_agent_failed_quiesce_leaves_the_worker_serving(engine_loop: EngineLoop) -> None:
    engine = FakeSglangEngine()
    engine.faults.release = RuntimeError("release failed (injected)")
    ex = capture_roundtrip(SglangAdapter(engine), engine_loop)
    assert not ex.quiesce.ok and "RuntimeError: release failed (injected)" in ex.quiesce.error
    assert ex.health is not None and ex.health.ok and tokens(ex.health) == tokens(ex.warm_up)
    assert engine.calls.mock_calls == [*WARMUP, PAUSE, RELEASE, CONTINUE, *WARMUP]
    assert not engine.tokenizer_manager.dead


def test_dp_size_mismatch_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="gpusnap.adapters.engines.sglang.adapter"):
        SglangAdapter(FakeSglangEngine(dp_size=4))
    assert "server_args.dp_size is 4" in caplog.text
