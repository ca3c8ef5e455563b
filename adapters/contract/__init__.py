"""The contract between gpusnapd and the code inside engine processes: the only part of
``gpusnap.adapters`` the daemon imports.

* :mod:`.wire` — the agent channel's framing (length-prefixed protobuf, descriptors by ``SCM_RIGHTS``).
* :mod:`._proto` — the agent channel's messages (generated from ``proto/gpusnap/v1/agent.proto``).
* :mod:`.settings` — the capture-settings base: a row (:class:`~.settings.CaptureSetting`) and what one
  engine declares (:class:`~.settings.EngineSettings`: its rows, the command lines that run it, its
  tensor-parallel flags).
* :mod:`.registry` — every engine's settings, collected from ``gpusnap.adapters.engines.<name>.settings``.
* :mod:`.capture_settings` — the one table (common rows and every engine's) that workers apply and the
  daemon's preflight checks.

Everything here imports only the standard library and protobuf: it runs inside engine processes.
"""
