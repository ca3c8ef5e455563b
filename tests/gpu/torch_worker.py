"""A PyTorch process holding GPU memory, for GPU checkpoint/restore tests (run as a script).

    python torch_worker.py WORKDIR --gib N [--device I] [--agent [--stable]]

- fills N GiB of device memory with a known pattern and writes its checksum to WORKDIR/expected;
- captures a CUDA graph (y = x * 3 + 1 over a 64 MiB buffer) and writes its result checksum too;
- keeps launching small kernels and appends a counter to WORKDIR/ticks;
- on SIGUSR1 re-reads the device memory, replays the graph and writes WORKDIR/now
  ("<pattern checksum> <graph checksum> <device uuid>").
WORKDIR/ready appears once all of that runs.

With ``--agent`` it attaches the gpusnap agent (PyTorch adapter) and names the pattern chunks as buffers,
so a capture keeps them out of the image; the canary is the pattern checksum, so a restore whose buffers
came back wrong fails its canary. ``--stable`` moves the chunks into an address-stable arena
(``gpusnap.adapters.vmm.stabilize``) before any graph is captured, and captures a second CUDA graph that
reads them (an int64 sum of a sample of every chunk): its result, the third field of WORKDIR/expected and
WORKDIR/now, is right after a restore only if the chunks came back at the same addresses with the same bytes.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import torch

CHUNK = 1 << 28  # 256 MiB of int32 per tensor


def pattern(i: int, n: int, device: torch.device) -> torch.Tensor:
    return (
        (torch.arange(n, dtype=torch.int64, device=device) * 2654435761 + i * 97).remainder(2**31 - 1).to(torch.int32)
    )


def checksum(chunks: list[torch.Tensor]) -> int:
    return int(sum(int(c.to(torch.int64).sum().item()) for c in chunks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--agent", action="store_true")
    ap.add_argument("--stable", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    total = int(args.gib * 2**30) // 4
    chunks = []
    i = 0
    while total > 0:
        n = min(CHUNK // 4, total)
        chunks.append(pattern(i, n, dev))
        total -= n
        i += 1
    wgraph = None
    if args.stable:
        from gpusnap.adapters import vmm

        vmm.stabilize({f"chunk{i}": c for i, c in enumerate(chunks)})
        wsum = torch.zeros(1, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph, as torch requires
            wsum.copy_(torch.stack([c[: 1 << 20].to(torch.int64).sum() for c in chunks]).sum().reshape(1))
        torch.cuda.current_stream().wait_stream(side)
        wgraph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(wgraph):
            wsum.copy_(torch.stack([c[: 1 << 20].to(torch.int64).sum() for c in chunks]).sum().reshape(1))

    def weights_graph() -> str:
        if wgraph is None:
            return ""
        wsum.zero_()
        wgraph.replay()
        torch.cuda.synchronize()
        return f" {int(wsum.item())}"

    static_x = torch.linspace(0, 1, 16 << 20, device=dev)
    static_y = torch.empty_like(static_x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            static_y.copy_(static_x * 3 + 1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y.copy_(static_x * 3 + 1)
    graph.replay()
    torch.cuda.synchronize()
    graph_sum = float(static_y.double().sum().item())
    wd = args.workdir
    with open(os.path.join(wd, "expected"), "w") as fh:
        fh.write(f"{checksum(chunks)} {graph_sum:.6f}{weights_graph()}")

    lock = threading.Lock()
    if args.agent:
        from gpusnap.adapters import start_agent
        from gpusnap.adapters.engines.torch.adapter import TorchAdapter

        def quiesce() -> None:  # released by resume: no kernels while captured
            lock.acquire()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        adapter = TorchAdapter(
            lambda: [checksum(chunks) % (2**31 - 1)],
            quiesce=quiesce,
            resume=lambda ctx: lock.release(),
            buffers=lambda: {f"chunk{i}": c for i, c in enumerate(chunks)},
        )
        start_agent(adapter).wait_attached(60)
    requested = {"now": False}
    signal.signal(signal.SIGUSR1, lambda *_: requested.__setitem__("now", True))
    ticks = open(os.path.join(wd, "ticks"), "a", buffering=1)
    open(os.path.join(wd, "ready"), "w").close()
    counter = 0
    work = torch.ones(1 << 20, device=dev)
    while True:
        with lock:  # quiesce holds it: no kernels while captured
            counter += 1
            work.mul_(1.0)
            torch.cuda.synchronize()
            ticks.write(f"{counter}\n")
            if requested["now"]:
                requested["now"] = False
                static_y.zero_()
                graph.replay()
                torch.cuda.synchronize()
                now_uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                with open(os.path.join(wd, "now.tmp"), "w") as fh:
                    graphs = f"{float(static_y.double().sum().item()):.6f}{weights_graph()}"
                    fh.write(f"{checksum(chunks)} {graphs} {now_uuid}")
                os.rename(os.path.join(wd, "now.tmp"), os.path.join(wd, "now"))
        time.sleep(0.05)


if __name__ == "__main__":
    main()
