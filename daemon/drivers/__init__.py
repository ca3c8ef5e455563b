"""Synchronous drivers over the host's tools and libraries: CRIU, the CUDA driver checkpoint API, NVML, /proc.

Nothing here imports gRPC. Every driver call that can block on the GPU driver is bounded by
:func:`gpusnap.daemon.drivers.deadline.call_with_deadline`.
"""
