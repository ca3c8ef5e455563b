"""make bench-gpu-fill: the weight leg at memory speed, with what its registration costs and how it pays off.

gpusnapd's arena for the fill is the RAM tier's blob itself: ``mmap``ed and ``cuMemHostRegister``-ed
(read-only, portable) once by gpusnapd and kept across restores (``gpusnap.daemon.weights.devicefill``:
``register_ahead`` after a checkpoint or a standby, dropped when the blob leaves the tier). Every fill then
copies it to fresh device memory by DMA (``DeviceFiller.fill``: ``cuMemCreate`` + 4 streams of
``cuMemcpyAsync``), which a restored worker maps.

This bench drives ``DeviceFiller`` exactly as gpusnapd does, on one ``--gib`` GiB blob in ``--dir`` (a
tmpfs: ``/dev/shm``, or one mounted ``huge=always``):

- ``context_s``: gpusnapd's context on the GPU (once per daemon: ``gpu_prefill = auto`` makes it at start);
- ``register_s``: the kept registration (once per blob while it stays in the RAM tier);
- ``fills``: ``--fills`` fills from the kept registration, each into fresh device memory (seconds, GB/s);
- ``unkept_fills``: fills of the same blob registered for that fill only, in 1 GiB windows (what a
  disk-tier blob gets), so the registration is paid on every restore;
- ``amortized``: per restore, for k restores of the blob: ``register_s / k + fill`` against the unkept fill.

Check: 1 MiB samples every 1 GiB of the last filled memory, copied back, equal the blob's bytes.
JSON: bench/results/fill-<label>-<date>.json. Target (issue 21): >= 50 GB/s for 16 GB.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from gpusnap.daemon.weights.devicefill import DeviceFiller, Source, _call  # noqa: E402

CHUNK = 2 << 30
SAMPLE = 1 << 20


def _make_blob(path: Path, nbytes: int) -> float:
    """Write ``nbytes``: a random 64 MiB block, repeated, each copy stamped with its index (so a sample from
    the wrong offset differs); seconds taken."""
    t0 = time.monotonic()
    block = bytearray(os.urandom(64 << 20))
    with open(path, "wb") as fh:
        for n, off in enumerate(range(0, nbytes, len(block))):
            block[:8] = n.to_bytes(8, "little")
            fh.write(block[: min(len(block), nbytes - off)])
    os.chmod(path, 0o400)
    return time.monotonic() - t0


def _check(filler: DeviceFiller, fds: list[int], nbytes: int, blob: int, chunk: int) -> bool:
    """Map the exported chunks in this process's context and compare samples with the blob."""
    drv = filler.drv
    kind = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handles = [_call(drv, "cuMemImportFromShareableHandle", fd, kind) for fd in fds]
    base = int(_call(drv, "cuMemAddressReserve", nbytes, 0, 0, 0))
    ok = True
    try:
        for i, h in enumerate(handles):
            _call(drv, "cuMemMap", base + i * chunk, chunk, 0, h, 0)
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = 0
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _call(drv, "cuMemSetAccess", base, nbytes, [access], 1)
        host = ctypes.create_string_buffer(SAMPLE)
        for off in range(0, nbytes, 1 << 30):
            _call(drv, "cuMemcpyDtoH", ctypes.addressof(host), base + off, SAMPLE)
            ok = ok and host.raw == os.pread(blob, SAMPLE, off)
        for i in range(len(handles)):
            _call(drv, "cuMemUnmap", base + i * chunk, chunk)
    finally:
        _call(drv, "cuMemAddressFree", base, nbytes)
        for h in handles:
            _call(drv, "cuMemRelease", h)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=int, default=16)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs for the blob (the RAM tier)")
    ap.add_argument("--fills", type=int, default=5)
    results_file.add_arguments(ap)
    args = ap.parse_args()
    nbytes = args.gib << 30
    work = Path(tempfile.mkdtemp(prefix="gpusnap-fill-", dir=args.dir))
    path = work / "blob"
    doc: dict[str, Any] = {"gib": args.gib, "dir": args.dir}
    try:
        doc["blob_write_s"] = _make_blob(path, nbytes)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        filler = DeviceFiller()
        gpu = next(u for u, why in filler.probe().items() if not why)
        doc["gpu"] = gpu
        t0 = time.monotonic()
        filler.warm(gpu)
        doc["context_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        assert filler.register_ahead(fd, nbytes, gpu)
        doc["register_s"] = time.monotonic() - t0
        chunk = min(CHUNK, nbytes)
        chunks = [chunk] * (nbytes // chunk)
        fills, ok = [], True
        for n in range(args.fills):
            filled = filler.fill(gpu, chunks, [Source(fd, nbytes, 0, keep=True)])
            fills.append(filled.seconds)
            if n == args.fills - 1:
                ok = _check(filler, filled.fds, nbytes, fd, chunk)
            filled.release()
        unkept = []
        for _ in range(2):
            filled = filler.fill(gpu, chunks, [Source(fd, nbytes, 0, keep=False)])
            unkept.append(filled.seconds)
            filled.release()
        filler.close()
        os.close(fd)
        best = min(fills)
        doc["fills"] = [{"seconds": s, "gb_per_s": nbytes / s / 1e9} for s in fills]
        doc["fill_median_s"] = statistics.median(fills)
        doc["fill_best_gb_per_s"] = nbytes / best / 1e9
        doc["unkept_fills"] = [{"seconds": s, "gb_per_s": nbytes / s / 1e9} for s in unkept]
        doc["amortized"] = [
            {
                "restores": k,
                "per_restore_s": doc["register_s"] / k + doc["fill_median_s"],
                "unkept_per_restore_s": statistics.median(unkept),
            }
            for k in (1, 2, 5, 10, 100)
        ]
        doc["break_even_restores"] = doc["register_s"] / max(1e-9, statistics.median(unkept) - doc["fill_median_s"])
        doc["samples_equal"] = ok
        doc["target_met"] = doc["fill_best_gb_per_s"] >= 50 and ok
    finally:
        path.unlink(missing_ok=True)
        work.rmdir()
    results_file.write(doc, "fill", args.out, args.label)
    return 0 if doc.get("samples_equal") else 1


if __name__ == "__main__":
    sys.exit(main())
