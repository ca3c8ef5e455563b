"""Fakes of TensorRT-LLM's ``LLM`` and SGLang's ``Engine`` with their real signatures, and a fake daemon.

These are in-process, call-order fakes for the adapters' unit tests; the engines' multi-process layouts
(SGLang's schedulers, TensorRT-LLM's executor workers, one gpusnap agent in each) are faked in
``tests/adapters/fake_engines/`` and captured through the daemon in ``test_fake_engines_cpu.py``.

Neither engine runs on gpusnap's CPU hosts (docs/engines.md, "What is tested, and where"), so the adapters are tested against
these fakes, in Dynamo's style: every engine call is recorded on one parent :class:`unittest.mock.Mock`
(``fake.calls``), and tests compare ``fake.calls.mock_calls`` with the exact expected sequence. A call is
recorded with its positional parameters and every keyword parameter that differs from the upstream default
(plus the ones listed in ``always``), so an extra or misspelt argument shows up.

Signatures mirrored (main branches, checked for gpusnap's adapters):

- TensorRT-LLM 1.3–1.4: ``tensorrt_llm/llmapi/llm.py`` (``LLM.generate_async``, ``LLM._collective_rpc``),
  ``tensorrt_llm/executor/base_worker.py`` (``BaseWorker.sleep/wakeup``), ``tensorrt_llm/executor/result.py``
  (``GenerationResult.aresult/abort``), ``tensorrt_llm/sampling_params.py`` (``SamplingParams``), 1.4's
  ``LLM.release/resume/get_memory_status`` and ``tensorrt_llm/_torch/async_llm.py`` (``AsyncLLM``).
- SGLang 0.5.x: ``python/sglang/srt/entrypoints/engine.py`` (``Engine.async_generate``, the sync
  ``release_memory_occupation``/``resume_memory_occupation``/``flush_cache`` wrappers),
  ``managers/tokenizer_manager.py`` (``pause_generation``/``continue_generation``),
  ``managers/tokenizer_communicator_mixin.py`` (``release_memory_occupation(obj, request=None)``, ``flush_cache()``)
  and ``managers/io_struct.py`` (request classes).

:func:`install_fake_engine_modules` puts fake ``tensorrt_llm``, ``tensorrt_llm.llmapi`` and
``sglang.srt.managers.io_struct`` modules into ``sys.modules`` so the adapters' lazy imports find these
classes. :func:`capture_roundtrip` drives an adapter through the real :class:`WorkerAgent` against a
:class:`FakeDaemon` on a Unix socket.
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import socket
import tempfile
import threading
import types
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from unittest import mock

import pytest

from gpusnap.adapters.agent import WorkerAgent
from gpusnap.adapters.base import EngineAdapter
from gpusnap.adapters.contract import wire
from gpusnap.adapters.contract._proto import agent_pb2

T = TypeVar("T")

HANG_S = 3600.0


def _record(method: Any, func: Callable[..., Any], values: dict[str, Any], always: Iterable[str] = ()) -> None:
    """Record a call of ``func`` on ``method``: required parameters positionally, others when not default."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(func).parameters.items():
        if name == "self":
            continue
        value = values[name]
        if param.default is inspect.Parameter.empty:
            args.append(value)
        elif name in always or value is not param.default and value != param.default:
            kwargs[name] = value
    method(*args, **kwargs)


def _greedy_tokens(weights: int, prompt: Iterable[int], n: int) -> list[int]:
    """Deterministic "model": the tokens depend on the weights and the prompt only."""
    h = weights
    for t in prompt:
        h = (h * 1_000_003 + int(t)) % 2_147_483_647
    return [(h >> (3 * i)) % 32_000 for i in range(n)]


