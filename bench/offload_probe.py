"""Probe for issue 5's main lever: how fast GPU buffers can leave and re-enter the GPU through a RAM
file outside the CRIU image (``python3 bench/offload_probe.py --gib 16 --out DIR``; GPU machine).

Measures, for N GiB of device memory and a file in /dev/shm:
- d2h_to_shm: device → the mmap'd file (pageable), one stream;
- h2d_pageable_{1,4}: file → device from the pageable mapping, with 1 and 4 streams;
- host_register: cudaHostRegister of the mapping (pinning the pages), then h2d_pinned_4 with 4 streams;
and checks the data round-trips. Writes JSON to DIR/offload-probe-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

CHUNK = 256 << 20


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def copy_chunks(dst: torch.Tensor, src: torch.Tensor, streams: list[torch.cuda.Stream]) -> None:
    n = src.numel()
    for i, off in enumerate(range(0, n, CHUNK)):
        with torch.cuda.stream(streams[i % len(streams)]):
            dst[off : off + CHUNK].copy_(src[off : off + CHUNK], non_blocking=True)
    for s in streams:
        s.synchronize()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30)
    gpu = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    ref = int(gpu[:: 1 << 20].sum().item())
    path = Path(args.dir) / f"gpusnap-offload-probe-{os.getpid()}.bin"
    with open(path, "wb") as fh:
        fh.truncate(nbytes)
    host = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    res: dict[str, float] = {}
    res["d2h_to_shm_s"] = timed(lambda: host.copy_(gpu))  # noqa: F821 (called at once, before the del below)
    del gpu
    torch.cuda.empty_cache()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    res["h2d_pageable_1_s"] = timed(lambda: copy_chunks(dst, host, [torch.cuda.Stream()]))  # noqa: F821 (called at once, before the del below)
    dst.zero_()
    res["h2d_pageable_4_s"] = timed(lambda: copy_chunks(dst, host, [torch.cuda.Stream() for _ in range(4)]))  # noqa: F821 (called at once, before the del below)
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 0)
    res["host_register_s"] = time.perf_counter() - t0
    res["host_register_error"] = int(err)
    dst.zero_()
    res["h2d_pinned_4_s"] = timed(lambda: copy_chunks(dst, host, [torch.cuda.Stream() for _ in range(4)]))  # noqa: F821 (called at once, before the del below)
    ok = int(dst[:: 1 << 20].sum().item()) == ref
    cudart.cudaHostUnregister(host.data_ptr())
    del host
    path.unlink()
    gb = nbytes / 1e9
    out = {
        "benchmark": "offload-probe",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "gib": args.gib,
        "data_ok": ok,
        **res,
        **{
            k.removesuffix("_s") + "_gb_per_s": gb / v
            for k, v in res.items()
            if k.endswith("_s") and k != "host_register_s"
        },
    }
    print(json.dumps(out, indent=2))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"offload-probe-{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(
        json.dumps(out, indent=2) + "\n"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
