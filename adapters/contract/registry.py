"""Every engine's settings, collected from the engine folders: ``gpusnap.adapters.engines.<name>.settings``
defines ``SETTINGS`` (:class:`~gpusnap.adapters.contract.settings.EngineSettings`), and nothing else needs
to name the engine (``docs/engines.md``, "Adding an engine").

Read by the capture-settings table (:mod:`gpusnap.adapters.contract.capture_settings`) and by the daemon's
preflight (``gpusnap.daemon.preflight.gpu``: engine markers, tensor-parallel flags). Only the ``settings``
module of each folder is imported (standard library only), never the engine's adapter or plugin.
"""

from __future__ import annotations

import importlib
import pkgutil

from gpusnap.adapters import engines as _engines
from gpusnap.adapters.contract.settings import EngineSettings


def _collect() -> tuple[EngineSettings, ...]:
    """``SETTINGS`` of every engine folder that has a ``settings`` module, by folder name."""
    found = []
    for module in sorted(pkgutil.iter_modules(_engines.__path__), key=lambda m: m.name):
        if not module.ispkg:
            continue
        name = f"{_engines.__name__}.{module.name}.settings"
        try:
            settings = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a folder without settings (an engine with nothing to declare)
                continue
            raise
        found.append(settings.SETTINGS)
    return tuple(found)


ENGINES: tuple[EngineSettings, ...] = _collect()
"""Every engine's settings, by name."""

TENSOR_PARALLEL_FLAGS: tuple[str, ...] = tuple(dict.fromkeys(f for e in ENGINES for f in e.tensor_parallel_flags))
"""Command-line flags that give an engine's tensor-parallel size, every engine's."""

ENGINE_MARKERS: tuple[tuple[str, str], ...] = tuple((m, e.name) for e in ENGINES for m in e.markers)
"""(marker, engine name) for every engine: a program or ``-m`` module named ``marker`` (or ``marker.…``,
``marker-…``) runs that engine."""
