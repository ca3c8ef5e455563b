"""One folder per engine: ``adapter`` (the :class:`~gpusnap.adapters.base.EngineAdapter` of its front end),
``plugin`` (what the engine loads, or the user calls, to start agents), ``processes`` (the adapters of its
other processes), ``settings`` (its capture settings, command-line markers and tensor-parallel flags), as
far as they apply. ``docs/engines.md`` ("Adding an engine") says how to add one.

Nothing here imports an engine at import time; ``settings`` modules import only the standard library and
``gpusnap.adapters.contract`` (the daemon reads them through :mod:`gpusnap.adapters.contract.registry`).
"""
