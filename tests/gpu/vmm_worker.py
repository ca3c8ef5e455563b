"""A CUDA process with two VMM arenas, for the address-stability check (tests/gpu/test_vmm.py).

    python vmm_worker.py WORKDIR

- ``kept``: 64 MiB, mapped, filled with a known int32 pattern; it stays mapped through every capture.
- ``gone``: 1 GiB reserved with ``cuMemAddressReserve``, filled, then unmapped and released before any
  capture (``cuMemUnmap`` + ``cuMemRelease``): only the address range remains.

WORKDIR/ready holds {"kept_ptr", "gone_ptr", "gone_bytes", "kept_sum"}. Each WORKDIR/go-N makes it check
both and write WORKDIR/res-N: the pattern sum of ``kept`` now, then ``gone`` is re-created and mapped at
its reserved address (``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess``), filled and summed through a
tensor made at the start over that address, and released again. Errors are written to res-N too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch

from gpusnap.adapters import vmm

MIB = 1 << 20


def pattern(t: torch.Tensor, seed: int) -> None:
    n = t.numel()
    t.copy_(
        (torch.arange(n, dtype=torch.int64, device=t.device) * 2654435761 + seed).remainder(2**31 - 1).to(torch.int32)
    )


def total(t: torch.Tensor) -> int:
    out = int(t.to(torch.int64).sum().item())
    torch.cuda.empty_cache()  # the int64 temporaries: not held, not captured
    return out


def main() -> None:
    wd = sys.argv[1]
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    kept = vmm.Arena(64 * MIB, 0)
    kept_t = kept.bytes_tensor(kept.ptr, kept.size).view(torch.int32)
    pattern(kept_t, 1)
    gone = vmm.Arena(1024 * MIB, 0)
    gone_t = gone.bytes_tensor(gone.ptr, gone.size).view(torch.int32)
    pattern(gone_t, 2)
    expect_gone = total(gone_t)
    torch.cuda.synchronize()
    gone.release()
    info = {
        "kept_ptr": kept.ptr,
        "gone_ptr": gone.ptr,
        "gone_bytes": gone.size,
        "kept_sum": total(kept_t),
        "gone_sum": expect_gone,
    }
    with open(os.path.join(wd, "ready.tmp"), "w") as fh:
        json.dump(info, fh)
    os.rename(os.path.join(wd, "ready.tmp"), os.path.join(wd, "ready"))
    n = 1
    while True:
        go = os.path.join(wd, f"go-{n}")
        if not os.path.exists(go):
            time.sleep(0.02)
            continue
        res: dict[str, object] = {"pid": os.getpid()}
        try:
            res["kept_sum"] = total(kept_t)
            gone.remap()
            res["remapped_at"] = gone.ptr
            res["tensor_ptr"] = gone_t.data_ptr()
            pattern(gone_t, 2)
            res["gone_sum"] = total(gone_t)
            torch.cuda.synchronize()
            gone.release()
            res["gone_mapped_after"] = gone.mapped
        except Exception:  # noqa: BLE001 (reported to the test)
            res["error"] = traceback.format_exc()
        with open(os.path.join(wd, f"res-{n}.tmp"), "w") as fh:
            json.dump(res, fh)
        os.rename(os.path.join(wd, f"res-{n}.tmp"), os.path.join(wd, f"res-{n}"))
        n += 1


if __name__ == "__main__":
    main()
