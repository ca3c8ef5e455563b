"""Probe the named-buffer data path (gpusnap.adapters.buffers) on a GPU: write N tensors to files and
read them back, per variant (pinned slot kind, threads, chunk size, tensor layout), checking the bytes.

    python bench/buffers_probe.py --dir /dev/shm/probe [--layout chunks16g|llama8b] → JSON on stdout and
    bench/results/buffers-probe-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpusnap.adapters import buffers  # noqa: E402


def llama8b() -> dict[str, torch.Tensor]:
    """Tensors shaped like Llama-3-8B's parameters (bf16), random."""
    h, inter, vocab, kv = 4096, 14336, 128256, 1024
    shapes = {"embed": (vocab, h), "lm_head": (vocab, h), "norm": (h,)}
    for i in range(32):
        for name, shape in {
            "q": (h, h),
            "k": (kv, h),
            "v": (kv, h),
            "o": (h, h),
            "gate": (inter, h),
            "up": (inter, h),
            "down": (h, inter),
            "ln1": (h,),
            "ln2": (h,),
        }.items():
            shapes[f"l{i}.{name}"] = shape
    return {n: torch.randn(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}


def chunks16g() -> dict[str, torch.Tensor]:
    return {f"c{i}": torch.randint(0, 2**31 - 1, (1 << 26,), dtype=torch.int32, device="cuda") for i in range(64)}


def _pinned_slot(state: dict[str, Any], device: Any) -> tuple[Any, Any, memoryview]:
    """Variant: slots from torch's caching host allocator (pin_memory=True)."""
    if "slot" not in state:
        state["slot"] = torch.empty(buffers.CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        state["view"] = buffers._memory(state["slot"])
        state["streams"] = {}
    if device not in state["streams"]:
        state["streams"][device] = torch.cuda.Stream(device=device)
    return state["slot"], state["streams"][device], state["view"]


def _pinned_release(state: dict[str, Any]) -> None:
    state.pop("slot", None)
    state.pop("view", None)


def run(tensors: dict[str, torch.Tensor], d: Path, threads: int) -> dict[str, float]:
    bufs = buffers.collect(tensors)
    total = sum(b.nbytes for b in bufs)
    sums = [float(t.float().sum()) for t in tensors.values()]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    fds = [os.open(d / f"b{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(len(bufs))]
    try:
        t0 = time.monotonic()
        buffers.write(bufs, fds, threads)
        t1 = time.monotonic()
        buffers.free(bufs)
        t2 = time.monotonic()
        buffers.read(bufs, fds, threads)
        torch.cuda.synchronize()
        t3 = time.monotonic()
    finally:
        for fd in fds:
            os.close(fd)
    ok = sums == [float(t.float().sum()) for t in tensors.values()]
    return {
        "bytes": total,
        "buffers": len(bufs),
        "write_s": t1 - t0,
        "free_s": t2 - t1,
        "read_s": t3 - t2,
        "write_gb_s": total / 1e9 / (t1 - t0),
        "read_gb_s": total / 1e9 / (t3 - t2),
        "same_bytes": ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/dev/shm/gpusnap-probe")
    ap.add_argument("--layouts", default="chunks16g,llama8b")
    ap.add_argument("--threads", default="4,8,12")
    ap.add_argument("--slots", default="registered,torch-pinned")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    results = []
    registered = (buffers._slot, buffers._release_slot)
    for layout in args.layouts.split(","):
        tensors = {"chunks16g": chunks16g, "llama8b": llama8b}[layout]()
        for slot in args.slots.split(","):
            buffers._slot, buffers._release_slot = (
                registered if slot == "registered" else (_pinned_slot, _pinned_release)
            )
            for threads in (int(t) for t in args.threads.split(",")):
                r = {"layout": layout, "slot": slot, "threads": threads, **run(tensors, Path(args.dir), threads)}
                print(json.dumps(r), flush=True)
                results.append(r)
        del tensors
        torch.cuda.empty_cache()
    shutil.rmtree(args.dir, ignore_errors=True)
    doc = {
        "benchmark": "buffers-probe",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "dir": args.dir,
        "runs": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"buffers-probe-{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
