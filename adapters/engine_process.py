"""What the per-process adapters of every engine share: where a model process's memory goes, its title, its
weights, and the engine processes a front end started.

An engine that runs its model outside the front end (vLLM's Workers, SGLang's schedulers, TensorRT-LLM's
executor workers) gets one gpusnap agent per process. The front end's agent stops work and frees the KV
cache through the engine's own API; each model process's agent names its weights as buffers, which the
daemon keeps in its buffer store (docs/engines.md). Standard library only: this runs inside engine processes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

from gpusnap.adapters.base import EngineAdapter, HelloFacts, RestoreContext


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What a model process's capture does with its memory; ``why`` explains the weights' place (``inspect``)."""

    offload_weights: bool
    release_kv: bool
    why: str


def graph_plan(device_type: str, graphs: bool, remedy: str) -> MemoryPlan:
    """The plan of a model process whose weights CUDA graphs may read at their addresses.

    CPU processes and CUDA processes without CUDA graphs offload their weights (the storages come back at new
    addresses, which eager kernels read at each call). With CUDA graphs the weights stay in the image (the CUDA
    checkpoint copies them) rather than the capture being refused; ``remedy`` says how to move them out.
    """
    if device_type != "cuda":
        return MemoryPlan(True, True, f"offloaded: {device_type} worker, no CUDA graphs")
    if not graphs:
        return MemoryPlan(True, True, "offloaded: no CUDA graphs")
    return MemoryPlan(
        False, False, f"in image: CUDA graphs captured at start read the weights at their addresses; {remedy}"
    )


def model_weights(model: Any, prefix: str) -> dict[str, Any]:
    """The model's parameters (name → tensor) under ``prefix``; empty ones are left out."""
    return {
        f"{prefix}.{name}": p
        for name, p in model.named_parameters(remove_duplicate=False)
        if p.untyped_storage().nbytes() > 0
    }


def process_title(pid: int | None = None) -> str:
    """A process's title as its engine set it (``sglang::scheduler_TP0``, ``VLLM::Worker``…), else its
    command name; empty when it is gone."""
    try:
        with open(f"/proc/{pid or os.getpid()}/cmdline", "rb") as fh:
            return fh.read().split(b"\0")[0].decode(errors="replace")[:80]
    except OSError:
        return ""


def titled(pids: Iterable[int], prefix: str) -> list[int]:
    """The PIDs among ``pids`` whose process title starts with ``prefix`` (an engine's model processes)."""
    return sorted({int(p) for p in pids if process_title(int(p)).startswith(prefix)})


class ModelProcessAdapter(EngineAdapter):
    """The adapter of a process that holds a model (SGLang's schedulers, TensorRT-LLM's executor workers).

    Its agent's role is ``worker``: the daemon quiesces it after the front end (which has stopped work and
    released the KV cache through the engine), writes the buffers it names to the buffer store, and resumes it
    before the front end. Subclasses give :attr:`model`, :attr:`rank`, :meth:`graphs`, :attr:`remedy` and
    ``quiesce`` (what to check before the weights go).
    """

    remedy = ""
    """How to move the weights out while CUDA graphs would read them (an engine flag)."""

    @property
    def model(self) -> Any:
        """The ``torch.nn.Module`` whose parameters are the weights."""
        raise NotImplementedError

    @property
    def rank(self) -> str:
        """The process's rank, prefixing its buffer names (``tp1``, ``rank0``…)."""
        raise NotImplementedError

    def graphs(self) -> bool:
        """Whether the engine captured CUDA graphs in this process."""
        raise NotImplementedError

    def plan(self) -> MemoryPlan:
        param = next(iter(self.model.parameters()), None)
        device = str(param.device.type) if param is not None else "cpu"
        return graph_plan(device, self.graphs(), self.remedy)

    def info(self) -> HelloFacts:
        return HelloFacts(role="worker", process=process_title(), weights=self.plan().why, info={"rank": self.rank})

    async def warm_up(self) -> list[int]:
        return []

    def buffers(self) -> Mapping[str, Any]:
        return model_weights(self.model, self.rank) if self.plan().offload_weights else {}

    async def resume(self, context: RestoreContext | None) -> None:
        """Nothing: the weights are back in place already, and the front end re-creates the KV cache."""
