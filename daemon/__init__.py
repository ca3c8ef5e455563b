"""gpusnap daemon: gRPC service, operations, drivers (CRIU, CUDA, NVML) and the snapshot store.

``__version__`` is read from the installed distribution on first use, not at import: importing
``importlib.metadata`` and scanning ``sys.path`` for it costs tens of milliseconds, which every CLI call
and every CRIU helper process would otherwise pay.
"""

from __future__ import annotations

import functools


@functools.cache
def version() -> str:
    """gpusnap's version, e.g. ``"0.1.0"``; ``"0.0.0+unknown"`` in a source tree without an install."""
    from importlib import metadata

    try:
        return metadata.version("gpusnap")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "0.0.0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