def _running_loop_guard(name: str) -> None:
    """SGLang's sync Engine wrappers call ``self.loop.run_until_complete``, which fails inside a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"Engine.{name}: This event loop is already running")


@dataclass
class Faults:
    """Fault injection: an exception to raise in a call, or a hang."""

    sleep: BaseException | None = None
    sleep_after_release: bool = False
    """Raise ``sleep`` only after the memory was released (a release that failed half-way)."""
    wakeup: BaseException | None = None
    release: BaseException | None = None
    resume: BaseException | None = None
    pause_hang: bool = False
    generate_hang: bool = False


# =========================================================================================== TensorRT-LLM


@dataclass
class SamplingParams:
    """``tensorrt_llm.sampling_params.SamplingParams`` (fields the adapter may set, upstream defaults)."""

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop_token_ids: list[int] | None = None
    n: int = 1
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")


@dataclass
class CompletionOutput:
    """``tensorrt_llm.executor.result.CompletionOutput``."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class FakeRequestOutput:
    """``RequestOutput`` / ``GenerationResult``: ``await``-able, ``aresult()``, ``abort()``, ``outputs``."""

    def __init__(self, llm: FakeTrtLlm, request_id: int, prompt_token_ids: list[int], tokens: list[int], hang: bool):
        self._llm = llm
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(index=0, token_ids=tokens, finish_reason="length")]
        self._hang = hang
        self.aborted = False

    async def aresult(self) -> FakeRequestOutput:
        if self._hang:
            await asyncio.sleep(HANG_S)
        return self

    def __await__(self) -> Any:
        return self.aresult().__await__()

    def abort(self) -> None:
        self.aborted = True
        self._llm.calls.abort(self.request_id)


TRT_MEMORY_TAGS = (
    "model",
    "draft_model",
    "model_weights",
    "draft_model_weights",
    "kv_cache",
    "executor_extra",
    "model_extra",
    "sampler",
    "drafter",
    "guided_decoder",
)
"""``ExecutorMemoryType`` values (``tensorrt_llm/llmapi/llm_args.py``; the set varies between releases)."""


class FakeTrtLlm:
    """``tensorrt_llm.LLM`` 1.2–1.3 (PyTorch backend, ``sleep_config`` set, world size 1): no public release API.

    ``released`` holds the released tags; ``generate_async`` fails while ``kv_cache`` is released, ``sleep``
    rejects unknown tags, ``wakeup`` fails for memory that is not released.
    """

    def __init__(self, calls: mock.Mock | None = None, *, weights: int = 7):
        self.calls = calls if calls is not None else mock.Mock()
        self.weights = weights
        self.released: set[str] = set()
        self.faults = Faults()
        self.requests: list[FakeRequestOutput] = []

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        trace_headers: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        conversation_params: Any = None,
        cache_salt: str | None = None,
        priority: float = 0.5,
    ) -> FakeRequestOutput:
        _record(self.calls.generate_async, FakeTrtLlm.generate_async, locals())
        self._admit()
        if "kv_cache" in self.released:
            raise RuntimeError("generate_async while the KV cache is released")
        params = sampling_params or SamplingParams()
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        out = FakeRequestOutput(
            self,
            len(self.requests),
            prompt,
            _greedy_tokens(self.weights, prompt, params.max_tokens),
            hang=self.faults.generate_hang,
        )
        self.requests.append(out)
        return out

    def _admit(self) -> None:
        """Admission control; the sync LLM has none."""

    def _collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        target_ranks: int | list[int] | None = None,
    ) -> list[Any]:
        _record(
            self.calls._collective_rpc, FakeTrtLlm._collective_rpc, locals(), always=("args", "kwargs", "non_block")
        )
        worker = {"sleep": self._worker_sleep, "wakeup": self._worker_wakeup}.get(method)
        if worker is None:
            raise AttributeError(f"'BaseWorker' object has no attribute {method!r}")
        return [worker(*args, **(kwargs or {}))]

    # BaseWorker.sleep(sleep_tags: List[str]) / wakeup(wakeup_tags: List[str]), inside control_action()
    def _worker_sleep(self, sleep_tags: list[str]) -> None:
        unknown = [t for t in sleep_tags if t not in TRT_MEMORY_TAGS]
        if unknown:
            raise ValueError(f"Unknown memory tag '{unknown[0]}'.")
        if self.faults.sleep is not None and not self.faults.sleep_after_release:
            raise self.faults.sleep
        self.released |= set(sleep_tags)
        if self.faults.sleep is not None:
            raise self.faults.sleep

    def _worker_wakeup(self, wakeup_tags: list[str]) -> None:
        if self.faults.wakeup is not None:
            raise self.faults.wakeup
        missing = [t for t in wakeup_tags if t not in self.released]
        if missing:
            raise RuntimeError(f"materialize_with_tag: memory tagged {missing[0]!r} is not released")
        self.released -= set(wakeup_tags)

    def shutdown(self) -> None:
        self.calls.shutdown()


