"""``tensorrt_llm/llmapi/llm.py``: ``LLM`` (PyTorch backend) over a ``GenerationExecutorProxy``.

``generate_async(inputs, sampling_params=None, …)`` returns a ``GenerationResult`` (``await``-able,
``aresult()``, ``outputs[0].token_ids``); ``_collective_rpc(method, args=(), kwargs=None, non_block=False,
unique_reply_rank=None, target_ranks=None)`` calls ``method`` on every executor worker and returns their
answers. No public ``release``/``resume`` (the 1.3 shape): gpusnap goes through ``_collective_rpc("sleep")``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tensorrt_llm.executor.proxy import GenerationExecutorProxy
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.sampling_params import SamplingParams


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""


class GenerationResult:
    def __init__(self, executor: GenerationExecutorProxy, prompt: list[int], params: SamplingParams):
        self._executor = executor
        self.prompt_token_ids = prompt
        self._params = params
        self.outputs: list[CompletionOutput] = []

    async def aresult(self) -> GenerationResult:
        tokens = await asyncio.to_thread(self._executor.generate, self.prompt_token_ids, self._params.max_tokens)
        self.outputs = [CompletionOutput(index=0, token_ids=tokens)]
        return self

    def __await__(self) -> Any:
        return self.aresult().__await__()

    def abort(self) -> None:
        pass


class LLM:
    def __init__(self, model: str, tokenizer: Any = None, **kwargs: Any):
        self.args = TorchLlmArgs(model=model, **kwargs)
        self.tokenizer = tokenizer
        self._executor = GenerationExecutorProxy(
            dict(engine=model, llm_args=self.args), model_world_size=self.args.world_size
        )

    def generate_async(
        self, inputs: Any, sampling_params: SamplingParams | None = None, streaming: bool = False
    ) -> GenerationResult:
        prompt = list(inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs)
        return GenerationResult(self._executor, prompt, sampling_params or SamplingParams())

    def _collective_rpc(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
        target_ranks: Any = None,
    ) -> list[Any]:
        return self._executor.collective_rpc(method, args, kwargs or {})

    def shutdown(self) -> None:
        self._executor.shutdown()
