"""``sglang/srt/managers/io_struct.py``: the request classes gpusnap and the fake use (SGLang 0.5 fields)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass
class GenerateReqInput:
    text: str | list[str] | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    rid: str | None = None
    routed_dp_rank: int | None = None
    stream: bool = False


@dataclasses.dataclass
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclasses.dataclass
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclasses.dataclass
class ReleaseMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclasses.dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


@dataclasses.dataclass
class ReleaseMemoryOccupationReqOutput:
    pass


@dataclasses.dataclass
class ResumeMemoryOccupationReqOutput:
    pass


@dataclasses.dataclass
class FlushCacheReqOutput:
    success: bool
    flushed_items: int = 0
    error_msg: str = ""
