"""The Offload batches: bounded in descriptors and bytes, so gpusnapd copies one while the worker writes the
next (issue 19, item 8: the worker writes into sealed memfds that gpusnapd copies)."""

from __future__ import annotations

from gpusnap.adapters.contract import wire
from gpusnap.daemon.weights.exchange import BATCH_BYTES, BATCHES, offload_batches

GIB = 1 << 30


def test_batches_split_a_model_by_bytes_and_descriptors() -> None:
    sizes = [256 << 20] * 64  # 16 GiB in 256 MiB tensors, as the GPU bench's worker
    batches = offload_batches(sizes)
    assert [i for b in batches for i in b] == list(range(64)), "every buffer once, in order"
    assert len(batches) == BATCHES and all(sum(sizes[i] for i in b) == 2 * GIB for b in batches)
    small = offload_batches([1 << 20] * 1000)  # 1000 small buffers: the descriptor bound cuts them
    assert all(len(b) <= wire.MAX_FDS for b in small) and sum(len(b) for b in small) == 1000
    assert offload_batches([3 * GIB, 1 << 20]) == [[0], [1]], "a buffer over the cap has a batch of its own"
    assert offload_batches([BATCH_BYTES // 2] * 2) == [[0, 1]]
