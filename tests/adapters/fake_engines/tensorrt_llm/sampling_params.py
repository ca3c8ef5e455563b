"""``tensorrt_llm/sampling_params.py``: the ``SamplingParams`` fields gpusnap sets (upstream defaults)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SamplingParams:
    end_id: int | None = None
    max_tokens: int = 32
    min_tokens: int | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
