"""EngineAdapter: what gpusnap needs from an inference engine to capture and restore it.

An adapter is a small object with four coroutines, called by the worker agent on the engine's own
event loop, one at a time:

- ``warm_up()``: run deterministic request(s) that exercise prefill, decode, the sampler and the host
  path (docs/engines.md, "The warm-up request and the canary"), then reset prefix caches; returns the
  canary's token ids.
- ``quiesce()``: stop taking work, finish or abort in-flight requests, and free what should not be
  captured (the KV cache by default). If it raises, the agent calls ``resume(None)`` and reports the
  error, so a failed capture leaves the worker serving.
- ``resume(context)``: undo ``quiesce`` (``context`` is ``None`` when a failed capture rolls back, a
  :class:`RestoreContext` in a restored copy).
- ``health()``: the canary generation again; its token ids must equal ``warm_up``'s.

Optionally, ``buffers()`` names large tensors (weights) to keep out of the image: after ``quiesce`` the
agent writes them to the daemon's buffer store and frees them, and reads them back before ``resume``.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class RestoreContext:
    """What a restored worker receives: environment changes and identity values (new port, node name…)."""

    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unset_env: Sequence[str] = ()
    values: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def apply_env(self) -> None:
        """Apply ``env`` and ``unset_env`` to ``os.environ`` (CRIU brings back the capture-time environment)."""
        for name in self.unset_env:
            os.environ.pop(name, None)
        os.environ.update(self.env)


@dataclasses.dataclass(frozen=True)
class HelloFacts:
    """What an engine process says of itself in its agent's hello (``AgentHello`` in agent.proto)."""

    role: str = ""
    """``frontend``, ``core``, ``worker``, or empty for a single-process worker (a front end)."""
    process: str = ""
    """The process's title (``VLLM::Worker``…), for messages."""
    expect_pids: tuple[int, ...] = ()
    """Engine processes this one started (PIDs in its namespace), each of which needs an agent."""
    weights: str = ""
    """Where the process's weights go, and why (``offloaded: …`` or ``in image: …``)."""
    info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Engine facts for people (API, data-parallel size…); gpusnapd only logs them."""


WARMUP_PROMPT_TOKEN_IDS = (1, 5, 6, 7)
"""Token-only warm-up prompt: needs no tokenizer or chat template (docs/engines.md, "The warm-up request")."""
WARMUP_MAX_TOKENS = 2
"""Two tokens: one prefill and at least one decode step (a CUDA-graph replay on GPU engines)."""


class EngineAdapter(abc.ABC):
    """Base of the per-engine adapters; ``engine`` names the engine in the agent's hello."""

    engine: str = "unknown"

    def info(self) -> HelloFacts:
        """What this process says of itself in its agent's hello."""
        return HelloFacts()

    @abc.abstractmethod
    async def warm_up(self) -> list[int]:
        """Run the warm-up request(s); return the canary's token ids."""

    @abc.abstractmethod
    async def quiesce(self) -> None:
        """Stop work and free memory that need not be captured."""

    @abc.abstractmethod
    async def resume(self, context: RestoreContext | None) -> None:
        """Undo :meth:`quiesce`; ``context`` is set in a restored copy."""

    def buffers(self) -> Mapping[str, Any]:
        """Tensors (name → ``torch.Tensor``) to keep out of the image while quiesced; default none.

        Called after :meth:`quiesce`. Their storages are freed and later refilled in place (same tensor
        objects, new device addresses): leave out anything a captured CUDA graph reads.
        """
        return {}

    async def health(self) -> list[int]:
        """The canary generation; by default the warm-up request again."""
        return await self.warm_up()

    def released_bytes(self) -> int:
        """Bytes of memory the last :meth:`quiesce` freed without saving them (a KV cache), for ``gpusnap
        inspect``; default 0."""
        return 0
