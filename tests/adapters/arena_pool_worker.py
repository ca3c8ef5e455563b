"""A worker whose device memory besides its weights is in gpusnap's arenas (``gpusnap.adapters.vmm_pool``), as an
engine with gpusnap's hooks has it: a CUDA graph pool (KEEP), persistent buffers (KEEP) and a workspace (SCRATCH).

    python arena_pool_worker.py WORKDIR [--cuda] [--graphs-as-scratch] [--poison BYTE] [--n N]

One decode step (the "graph"): ``ws = W @ x`` (the workspace, written whole before it is read), ``inter = ws *
table + offs``, ``out = tanh(inter)``; the token is ``argmax(out)``, and ``x`` (the input buffer) is rolled by it
before the next step. ``table``, ``inter`` and ``out`` live in the graph pool; ``table`` is written once, when
the graph is captured, and never by a replay: the kind of state SGLang's replays read as garbage once the pool
was dropped (sgl-project/sglang PR #32718). ``offs`` (written once, like an ``arange`` table) and ``x`` are
persistent buffers, moved into an arena before the capture.

With ``--cuda`` the step is a CUDA graph captured into the pool's ``torch.cuda.MemPool`` and replayed. Without
it the fake VMM driver (tests/fakes/cuda_vmm.py: arenas are host memory) stands in, the pool's segments come
from its C allocator called as torch calls it, and the step runs over the same tensors at the same addresses,
which is what a replay does. ``--graphs-as-scratch`` makes the graph pool SCRATCH (released unsaved): the
negative control, whose tokens change after a restore. ``--poison BYTE`` fills scratch memory with BYTE when it is
mapped again.

WORKDIR/go-N: 8 tokens → WORKDIR/tokens-N (JSON: ``tokens``; ``addresses`` of the weights, each arena and each
tensor; ``ws_poisoned``: at the last resume the workspace held only the poison byte, before the canary's replays; ``maps``: per arena, how
often the fake driver mapped memory at its address). WORKDIR/layout (at start): bytes per region and the KEEP
bytes a capture saves. WORKDIR/events: the adapter's calls.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.fakes

from gpusnap.adapters import start_agent, vmm  # noqa: E402
from gpusnap.adapters.engines.torch.adapter import TorchAdapter  # noqa: E402
from gpusnap.adapters.vmm_pool import ALLOC_FN, ArenaPool, Policy, Regions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--graphs-as-scratch", action="store_true")
    ap.add_argument("--poison", type=lambda v: int(v, 0), default=None)
    ap.add_argument("--n", type=int, default=2048)
    args = ap.parse_args()
    wd = Path(args.workdir)
    drv: Any = None
    if not args.cuda:
        from tests.fakes.cuda_vmm import FakeVmmDriver

        drv = FakeVmmDriver(capacity=1 << 30)
        vmm.set_default_driver(drv)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    n = args.n
    gen = torch.Generator().manual_seed(7)
    regions = Regions()

    def log(what: str) -> None:
        with open(wd / "events", "a") as fh:
            fh.write(what + "\n")

    w = torch.randn(n, n, generator=gen).to(device) / n**0.5
    weights = vmm.stabilize({"w": w})
    graphs = ArenaPool("graphs", Policy.SCRATCH if args.graphs_as_scratch else Policy.KEEP)
    regions.add("graphs", graphs.policy, graphs)
    if args.cuda:
        mem = graphs.mem_pool()

        def pool_tensor() -> torch.Tensor:
            with torch.cuda.use_mem_pool(mem):
                return torch.empty(n, device=device)
    else:
        alloc = ALLOC_FN(graphs.function_pointers[0])

        def pool_tensor() -> torch.Tensor:
            ptr = int(alloc(n * 4, 0, None) or 0)  # as torch's caching allocator asks for a segment
            assert ptr, "the pool gave no segment"
            arena = vmm.arena_of(ptr)
            assert arena is not None
            return arena.bytes_tensor(ptr, n * 4).view(torch.float32)

    table, inter, out = pool_tensor(), pool_tensor(), pool_tensor()
    offs = (torch.arange(n, dtype=torch.float32) * 1e-3).to(device)
    x = torch.zeros(n, device=device)
    ws = torch.empty(n, device=device)
    state = vmm.stabilize({"offs": offs, "x": x})
    regions.add("state", Policy.KEEP, state.arenas)
    scratch = vmm.stabilize({"ws": ws})
    regions.add("workspaces", Policy.SCRATCH, scratch.arenas)

    def step() -> None:
        torch.matmul(w, x, out=ws)
        torch.mul(ws, table, out=inter)
        inter.add_(offs)
        torch.tanh(inter, out=out)

    table.copy_(torch.rand(n, generator=gen).to(device) * 4 - 2)  # capture-time state, never written again
    if args.cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # torch's warm-up before a capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mem.id):
            step()
        replay = graph.replay
    else:
        replay = step
    lock = threading.Lock()
    seen = {"ws_poisoned": False}  # at the last resume, before the canary's replays

    def generate(prompt: list[int], steps: int) -> list[int]:
        x.zero_()
        for p in prompt:
            x[p % n] = 1.0
        tokens = []
        for _ in range(steps):
            replay()
            token = int(torch.argmax(out))
            tokens.append(token)
            x.copy_(torch.roll(x, token + 1))
        return tokens

    def quiesce() -> None:
        lock.acquire()
        if args.cuda:
            torch.cuda.synchronize()
        log(f"quiesce scratch_released={regions.release_scratch()}")

    def resume(ctx: object) -> None:
        regions.remap_scratch(args.poison)
        seen["ws_poisoned"] = args.poison is not None and bool((ws.view(torch.uint8) == args.poison).all())
        log(f"resume restored={ctx is not None}")
        lock.release()

    adapter = TorchAdapter(
        lambda: generate([1, 5, 6, 7], 2),
        quiesce=quiesce,
        resume=resume,
        buffers=lambda: {"w": w, **regions.buffers("r0")},
    )
    keep = sum(t.untyped_storage().nbytes() for t in regions.buffers("r0").values())
    layout = {"regions": regions.describe(), "keep_bytes": keep, "weight_bytes": w.untyped_storage().nbytes()}
    (wd / "layout").write_text(json.dumps(layout))
    arenas = {
        "weights": weights.arenas[0],
        "state": state.arenas[0],
        "workspaces": scratch.arenas[0],
        **{f"graphs.{i}": a for i, a in enumerate(graphs.arenas())},
    }
    agent = start_agent(adapter)
    agent.wait_attached(30)
    (wd / "ready").touch()
    served = 1
    while True:
        if (wd / f"go-{served}").exists():
            with lock:
                tokens = generate([3, 1, 4, 1, 5], 8)
                addresses = {k: a.ptr for k, a in arenas.items()}
                addresses.update({k: t.data_ptr() for k, t in (("w", w), ("table", table), ("offs", offs), ("ws", ws))})
                maps = (
                    {
                        k: sum(1 for c, a in drv.calls if c == "cuMemMap" and a[0] == arena.ptr)
                        for k, arena in arenas.items()
                    }
                    if drv is not None
                    else {}
                )
            tmp = wd / f"tokens-{served}.tmp"
            tmp.write_text(
                json.dumps({"tokens": tokens, "addresses": addresses, "ws_poisoned": seen["ws_poisoned"], "maps": maps})
            )
            os.rename(tmp, wd / f"tokens-{served}")
            served += 1
        time.sleep(0.005)


if __name__ == "__main__":
    main()
