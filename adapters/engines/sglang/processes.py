"""The adapters of SGLang's processes: the front end (tokenizer manager) and each scheduler.

SGLang's layout (``python/sglang/srt/entrypoints/engine.py``, ``Engine._launch_subprocesses``; SGLang 0.5,
docs/engines.md): the front-end process (the HTTP server, or your ``sgl.Engine``) holds the
``TokenizerManager``; it starts, with ``multiprocessing`` in ``spawn`` mode, one scheduler process per
TP/PP rank (``run_scheduler_process``, titled ``sglang::scheduler`` plus ``_DP<d>``/``_TP<r>``…; with
``dp_size > 1`` through a ``sglang::data_parallel_controller`` process) and a ``sglang::detokenizer``. The
schedulers hold the model and its KV cache; the detokenizer and the controller hold no engine state.

- **front end** (:class:`SglangFrontEnd`): warm-up per DP rank, then ``pause_generation(mode="abort")`` and
  ``release_memory_occupation(tags=["kv_cache"])`` through the tokenizer manager, which every scheduler
  carries out in its own event loop (``torch_memory_saver``'s ``kv_cache`` region); resume undoes both, last.
  Its hello names the scheduler processes (``expect_pids``), each of which must have an agent.
- **scheduler** (:class:`SglangSchedulerAdapter`): checks at quiesce that it holds no request and that its KV
  cache is released (``Scheduler.offload_tags``), and names the model's weights as buffers, which the daemon
  keeps in its buffer store (:func:`gpusnap.adapters.engine_process.graph_plan`: not while CUDA graphs read
  them, i.e. unless ``--disable-cuda-graph``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gpusnap.adapters.base import HelloFacts
from gpusnap.adapters.engine_process import ModelProcessAdapter, process_title, titled
from gpusnap.adapters.engines.sglang.adapter import SglangAdapter

SCHEDULER_TITLE = "sglang::scheduler"
"""Prefix of the scheduler processes' titles (``configure_scheduler_process`` in ``managers/scheduler.py``)."""
KV_CACHE = "kv_cache"


class TokenizerFrontEnd:
    """What :class:`~gpusnap.adapters.engines.sglang.adapter.SglangAdapter` needs of ``sgl.Engine``, over the tokenizer manager
    alone (the HTTP server has no ``Engine``): ``Engine.async_generate`` builds a ``GenerateReqInput`` and awaits
    the first item of ``tokenizer_manager.generate_request(obj, None)``.

    Args:
        tokenizer_manager: the process's ``TokenizerManager``.
    """

    def __init__(self, tokenizer_manager: Any):
        self.tokenizer_manager = tokenizer_manager
        self.server_args = tokenizer_manager.server_args

    async def async_generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        routed_dp_rank: int | None = None,
    ) -> Any:
        from sglang.srt.managers.io_struct import GenerateReqInput

        extra = {} if routed_dp_rank is None else {"routed_dp_rank": routed_dp_rank}
        obj = GenerateReqInput(input_ids=input_ids, sampling_params=sampling_params, rid=rid, **extra)
        return await self.tokenizer_manager.generate_request(obj, None).__anext__()


class SglangFrontEnd(SglangAdapter):
    """The front end's adapter: :class:`SglangAdapter` over the tokenizer manager, naming the schedulers.

    Args:
        tokenizer_manager: the process's ``TokenizerManager`` (``server_args`` gives ``dp_size``).
    """

    def __init__(self, tokenizer_manager: Any):
        dp = int(getattr(tokenizer_manager.server_args, "dp_size", 1) or 1)
        super().__init__(TokenizerFrontEnd(tokenizer_manager), dp_size=dp)

    def info(self) -> HelloFacts:
        schedulers = titled(descendants(os.getpid()), SCHEDULER_TITLE)
        return dataclasses.replace(
            super().info(), role="frontend", process=process_title(), expect_pids=tuple(schedulers)
        )


class SglangSchedulerAdapter(ModelProcessAdapter):
    """The adapter of one scheduler process (``sglang.srt.managers.scheduler.Scheduler``).

    Args:
        scheduler: the scheduler; the adapter reads ``tp_rank``, ``dp_rank``, ``server_args``, ``offload_tags``,
            ``_is_no_request()`` and ``tp_worker.model_runner.model``.
    """

    engine = "sglang"
    remedy = "start SGLang with --disable-cuda-graph to offload them"

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler

    @property
    def rank(self) -> str:
        dp = getattr(self.scheduler, "dp_rank", None)
        return ("" if dp is None else f"dp{dp}.") + f"tp{int(getattr(self.scheduler, 'tp_rank', 0))}"

    @property
    def model(self) -> Any:
        return self.scheduler.tp_worker.model_runner.model

    def graphs(self) -> bool:
        return not bool(getattr(self.scheduler.server_args, "disable_cuda_graph", False))

    async def quiesce(self) -> None:
        """Refuse unless the front end's pause and KV release reached this scheduler."""
        if not self.scheduler._is_no_request():
            raise RuntimeError(f"SGLang scheduler {self.rank} still holds requests after the front end's pause")
        if KV_CACHE not in getattr(self.scheduler, "offload_tags", ()):
            raise RuntimeError(
                f"SGLang scheduler {self.rank} still holds its KV cache: the front end's "
                "release_memory_occupation did not reach it (start SGLang with --enable-memory-saver)"
            )


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (``/proc/<pid>/task/<tid>/children``, walked down); gone ones are skipped."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as fh:
                    kids = [int(c) for c in fh.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(kids)
            todo.extend(kids)
    return found