class FakeTrtLlmPublic(FakeTrtLlm):
    """``tensorrt_llm.LLM`` 1.4: adds ``release(tags=None)``, ``resume(tags=None)``, ``get_memory_status()``."""

    def release(self, tags: list[str] | None = None) -> None:
        _record(self.calls.release, FakeTrtLlmPublic.release, locals())
        self._worker_sleep(list(tags) if tags is not None else ["kv_cache", "model", "executor_extra"])

    def resume(self, tags: list[str] | None = None) -> None:
        _record(self.calls.resume, FakeTrtLlmPublic.resume, locals())
        wanted = list(tags) if tags is not None else sorted(self.released)  # no tags: whatever is parked
        if wanted:
            self._worker_wakeup(wanted)

    def get_memory_status(self) -> Any:
        self.calls.get_memory_status()
        return types.SimpleNamespace(state="parked" if self.released else "running", parked_tags=sorted(self.released))


class FakeAsyncLlm(FakeTrtLlmPublic):
    """``tensorrt_llm.AsyncLLM`` (1.4): async ``release``/``resume``, ``pause_generation``/``resume_generation``."""

    def __init__(self, calls: mock.Mock | None = None, *, weights: int = 7):
        super().__init__(calls, weights=weights)
        self.paused = False

    def _admit(self) -> None:
        if self.paused:
            raise RuntimeError("AsyncLLM is paused. Call resume_generation() before submitting new requests.")

    async def release(self, tags: list[str] | None = None) -> None:  # type: ignore[override]
        FakeTrtLlmPublic.release(self, tags)

    async def resume(self, tags: list[str] | None = None) -> None:  # type: ignore[override]
        FakeTrtLlmPublic.resume(self, tags)

    async def pause_generation(self) -> None:
        self.calls.pause_generation()
        self.paused = True
        if self.faults.pause_hang:
            await asyncio.sleep(HANG_S)

    async def resume_generation(self) -> None:
        self.calls.resume_generation()
        self.paused = False


# ================================================================================================ SGLang


@dataclass
class PauseGenerationReqInput:
    """``sglang.srt.managers.io_struct.PauseGenerationReqInput``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"

    def __post_init__(self) -> None:
        if self.mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"Invalid mode: {self.mode!r}. Expected one of ['abort', 'retract', 'in_place'].")


@dataclass
class ContinueGenerationReqInput:
    """``ContinueGenerationReqInput`` (newer releases add ``torch_empty_cache``)."""

    torch_empty_cache: bool = True


@dataclass
class ReleaseMemoryOccupationReqInput:
    """``ReleaseMemoryOccupationReqInput``: ``tags`` None means all of ``SGLANG_MEMORY_TAGS``."""

    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqInput:
    """``ResumeMemoryOccupationReqInput``."""

    tags: list[str] | None = None


@dataclass
class FlushCacheReqOutput:
    """``FlushCacheReqOutput``."""

    success: bool
    flushed_items: int = 0
    error_msg: str = ""


SGLANG_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""``sglang/srt/constants.py`` GPU memory types."""


