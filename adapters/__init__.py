"""gpusnap adapters: code that runs inside engine worker processes (worker agent, engine adapters).

Keep dependencies light: this package is imported by inference workers. It needs only protobuf; each
engine module imports its engine lazily. Importing the package imports nothing more: its names below are
loaded on first use, so that ``gpusnap.adapters.contract`` (all the daemon imports) comes without the
worker runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpusnap.adapters.agent import WorkerAgent, start_agent
    from gpusnap.adapters.base import EngineAdapter, HelloFacts, RestoreContext
    from gpusnap.adapters.env import configure_capture_env

__all__ = ["EngineAdapter", "HelloFacts", "RestoreContext", "WorkerAgent", "configure_capture_env", "start_agent"]

_FROM = {
    "EngineAdapter": "gpusnap.adapters.base",
    "HelloFacts": "gpusnap.adapters.base",
    "RestoreContext": "gpusnap.adapters.base",
    "WorkerAgent": "gpusnap.adapters.agent",
    "configure_capture_env": "gpusnap.adapters.env",
    "start_agent": "gpusnap.adapters.agent",
}


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
