"""Probe for issue 12's RAM-tier levers: DMA straight between a tmpfs blob and the GPU, against the
buffers path gpusnap uses today (``python3 bench/dma_probe.py --gib 8 --out DIR``; GPU machine, root for
the huge-page tmpfs).

For each tmpfs kind (``/dev/shm`` with 4 KiB pages; a tmpfs mounted ``huge=always``, when it can be
mounted) it writes an N GiB blob and measures:

- reload: ``buffers.read`` (preadv → pinned slots → device, 12 threads) versus the blob ``mmap``ed
  read-only and ``cudaHostRegister``ed (``cudaHostRegisterReadOnly``), then copied host→device on 4
  streams straight from the page cache; registration, copy and unregistration timed apart;
- offload: ``buffers.write`` into a new file versus a ``fallocate``d, pre-faulted (``MAP_POPULATE``) and
  registered target written device→host by DMA.

The data is checked after each copy. Writes DIR/dma-probe-<date>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "build" / "pkg"))
sys.path.insert(0, str(REPO))

from bench.offload_probe import copy_chunks, timed  # noqa: E402  (256 MiB chunks over N streams)
from gpusnap.adapters import buffers  # noqa: E402

REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_POPULATE = 0x8000


def map_file(fd: int, n: int, prot: int, populate: bool = False) -> int:
    addr = _libc.mmap(None, n, prot, mmap.MAP_SHARED | (MAP_POPULATE if populate else 0), fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return int(addr)


def host_tensor(addr: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8)


def same(gpu: torch.Tensor, host: torch.Tensor) -> bool:
    step = 1 << 20
    return bool(torch.equal(gpu[::step].cpu(), host[::step]))


def probe(directory: Path, n: int, src: torch.Tensor) -> dict[str, object]:
    cudart = torch.cuda.cudart()
    res: dict[str, object] = {"dir": str(directory)}
    blob = directory / "blob"
    fd = os.open(blob, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        res["write_s"] = buffers.write([buffers.Buffer("b", src.untyped_storage(), n)], [fd])
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        res["read_first_s"] = timed(lambda: buffers.read([buffers.Buffer("b", dst.untyped_storage(), n)], [fd]))
        res["read_s"] = timed(lambda: buffers.read([buffers.Buffer("b", dst.untyped_storage(), n)], [fd]))
        res["read_ok"] = bool(torch.equal(dst[:: 1 << 20], src[:: 1 << 20]))
        dst.zero_()
        buffers.release_host_cache()
        addr = map_file(fd, n, mmap.PROT_READ)
        host = host_tensor(addr, n)
        t0 = time.perf_counter()
        rc = int(cudart.cudaHostRegister(addr, n, REGISTER_READ_ONLY))
        res["register_s"] = time.perf_counter() - t0
        res["register_rc"] = rc
        if rc == 0:
            streams = [torch.cuda.Stream() for _ in range(4)]
            res["h2d_registered_s"] = timed(lambda h=host: copy_chunks(dst, h, streams))
            res["h2d_registered_again_s"] = timed(lambda h=host: copy_chunks(dst, h, streams))
            res["h2d_ok"] = bool(torch.equal(dst[:: 1 << 20], src[:: 1 << 20]))
            t0 = time.perf_counter()
            cudart.cudaHostUnregister(addr)
            res["unregister_s"] = time.perf_counter() - t0
        del host
        _libc.munmap(addr, n)
        # offload into a pre-faulted, registered target
        target = directory / "target"
        tfd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            t0 = time.perf_counter()
            os.posix_fallocate(tfd, 0, n)
            taddr = map_file(tfd, n, mmap.PROT_READ | mmap.PROT_WRITE, populate=True)
            res["prefault_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            rc = int(cudart.cudaHostRegister(taddr, n, 0))
            res["target_register_s"] = time.perf_counter() - t0
            res["target_register_rc"] = rc
            if rc == 0:
                th = host_tensor(taddr, n)
                streams = [torch.cuda.Stream() for _ in range(4)]
                res["d2h_registered_s"] = timed(lambda: copy_chunks(th, src, streams))
                res["d2h_ok"] = same(src, th)
                t0 = time.perf_counter()
                cudart.cudaHostUnregister(taddr)
                res["target_unregister_s"] = time.perf_counter() - t0
                del th
            _libc.munmap(taddr, n)
        finally:
            os.close(tfd)
            target.unlink()
    finally:
        os.close(fd)
        blob.unlink()
    gb = n / 1e9
    for k in [k for k in res if k.endswith("_s") and isinstance(res[k], float)]:
        res[k.replace("_s", "_gb_per_s")] = gb / res[k] if res[k] else None  # type: ignore[operator]
    return res


def huge_tmpfs(n: int) -> Path | None:
    path = Path("/tmp/gpusnap-huge-tmpfs")
    path.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"huge=always,size={2 * n + (1 << 30)}", "gpusnap-huge", str(path)],
        capture_output=True,
        text=True,
    )
    return path if done.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    n = int(args.gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    kinds: dict[str, Path | None] = {"shm-4k": Path("/dev/shm"), "tmpfs-huge-always": huge_tmpfs(n)}
    result: dict[str, object] = {
        "benchmark": "dma-probe",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "gib": args.gib,
        "shmem_thp": Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip(),
    }
    for kind, directory in kinds.items():
        if directory is None:
            result[kind] = "could not mount"
            continue
        result[kind] = probe(directory, n, src)
        print(kind, json.dumps(result[kind]), flush=True)
    if kinds["tmpfs-huge-always"] is not None:
        subprocess.run(["umount", str(kinds["tmpfs-huge-always"])], check=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"dma-probe-{datetime.now(UTC):%Y%m%dT%H%M%S}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
