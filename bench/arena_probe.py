"""Probe for issue 12's pinned-arena lever: can pinned memory that one process (gpusnapd) owns and
registered once be the source of another process's (a restored worker's) host→device copies, and at
what cost? (``python3 bench/arena_probe.py --gib 4``; GPU machine, root; about a minute.)

The buffers path today pins nothing across restores: a restored worker is a new CUDA context, so each
reload copies through its own pinned slots (``preadv`` → slot → device, 28–36 GB/s host-side), and a
``cudaHostRegister`` of the RAM tier's blobs would have to be redone in every restored worker (0.18–0.54 s
per 8 GiB, bench/results/dma-probe-20261201T124711.json). Two ways around it use the CUDA driver's VMM
API with shareable handles (``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), which this probe measures
with cuda.bindings only (no torch), each step timed and its ``CUresult`` recorded, a failed step
leaving the later ones to run:

- ``host_arena``: the owner allocates pinned host memory on the GPU's NUMA node (``cuMemCreate``,
  ``CU_MEM_LOCATION_TYPE_HOST_NUMA``), fills it from a tmpfs blob (host→host-arena copy), exports it as a
  file descriptor; a second process (the worker's role: its own context) imports it
  (``cuMemImportFromShareableHandle``), maps it, and copies it to its device memory on 4 streams.
  The worker's cost per restore is import + map + copy, with no registration.
- ``device_export``: the owner fills *device* memory itself (``cuMemCreate`` on the GPU, exported), by
  DMA from the blob ``mmap``ed and registered once (``cuMemHostRegister`` read-only); the worker only
  imports and maps it. The copy then runs in the owner while CRIU restores the worker: reload leaves the
  critical path.

Each copy is checked in the worker: 1 MiB samples every 64 MiB of the device copy equal the blob's
bytes at the same offsets. Also recorded: the owner's device memory before and after its context (what
a daemon-side context costs every GPU). Writes bench/results/arena-probe-<date>.json; exit status 0 when
both ways were measured and every check passed.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402

CHUNK = 256 << 20
SAMPLE = 1 << 20
SAMPLE_EVERY = 64 << 20
STREAMS = 4
READ_ONLY = 0x08  # CU_MEMHOSTREGISTER_READ_ONLY
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Steps:
    """Timed steps with their results; ``run`` records an exception as the step's error and returns None."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    def run(self, name: str, fn: Any) -> Any:
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 (a probe: record and go on)
            self.out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            return None
        self.out[name] = {"s": round(time.perf_counter() - t0, 5)}
        return value


def _ok(res: Any) -> Any:
    """The values after a cuda.bindings call's CUresult; raises on an error."""
    from cuda.bindings import driver as cu

    err, *rest = res if isinstance(res, tuple) else (res,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{err.name}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _context(ordinal: int) -> Any:
    from cuda.bindings import driver as cu

    _ok(cu.cuInit(0))
    dev = _ok(cu.cuDeviceGet(ordinal))
    ctx = _ok(cu.cuDevicePrimaryCtxRetain(dev))
    _ok(cu.cuCtxSetCurrent(ctx))
    return dev


def _attribute(name: str, ordinal: int) -> int:
    from cuda.bindings import driver as cu

    return int(_ok(cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), _ok(cu.cuDeviceGet(ordinal)))))


def _streams() -> list[Any]:
    from cuda.bindings import driver as cu

    return [_ok(cu.cuStreamCreate(0)) for _ in range(STREAMS)]