class FakeTokenizerManager:
    """The engine's ``tokenizer_manager`` with the scheduler's memory bookkeeping folded in.

    ``release_memory_occupation`` asserts the scheduler is idle (paused, nothing in flight), as the real
    scheduler does; ``resume_memory_occupation`` of a tag that is not released raises ``KeyError`` (in
    SGLang this kills the scheduler subprocess, so ``dead`` is set).
    """

    def __init__(self, engine: FakeSglangEngine):
        self._engine = engine
        self.calls = engine.calls.tokenizer_manager
        self.is_pause = False
        self.in_flight = 0
        self.released: set[str] = set()
        self.dead = False

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.calls.pause_generation(obj)
        self.is_pause = True
        if self._engine.faults.pause_hang:
            await asyncio.sleep(HANG_S)
        while self.in_flight:  # mode="abort": abort everything, poll until drained
            await asyncio.sleep(0.001)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.calls.continue_generation(obj)
        self.is_pause = False

    async def release_memory_occupation(self, obj: ReleaseMemoryOccupationReqInput, request: Any = None) -> None:
        _record(
            self.calls.release_memory_occupation,
            FakeTokenizerManager.release_memory_occupation,
            locals(),
            always=("request",),
        )
        if not self.is_pause or self.in_flight:
            raise AssertionError("release_memory_occupation: the scheduler is not idle")
        if self._engine.faults.release is not None:
            raise self._engine.faults.release
        self.released |= set(obj.tags if obj.tags is not None else SGLANG_MEMORY_TAGS)

    async def resume_memory_occupation(self, obj: ResumeMemoryOccupationReqInput, request: Any = None) -> None:
        _record(
            self.calls.resume_memory_occupation,
            FakeTokenizerManager.resume_memory_occupation,
            locals(),
            always=("request",),
        )
        if self._engine.faults.resume is not None:
            raise self._engine.faults.resume
        for tag in obj.tags if obj.tags is not None else SGLANG_MEMORY_TAGS:
            if tag not in self.released:
                self.dead = True
                raise KeyError(tag)
            self.released.remove(tag)

    async def flush_cache(self) -> FlushCacheReqOutput:
        self.calls.flush_cache()
        if self.in_flight:
            return FlushCacheReqOutput(success=False, error_msg="Cache not flushed because there are pending requests.")
        return FlushCacheReqOutput(success=True)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        _record(self.calls.abort_request, FakeTokenizerManager.abort_request, locals())


