"""gpusnap adapters: code that runs inside engine worker processes (worker agent, engine adapters).

Keep dependencies light: this package is imported by inference workers. It needs only protobuf; each
engine module imports its engine lazily.
"""

from gpusnap.adapters.agent import WorkerAgent, start_agent
from gpusnap.adapters.base import EngineAdapter, RestoreContext
from gpusnap.adapters.env import configure_capture_env

__all__ = ["EngineAdapter", "RestoreContext", "WorkerAgent", "configure_capture_env", "start_agent"]
