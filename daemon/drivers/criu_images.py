"""Reading CRIU's image files in the helper: pycriu's generated message classes and the entry framing.

A v1.1 image is two magics (``IMG_COMMON`` or ``IMG_SERVICE``, then its own; older ones have only the
latter), then entries: a little-endian ``u32`` size, that many bytes of one protobuf message, and for some
images (``sk-queues``) extra bytes the message announces (CRIU's ``images/README``; pycriu's
``images/images.py``). pycriu's ``images/__init__`` imports every decoder (about 0.4 s on a loaded 2-core
host), so the generated modules are imported alone, as that ``__init__`` makes them importable: their
directory on ``sys.path``, since they import their siblings by top-level name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

from gpusnap.daemon.defaults import INSTALL_CRIU

IMG_COMMON_MAGICS = (0x54564319, 0x55105940)
"""IMG_COMMON and IMG_SERVICE: a v1.1 image starts with one of them, then its own magic."""


def modules(*names: str) -> tuple[Any, ...]:
    """pycriu's generated ``images/<name>.py`` modules (e.g. ``"fdinfo_pb2"``), in the order asked.

    Raises:
        ImportError: pycriu is not on the path.
    """
    spec = importlib.util.find_spec("pycriu")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"pycriu is not importable; {INSTALL_CRIU}")
    images = os.path.join(list(spec.submodule_search_locations)[0], "images")
    if images not in sys.path:
        sys.path.append(images)
    return tuple(importlib.import_module(n) for n in names)


def header(data: bytes) -> bytes:
    """The magics an image starts with (kept as they are when an image is written back)."""
    return data[: 8 if len(data) >= 4 and struct.unpack_from("<I", data)[0] in IMG_COMMON_MAGICS else 4]


def entries(data: bytes, extra_of: Callable[[bytes], int] | None = None) -> Iterator[bytes]:
    """The raw messages of an image's bytes; ``extra_of(message)``: bytes of extra data after it."""
    pos = len(header(data))
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        message = data[pos : pos + size]
        yield message
        pos += size + (extra_of(message) if extra_of else 0)
