"""gpusnap daemon: gRPC service, operations, drivers (CRIU, CUDA, NVML) and the snapshot store."""

from importlib import metadata

try:
    __version__ = metadata.version("gpusnap")
except metadata.PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