class FakeSglangEngine:
    """``sglang.Engine`` (``enable_memory_saver=True``)."""

    def __init__(self, calls: mock.Mock | None = None, *, dp_size: int = 1, weights: int = 11):
        self.calls = calls if calls is not None else mock.Mock()
        self.server_args = types.SimpleNamespace(dp_size=dp_size, enable_memory_saver=True)
        self.weights = weights
        self.faults = Faults()
        self.warnings: list[str] = []
        self.tokenizer_manager = FakeTokenizerManager(self)

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        return_logprob: bool | list[bool] | None = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        token_ids_logprob: Any = None,
        lora_path: Any = None,
        custom_logit_processor: Any = None,
        return_hidden_states: bool = False,
        return_routed_experts: bool = False,
        stream: bool = False,
        bootstrap_host: Any = None,
        bootstrap_port: Any = None,
        bootstrap_room: Any = None,
        routed_dp_rank: int | None = None,
        disagg_prefill_dp_rank: int | None = None,
        data_parallel_rank: int | None = None,
        external_trace_header: dict[str, Any] | None = None,
        rid: str | list[str] | None = None,
        session_params: dict[str, Any] | None = None,
        priority: int | None = None,
    ) -> dict[str, Any]:
        _record(self.calls.async_generate, FakeSglangEngine.async_generate, locals())
        tm = self.tokenizer_manager
        if routed_dp_rank is not None:  # Engine._resolve_routed_dp_rank
            dp = self.server_args.dp_size
            if dp <= 1 and routed_dp_rank == 0:
                self.warnings.append(f"routed_dp_rank={routed_dp_rank} is ignored because dp_size={dp}")
            elif not 0 <= routed_dp_rank < dp:
                raise ValueError(f"routed_dp_rank={routed_dp_rank} out of range [0, {dp})")
        while tm.is_pause:  # generate_request waits on is_pause_cond
            await asyncio.sleep(0.001)
        if tm.dead:
            raise RuntimeError("the scheduler subprocess is dead")
        if "kv_cache" in tm.released:
            raise RuntimeError("a request reached the scheduler while the KV cache is released")
        assert input_ids is not None and isinstance(sampling_params, dict)
        tm.in_flight += 1
        try:
            if self.faults.generate_hang:
                await asyncio.sleep(HANG_S)
            n = int(sampling_params.get("max_new_tokens", 128))
            tokens = _greedy_tokens(self.weights, input_ids, n)  # type: ignore[arg-type]
        finally:
            tm.in_flight -= 1
        return {
            "text": "",
            "output_ids": tokens,
            "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": n}},
        }

    # The synchronous wrappers (self.loop.run_until_complete(...)): unusable on the engine's loop.
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        _record(self.calls.release_memory_occupation, FakeSglangEngine.release_memory_occupation, locals())
        _running_loop_guard("release_memory_occupation")
        asyncio.run(self.tokenizer_manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        _record(self.calls.resume_memory_occupation, FakeSglangEngine.resume_memory_occupation, locals())
        _running_loop_guard("resume_memory_occupation")
        asyncio.run(self.tokenizer_manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None))

    def flush_cache(self) -> FlushCacheReqOutput:
        self.calls.flush_cache()
        _running_loop_guard("flush_cache")
        return asyncio.run(self.tokenizer_manager.flush_cache())

    def get_all_child_pids(self) -> list[int]:
        self.calls.get_all_child_pids()
        return []

    def shutdown(self) -> None:
        self.calls.shutdown()


# ======================================================================================= fake modules


def install_fake_engine_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tensorrt_llm``, ``tensorrt_llm.llmapi`` and ``sglang.srt.managers.io_struct`` resolve to the fakes."""

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so submodule imports work
        monkeypatch.setitem(__import__("sys").modules, name, mod)
        return mod

    llmapi = module("tensorrt_llm.llmapi", SamplingParams=SamplingParams, LLM=FakeTrtLlmPublic, AsyncLLM=FakeAsyncLlm)
    module("tensorrt_llm", SamplingParams=SamplingParams, LLM=FakeTrtLlmPublic, llmapi=llmapi)
    io_struct = module(
        "sglang.srt.managers.io_struct",
        PauseGenerationReqInput=PauseGenerationReqInput,
        ContinueGenerationReqInput=ContinueGenerationReqInput,
        ReleaseMemoryOccupationReqInput=ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput=ResumeMemoryOccupationReqInput,
        FlushCacheReqOutput=FlushCacheReqOutput,
    )
    managers = module("sglang.srt.managers", io_struct=io_struct)
    srt = module("sglang.srt", managers=managers)
    module("sglang", srt=srt, Engine=FakeSglangEngine)


def calls_between(calls: mock.Mock, start: Any, end: Any) -> list[Any]:
    """The recorded calls strictly between the first ``start`` and the first following ``end``."""
    seq = list(calls.mock_calls)
    i = seq.index(start)
    j = seq.index(end, i + 1)
    return seq[i + 1 : j]


# ===================================================================================== agent harness


class EngineLoop:
    """The engine's event loop, on its own thread; the agent runs adapter coroutines there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-engine-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()


