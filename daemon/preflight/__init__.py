"""What an operation checks before it touches anything: the capture checks of a process tree (``capture``,
``criu_limits``: what CRIU could not dump or restore), the GPU preflight (``gpu``: driver, architecture, MIG,
MPS, devices, capture settings, memory) and a restore's (``restore``: the request against the snapshot, the
host, the ports, the files and the GPUs). Each check raises a domain error naming the cause and the fix.
"""
