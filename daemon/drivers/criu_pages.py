"""How many bytes of memory pages CRIU's images hold for each dumped process, for ``gpusnap inspect``.

Runs in the CRIU helper (``criu_exec``, which has pycriu) at CRIU's ``post-dump`` notification, when the images
are complete. A process's bytes are its private pages (``pagemap-<pid>.img``: entries whose pages are in this
image) and the shared anonymous or memfd memory its mappings name (``pagemap-shmem-<shmid>.img``, counted for
the first process that maps it: the CUDA checkpoint's host copy of a worker's device memory is such memory).

Image format (CRIU's ``criu/protobuf-desc``/``lib/pycriu/images/images.py``): two 32-bit magics, then entries,
each a 32-bit little-endian length and that many bytes of a protobuf message. A pagemap image's first entry is
a ``pagemap_head``, the rest ``pagemap_entry`` (``vaddr``, ``nr_pages``, ``flags``); an ``mm-<pid>.img`` holds
one ``mm_entry`` whose ``vmas`` carry ``shmid``. Only the two message modules are loaded, not ``pycriu.images``,
whose import of every image type costs about 0.4 s while the tree is frozen.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

from gpusnap.daemon.drivers import criu_images

PAGE_SIZE = 4096
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2
"""``pagemap_entry.flags`` (CRIU ``include/pagemap.h``): the pages are in this image with ``PE_PRESENT`` and
without ``PE_PARENT`` (an incremental dump's parent holds those); ``PE_LAZY`` only marks pages a lazy restore
could fetch later, and a plain dump writes them too."""

_PAGEMAP = re.compile(r"^pagemap-(\d+)\.img$")


def _messages() -> tuple[Any, Any]:
    """pycriu's ``pagemap_pb2`` and ``mm_pb2`` (``criu_images.modules``).

    Raises:
        ImportError: pycriu is not on the path.
    """
    pagemap_pb2, mm_pb2 = criu_images.modules("pagemap_pb2", "mm_pb2")
    return pagemap_pb2, mm_pb2


def _entries(dir_fd: int, name: str) -> Iterator[bytes]:
    """The raw messages of image ``name`` (in the directory ``dir_fd``)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
    return criu_images.entries(data)


def _pages(dir_fd: int, name: str, entry_class: Any) -> int:
    """Bytes of the pages a pagemap image says are in this dump."""
    total = 0
    for i, raw in enumerate(_entries(dir_fd, name)):
        if i == 0:
            continue  # pagemap_head
        e = entry_class.FromString(raw)
        flags = e.flags if e.HasField("flags") else (0 if e.in_parent else PE_PRESENT)
        if flags & PE_PRESENT and not flags & PE_PARENT:
            total += e.nr_pages * PAGE_SIZE
    return total


def image_bytes_by_pid(images_dir_fd: int) -> dict[int, int]:
    """Bytes of memory pages each dumped process's images hold (PIDs as CRIU saw them).

    Raises:
        ImportError: pycriu's messages cannot be loaded. OSError: an image cannot be read.
    """
    pagemap_pb2, mm_pb2 = _messages()
    names = set(os.listdir(images_dir_fd))
    out: dict[int, int] = {}
    counted: set[int] = set()
    for name in sorted(names):
        m = _PAGEMAP.match(name)
        if not m:
            continue
        pid = int(m.group(1))
        total = _pages(images_dir_fd, name, pagemap_pb2.pagemap_entry)
        mm = f"mm-{pid}.img"
        if mm in names:
            for raw in _entries(images_dir_fd, mm):
                for vma in mm_pb2.mm_entry.FromString(raw).vmas:
                    shmem = f"pagemap-shmem-{vma.shmid}.img"
                    if vma.shmid and vma.shmid not in counted and shmem in names:
                        counted.add(vma.shmid)
                        total += _pages(images_dir_fd, shmem, pagemap_pb2.pagemap_entry)
        out[pid] = total
    return out
