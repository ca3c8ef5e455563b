"""``sglang/srt/server_args.py``: the few ``ServerArgs`` fields the fake reads, with SGLang's names."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ServerArgs:
    model_path: str = "fake"
    tp_size: int = 1
    dp_size: int = 1
    device: str = "cpu"
    random_seed: int = 0
    enable_memory_saver: bool = False
    disable_cuda_graph: bool = False
    skip_tokenizer_init: bool = True
    log_level: str = "error"


@dataclasses.dataclass
class PortArgs:
    """SGLang's ZMQ IPC names; the fake carries one pipe end per scheduler instead."""

    scheduler_conn: Any = None