class FakeDaemon:
    """The daemon's end of the agent channel (``proto/gpusnap/v1/agent.proto``) on a temporary Unix socket."""

    def __init__(self, timeout: float = 10.0):
        self.dir = Path(tempfile.mkdtemp(prefix="gsnap-"))  # short: Unix socket paths are limited to 108 bytes
        self.socket_path = self.dir / "agent.sock"
        self.wake_dir = self.dir / "wake"
        self.wake_dir.mkdir()
        self.timeout = timeout
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.socket_path))
        self.listener.listen(4)
        self.listener.settimeout(timeout)
        self.conn: socket.socket | None = None
        self._next_id = 0

    def accept(self) -> agent_pb2.AgentHello:
        """Accept the agent's connection and return its hello."""
        if self.conn is not None:
            self.conn.close()
        conn, _ = self.listener.accept()
        conn.settimeout(self.timeout)
        self.conn = conn
        msg = wire.recv(conn, agent_pb2.AgentMessage())
        assert msg.WhichOneof("message") == "hello", msg
        return msg.hello

    def command(self, **command: Any) -> agent_pb2.CommandResult:
        """Send one command (``warm_up=agent_pb2.WarmUp()``, …) and return the agent's result."""
        assert self.conn is not None
        self._next_id += 1
        wire.send(self.conn, agent_pb2.DaemonMessage(command_id=self._next_id, **command))
        msg = wire.recv(self.conn, agent_pb2.AgentMessage())
        assert msg.WhichOneof("message") == "result", msg
        assert msg.result.command_id == self._next_id
        return msg.result

    def expect_closed(self) -> None:
        """The agent closes the channel after a successful quiesce (no daemon socket in the image)."""
        assert self.conn is not None
        with pytest.raises(wire.ChannelClosed):
            wire.recv(self.conn, agent_pb2.AgentMessage())
        self.conn.close()
        self.conn = None

    def wake(self, instance_id: str) -> None:
        (self.wake_dir / instance_id).write_text("")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Exchange:
    """What the fake daemon saw in one capture round trip."""

    hello: agent_pb2.AgentHello
    warm_up: agent_pb2.CommandResult
    quiesce: agent_pb2.CommandResult
    resumed_hello: agent_pb2.AgentHello | None = None
    resume: agent_pb2.CommandResult | None = None
    health: agent_pb2.CommandResult | None = None
    """After a failed quiesce: a health command on the same connection (the worker must still serve)."""


def tokens(result: agent_pb2.CommandResult) -> list[int]:
    """The canary tokens of a CommandResult."""
    return list(result.tokens)


def capture_roundtrip(
    adapter: EngineAdapter,
    engine_loop: EngineLoop,
    *,
    restored: bool = True,
    values: dict[str, str] | None = None,
    during_capture: Callable[[], None] | None = None,
) -> Exchange:
    """Drive ``adapter`` through the real WorkerAgent: warm-up, quiesce, (capture), wake file, resume.

    ``during_capture`` runs while the worker is quiesced and disconnected (where the daemon would dump it).
    When quiesce fails, the agent stays connected and the daemon sends a health command instead.
    """
    daemon = FakeDaemon()
    agent = WorkerAgent(
        adapter, socket_path=str(daemon.socket_path), wake_dir=str(daemon.wake_dir), loop=engine_loop.loop
    )
    agent.start()
    try:
        hello = daemon.accept()
        warm = daemon.command(warm_up=agent_pb2.WarmUp())
        quiesce = daemon.command(quiesce=agent_pb2.Quiesce())
        ex = Exchange(hello=hello, warm_up=warm, quiesce=quiesce)
        if not quiesce.ok:
            ex.health = daemon.command(health=agent_pb2.Health())
            return ex
        daemon.expect_closed()
        if during_capture is not None:
            during_capture()
        daemon.wake(hello.instance_id)
        ex.resumed_hello = daemon.accept()
        context = agent_pb2.RestoreContext(values=values or {})
        ex.resume = daemon.command(resume=agent_pb2.Resume(restored=restored, context=context))
        return ex
    finally:
        agent.stop()
        daemon.close()
        agent._thread.join(5)
        assert not agent._thread.is_alive(), "the agent thread did not stop"
