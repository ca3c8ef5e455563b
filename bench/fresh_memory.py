"""Fresh memory touched and freed right before a timed restore, so that every restore a CPU bench compares
takes memory the guest already holds.

The 2-core VMs these benches run on hand memory that is freed back to their host (virtio-balloon free page
reporting: ``/sys/module/page_reporting/parameters/page_reporting_order``), and the next touch of such memory
runs at the host's speed, well below the guest's. A restore that starts a second or more after a large free (a
dumped source's, the previous restore's) then pays that on every page it fills, and one that starts at once does
not: the first gpusnap restore after a vLLM dump took 1.1 s instead of 0.6 s for it (docs/performance.md, "A
vLLM server on CPU"). Touching and freeing as many bytes as the restore will take, just before it, evens this
out; a host without a balloon is unaffected.
"""

from __future__ import annotations

PAGE = 4096


def touch(nbytes: int) -> None:
    """Write one byte into every 4 KiB page of ``nbytes`` of fresh memory, then free it (0: nothing)."""
    if nbytes <= 0:
        return
    block = bytearray(nbytes)
    block[::PAGE] = b"\x01" * (len(block) // PAGE + (1 if len(block) % PAGE else 0))
    del block
