"""Synchronous drivers over the host's tools and libraries: CRIU, the CUDA driver checkpoint API, NVML, /proc.

Nothing here imports gRPC, and nothing here decides who may do what (``gpusnap.daemon.access``) or whether an
operation may start (``gpusnap.daemon.preflight``). Every driver call that can block on the GPU driver is
bounded by :func:`gpusnap.daemon.drivers.deadline.call_with_deadline`.
"""
