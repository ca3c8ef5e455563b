"""Every engine's settings, found through the ``gpusnap.engines`` entry points: each engine folder's
``settings.SETTINGS`` (:class:`~gpusnap.adapters.contract.settings.EngineSettings`), declared in
``pyproject.toml``, so that nothing else needs to name the engine (``docs/engines.md``, "Adding an engine").

Read by the capture-settings table (:mod:`gpusnap.adapters.contract.capture_settings`) and by the daemon's
preflight (``gpusnap.daemon.preflight.gpu``: engine markers, tensor-parallel flags). Only the ``settings``
module of each engine is imported (standard library and this contract only), never its adapter or plugin.
A checkout that is not installed finds them in the link tree ``scripts/link_tree.py`` makes (``build/pkg``).
"""

from __future__ import annotations

from importlib import metadata

from gpusnap.adapters.contract.settings import EngineSettings

GROUP = "gpusnap.engines"
"""The entry-point group: ``<engine name> = "gpusnap.adapters.engines.<name>.settings:SETTINGS"``."""


def _collect() -> tuple[EngineSettings, ...]:
    """``SETTINGS`` of every ``gpusnap.engines`` entry point, by engine name.

    Raises:
        ImportError: there is none (gpusnap's metadata is not on the path), or one is not an ``EngineSettings``
            of its own name.
    """
    points = sorted(metadata.entry_points(group=GROUP), key=lambda p: p.name)
    if not points:
        raise ImportError(
            f"no {GROUP} entry points: gpusnap is not installed where this Python looks (pip install it, or put a "
            "link tree made by scripts/link_tree.py, e.g. build/pkg, on PYTHONPATH)"
        )
    found = []
    for point in points:
        settings = point.load()
        if not isinstance(settings, EngineSettings) or settings.name != point.name:
            raise ImportError(f"entry point {GROUP}:{point.name} ({point.value}) is not that engine's EngineSettings")
        found.append(settings)
    return tuple(found)


ENGINES: tuple[EngineSettings, ...] = _collect()
"""Every engine's settings, by name."""

TENSOR_PARALLEL_FLAGS: tuple[str, ...] = tuple(dict.fromkeys(f for e in ENGINES for f in e.tensor_parallel_flags))
"""Command-line flags that give an engine's tensor-parallel size, every engine's."""

ENGINE_MARKERS: tuple[tuple[str, str], ...] = tuple((m, e.name) for e in ENGINES for m in e.markers)
"""(marker, engine name) for every engine: a program or ``-m`` module named ``marker`` (or ``marker.…``,
``marker-…``) runs that engine."""
