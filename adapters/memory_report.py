"""What device memory a worker still holds when the CUDA checkpoint runs, and who holds it (a diagnostic).

With ``GPUSNAP_MEMORY_REPORT_DIR=DIR`` in a worker's environment, its agent writes ``DIR/<pid>.json`` at a
capture, once it has freed everything it frees (buffers written out and released, KV cache and scratch
released, torch's cache emptied) and just before it closes its channel for the dump, if ``DIR/request`` exists
(``make bench-gpu-vllm`` creates it for one capture of its own, so that the report's cost stays out of the timed
ones). :func:`report`'s answer:

- ``device``: the driver's view of the current GPU (``cuMemGetInfo`` through ``torch.cuda.mem_get_info``: free
  and total bytes, all processes together);
- ``torch``: the caching allocator (``torch.cuda.memory_snapshot()``) per pool: segments, reserved, allocated
  and reserved-but-free bytes, and whether the pool's segments are gpusnap arenas; and its counters
  (``torch.cuda.memory_stats()``);
- ``blocks``: the largest allocated blocks outside arenas, each with the live Python tensors over it, named by
  who holds them (``Module._buffers``/``_parameters`` entries and object attributes: ``RotaryEmbedding.
  cos_sin_cache``, ``InputBuffers.input_ids``…), and ``by_owner``: their bytes per holder type; memory that only
  C++ holds (cuBLAS workspaces, NCCL) is in ``unattributed_bytes``;
- ``arenas``: gpusnap's arenas, mapped and released bytes.

The process's own total (NVML's per-process figure, which ``gpusnap inspect`` shows as ``gpu_memory_bytes``)
minus the torch pools that are not arenas, minus the arenas still mapped, is what neither holds: the CUDA
context, loaded kernel modules, library handles (``bench/memory_breakdown.py`` computes it). Standard library only;
torch is used when the process already imported it.
"""

from __future__ import annotations

import bisect
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV = "GPUSNAP_MEMORY_REPORT_DIR"
REQUEST = "request"
"""The file in the report directory that asks for a report at the next capture."""
TOP_BLOCKS = 60
STAT_KEYS = (
    "reserved_bytes.all.current",
    "allocated_bytes.all.current",
    "active_bytes.all.current",
    "inactive_split_bytes.all.current",
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
)


def requested() -> Path | None:
    """The report directory, if ``GPUSNAP_MEMORY_REPORT_DIR`` is set and holds a ``request`` file."""
    where = os.environ.get(ENV)
    if not where or not (Path(where) / REQUEST).exists():
        return None
    return Path(where)


def write_if_requested() -> Path | None:
    """Write :func:`report` to ``DIR/<pid>.json`` when asked (:func:`requested`); never raises (a failed report
    is logged: it must not fail the capture). Returns the file written."""
    where = requested()
    if where is None:
        return None
    try:
        t0 = time.monotonic()
        data = report()
        data["report_s"] = round(time.monotonic() - t0, 3)
        path = where / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
        return path
    except Exception as exc:  # noqa: BLE001 (a diagnostic)
        log.warning("gpusnap: the memory report failed: %s", exc)
        return None


