"""The image digest: a SHA-256 hash list over 16 MiB chunks, computed in parallel."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from gpusnap.daemon.store import checksum
from tests.lanes import LANES


def _reference(data: bytes) -> str:
    size = checksum.CHUNK_BYTES
    chunks = [hashlib.sha256(data[o : o + size]).digest() for o in range(0, len(data), size)]
    return hashlib.sha256(f"{size}:".encode() + b"".join(chunks)).hexdigest()


def test_digest_matches_its_definition(tmp_path: Path) -> None:
    for n in (0, 1, checksum.CHUNK_BYTES, checksum.CHUNK_BYTES * 2 + 12345):
        data = os.urandom(n)
        path = tmp_path / f"f{n}"
        path.write_bytes(data)
        assert checksum.file_digests([path], LANES.digest)[0] == _reference(data)


def test_digest_sees_one_flipped_byte_in_a_middle_chunk(tmp_path: Path) -> None:
    data = bytearray(os.urandom(checksum.CHUNK_BYTES * 3))
    path = tmp_path / "pages-1.img"
    path.write_bytes(data)
    files = checksum.image_files(tmp_path, LANES.digest)
    assert checksum.mismatches(tmp_path, files, LANES.digest) == []
    data[checksum.CHUNK_BYTES + 777] ^= 1
    path.write_bytes(data)
    assert checksum.mismatches(tmp_path, files, LANES.digest) == ["pages-1.img: checksum mismatch"]
    path.unlink()
    assert checksum.mismatches(tmp_path, files, LANES.digest) == ["pages-1.img: missing"]
