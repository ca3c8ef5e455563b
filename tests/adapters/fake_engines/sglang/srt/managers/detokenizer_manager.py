"""``sglang/srt/managers/detokenizer_manager.py``: the ``sglang::detokenizer`` process; it holds no engine
state (the fake skips detokenisation: ``skip_tokenizer_init``)."""

from __future__ import annotations

import time
from typing import Any


def run_detokenizer_process(server_args: Any, port_args: Any) -> None:
    from fake_proc import die_with_parent, set_title

    die_with_parent()
    set_title("sglang::detokenizer")
    while True:
        time.sleep(3600)