def report() -> dict[str, Any]:
    """The current process's device memory (see the module docstring); ``{"pid": …, "cuda": false}`` where it
    has not initialised CUDA through torch."""
    out: dict[str, Any] = {"pid": os.getpid(), "cuda": False}
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return out
    from gpusnap.adapters import vmm

    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    out.update(cuda=True, device={"index": device, "free_bytes": int(free), "total_bytes": int(total)})
    segments = [s for s in torch.cuda.memory_snapshot() if int(s["device"]) == device]
    pools: dict[str, dict[str, Any]] = {}
    for s in segments:
        key = str(tuple(s.get("segment_pool_id", (0, 0))))
        p = pools.setdefault(key, {"segments": 0, "reserved_bytes": 0, "allocated_bytes": 0, "arenas": True})
        p["segments"] += 1
        p["reserved_bytes"] += int(s["total_size"])
        p["allocated_bytes"] += int(s["allocated_size"])
        p["arenas"] = p["arenas"] and vmm.arena_of(int(s["address"])) is not None
    for p in pools.values():
        p["free_bytes"] = p["reserved_bytes"] - p["allocated_bytes"]
    stats = torch.cuda.memory_stats(device)
    out["torch"] = {"pools": pools, "stats": {k: int(stats.get(k, 0)) for k in STAT_KEYS}}
    blocks = [
        (int(b["address"]), int(b["size"]))
        for s in segments
        if vmm.arena_of(int(s["address"])) is None
        for b in s.get("blocks", [])
        if str(b.get("state")) == "active_allocated"
    ]
    out.update(_attribute(blocks, torch))
    out["arenas"] = _arenas(vmm)
    return out


def _holders(torch: Any, device_type: str = "cuda") -> dict[int, str]:
    """Storage address → who holds a tensor over it (``Type.attribute``), from one pass over the objects
    Python's garbage collector tracks (vLLM freezes its heap after warm-up: unfrozen for the pass, frozen again)."""
    frozen = gc.get_freeze_count() if hasattr(gc, "get_freeze_count") else 0
    if frozen:
        gc.unfreeze()
    names: dict[int, str] = {}

    def note(t: Any, label: str) -> None:
        try:
            if issubclass(type(t), torch.Tensor) and t.device.type == device_type:
                names.setdefault(int(t.untyped_storage().data_ptr()), label)
        except Exception:  # noqa: BLE001,S110 (fake or meta tensors: nothing to name)
            pass

    module = torch.nn.Module
    try:
        for obj in gc.get_objects():
            kind = type(obj).__qualname__
            try:  # (the type and the instance's own dict only: some objects warn or compute on attribute reads)
                fields = object.__getattribute__(obj, "__dict__")
            except (AttributeError, TypeError):
                continue
            if not isinstance(fields, dict):
                continue
            if issubclass(type(obj), module):
                for attr in ("_parameters", "_buffers"):
                    for name, t in (fields.get(attr) or {}).items():
                        note(t, f"{kind}.{name}")
                continue
            for name, value in list(fields.items()):
                if issubclass(type(value), (list, tuple)):
                    for i, t in enumerate(value[:64]):
                        note(t, f"{kind}.{name}[{i}]")
                else:
                    note(value, f"{kind}.{name}")
    finally:
        if frozen:
            gc.freeze()
    return names


def _attribute(blocks: list[tuple[int, int]], torch: Any, device_type: str = "cuda") -> dict[str, Any]:
    """The ``blocks`` (address, bytes), largest first, with the tensors over each named by their holders."""
    names = _holders(torch, device_type)
    starts = sorted(names)
    rows: list[dict[str, Any]] = []
    by_owner: dict[str, int] = {}
    unattributed = 0
    for address, size in sorted(blocks, key=lambda b: -b[1]):
        lo, hi = bisect.bisect_left(starts, address), bisect.bisect_left(starts, address + size)
        held = [names[p] for p in starts[lo:hi]]
        if held:
            owner = held[0].split(".", 1)[0]
            by_owner[owner] = by_owner.get(owner, 0) + size
        else:
            unattributed += size
        if len(rows) < TOP_BLOCKS:
            rows.append({"address": address, "bytes": size, "held_by": held[:4]})
    return {
        "blocks": rows,
        "allocated_blocks": len(blocks),
        "by_owner": dict(sorted(by_owner.items(), key=lambda kv: -kv[1])),
        "unattributed_bytes": unattributed,
    }


def _arenas(vmm: Any) -> dict[str, int]:
    with vmm._arenas_lock:
        arenas = [a for _, _, a in vmm._arenas]
    mapped = sum(a.size for a in arenas if a.mapped)
    return {"count": len(arenas), "mapped_bytes": mapped, "released_bytes": sum(a.size for a in arenas) - mapped}
