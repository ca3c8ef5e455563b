"""``tensorrt_llm/llmapi/llm_args.py``: ``SleepConfig`` and the ``TorchLlmArgs`` fields the fake reads."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SleepConfig:
    restore_modes: dict[str, str] | None = None


@dataclasses.dataclass
class CudaGraphConfig:
    batch_sizes: list[int] | None = None


@dataclasses.dataclass
class TorchLlmArgs:
    model: str = "fake"
    tensor_parallel_size: int = 1
    sleep_config: SleepConfig | None = None
    cuda_graph_config: Any = dataclasses.field(default_factory=CudaGraphConfig)
    skip_tokenizer_init: bool = True
    seed: int = 0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size