def _prop(location: str, ordinal: int) -> Any:
    from cuda.bindings import driver as cu

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = (
        cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
        if location == "host"
        else cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    )
    prop.location.id = ordinal
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _rounded(n: int, prop: Any) -> int:
    from cuda.bindings import driver as cu

    gran = int(
        _ok(
            cu.cuMemGetAllocationGranularity(prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        )
    )
    return (n + gran - 1) // gran * gran


def _map(handle: Any, size: int, ordinal: int) -> int:
    """Reserve a VA range, map ``handle`` there and give device ``ordinal`` read-write access."""
    from cuda.bindings import driver as cu

    ptr = _ok(cu.cuMemAddressReserve(size, 0, 0, 0))
    _ok(cu.cuMemMap(ptr, size, 0, handle, 0))
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(cu.cuMemSetAccess(ptr, size, [desc], 1))
    return int(ptr)


def _copy(dst: int, src: int, n: int, streams: list[Any]) -> None:
    from cuda.bindings import driver as cu

    for i, off in enumerate(range(0, n, CHUNK)):
        _ok(cu.cuMemcpyAsync(dst + off, src + off, min(CHUNK, n - off), streams[i % len(streams)]))
    for s in streams:
        _ok(cu.cuStreamSynchronize(s))


def _samples_digest(read: Any, n: int) -> str:
    """SHA-256 over 1 MiB samples every 64 MiB, read by ``read(offset, size) -> bytes``."""
    h = hashlib.sha256()
    for off in range(0, n, SAMPLE_EVERY):
        h.update(read(off, min(SAMPLE, n - off)))
    return h.hexdigest()


def _device_reader(dptr: int) -> Any:
    from cuda.bindings import driver as cu

    def read(off: int, size: int) -> bytes:
        buf = (ctypes.c_char * size)()
        _ok(cu.cuMemcpyDtoH(ctypes.addressof(buf), dptr + off, size))
        return bytes(buf)

    return read


def worker(args: argparse.Namespace) -> int:
    """The restored worker's role: import the owner's descriptor, map it, use it; JSON on stdout."""
    from cuda.bindings import driver as cu

    steps = Steps()
    steps.run("context", lambda: _context(args.device))
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    handle = steps.run("import", lambda: _ok(cu.cuMemImportFromShareableHandle(args.fd, kind)))
    ptr = steps.run("map", lambda: _map(handle, args.size, args.device)) if handle is not None else None
    if ptr is not None and args.role == "host_arena":
        dst = steps.run("alloc_device", lambda: int(_ok(cu.cuMemAlloc(args.size))))
        streams = _streams()
        if dst is not None:
            steps.run("copy_h2d", lambda: _copy(dst, ptr, args.size, streams))
            steps.run("copy_h2d_again", lambda: _copy(dst, ptr, args.size, streams))
            steps.out["digest"] = steps.run("check", lambda: _samples_digest(_device_reader(dst), args.bytes))
    elif ptr is not None:
        steps.out["digest"] = steps.run("check", lambda: _samples_digest(_device_reader(ptr), args.bytes))
    print(json.dumps(steps.out))
    return 0


def _run_worker(role: str, fd: int, size: int, n: int, device: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", role, "--fd", str(fd), "--size", str(size), "--bytes", str(n)]
    cmd += ["--device", str(device)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, pass_fds=(fd,), capture_output=True, text=True, timeout=300)
    out: dict[str, Any] = {"wall_s": round(time.perf_counter() - t0, 3), "exit": done.returncode}
    try:
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        out["stderr"] = done.stderr[-2000:]
    return out


def _own_device_mib() -> int | None:
    """Device memory this process holds, per nvidia-smi (what a context in gpusnapd would cost a GPU)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(mib.strip())
    return None


def _gb_per_s(steps: dict[str, Any], key: str, n: int) -> float | None:
    s = steps.get(key, {}).get("s")
    return round(n / s / 1e9, 2) if s else None


def _share(
    steps: Steps, role: str, prop: Any, n: int, host: int, streams: list[Any], expected: str, device: int
) -> dict[str, Any]:
    """Allocate ``prop``'s memory in this process, fill it from the registered blob at ``host`` (twice: the
    second fill is the steady rate), export it and hand it to a worker process in ``role``; the worker's
    steps, with ``check_ok`` (its sampled digest equals the blob's ``expected``)."""
    from cuda.bindings import driver as cu

    size = _rounded(n, prop)
    handle = steps.run(f"{role}_create", lambda: _ok(cu.cuMemCreate(size, prop, 0)))
    if handle is None:
        return {}
    ptr = steps.run(f"{role}_map", lambda: _map(handle, size, device))
    if ptr is not None:
        steps.run(f"{role}_fill_from_registered_blob", lambda: _copy(ptr, host, n, streams))
        steps.run(f"{role}_fill_again", lambda: _copy(ptr, host, n, streams))
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    fd = steps.run(f"{role}_export", lambda: int(_ok(cu.cuMemExportToShareableHandle(handle, kind, 0))))
    if fd is None:
        return {}
    try:
        w = _run_worker(role, fd, size, n, device)
    finally:
        os.close(fd)
    w["check_ok"] = w.get("digest") == expected
    return w


def owner(args: argparse.Namespace) -> int:
    from cuda.bindings import driver as cu

    n = int(args.gib * 2**30)
    result: dict[str, Any] = {"gib": args.gib, "device": args.device}
    blob_dir = Path(args.blob_dir)
    blob_dir.mkdir(parents=True, exist_ok=True)
    blob = blob_dir / "arena-probe-blob"
    with open(blob, "wb") as fh:  # random bytes, so a wrong or stale copy cannot pass the check
        for _ in range(0, n, 64 << 20):
            fh.write(os.urandom(64 << 20))
    fd = os.open(blob, os.O_RDONLY)
    host = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if host in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap of the blob")
    expected = _samples_digest(lambda off, size: os.pread(fd, size, off), n)
    steps = Steps()
    try:
        streams = steps.run("context", lambda: (_context(args.device), _streams())[1])
        if streams is None:
            raise RuntimeError(f"no CUDA context: {steps.out['context']['error']}")
        result["owner_context_device_mib"] = _own_device_mib()
        steps.run("register_blob_read_only", lambda: _ok(cu.cuMemHostRegister(host, n, READ_ONLY)))

        # 1. host arena on the GPU's NUMA node, exported
        numa = steps.run("host_numa_id", lambda: _attribute("CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", args.device))
        result["host_numa_id"] = numa
        result["host_numa_vmm_supported"] = steps.run(
            "host_numa_vmm_supported",
            lambda: _attribute("CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", args.device),
        )
        prop = _prop("host", numa if isinstance(numa, int) and numa >= 0 else 0)
        result["host_arena_worker"] = _share(steps, "host_arena", prop, n, host, streams, expected, args.device)
        if "copy_h2d_again" in result["host_arena_worker"]:
            result["host_arena_worker"]["copy_gb_per_s"] = _gb_per_s(result["host_arena_worker"], "copy_h2d_again", n)

        # 2. device memory filled by the owner from the registered blob, exported
        dprop = _prop("device", args.device)
        result["device_export_worker"] = _share(steps, "device_export", dprop, n, host, streams, expected, args.device)
        steps.run("unregister_blob", lambda: _ok(cu.cuMemHostUnregister(host)))
    except RuntimeError as exc:
        result["error"] = str(exc)
    finally:
        _libc.munmap(host, n)
        os.close(fd)
        blob.unlink()
    result["owner_steps"] = steps.out
    result["rates_gb_per_s"] = {
        "host_arena_fill": _gb_per_s(steps.out, "host_arena_fill_again", n),
        "device_fill_from_registered_blob": _gb_per_s(steps.out, "device_export_fill_again", n),
        "worker_h2d_from_imported_host_arena": result.get("host_arena_worker", {}).get("copy_gb_per_s"),
    }
    ok = all(result.get(k, {}).get("check_ok") for k in ("host_arena_worker", "device_export_worker"))
    result["all_checks_passed"] = ok
    print(json.dumps(result, indent=2))
    results_file.write(result, "arena-probe", args.out, args.label)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--blob-dir", default="/dev/shm", help="where the probe's blob is written (a RAM tier)")
    results_file.add_arguments(ap)
    ap.add_argument("--worker", choices=["host_arena", "device_export"], help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.role = args.worker
        return worker(args)
    return owner(args)


if __name__ == "__main__":
    sys.exit(main())
