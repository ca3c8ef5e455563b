"""The capture-settings base: what a row of the capture-settings table is, and what one engine declares.

The table itself, and what reads it, is :mod:`gpusnap.adapters.contract.capture_settings`; each engine's
part is ``gpusnap.adapters.engines.<name>.settings`` (collected by :mod:`gpusnap.adapters.contract.registry`).
This module imports only the standard library: it runs inside engine processes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Scope(enum.Enum):
    """Which process layouts need a setting (see :mod:`gpusnap.adapters.contract.capture_settings`)."""

    ANY = "any"
    MULTI_PROCESS = "multi_process"
    TENSOR_PARALLEL = "tensor_parallel"


class Kind(enum.Enum):
    """Where a setting lives."""

    ENV = "env"
    """An environment variable, read by the library when it starts (set it before the engine starts)."""
    ENGINE_ARG = "engine_arg"
    """A command-line flag of the engine (``name``), also an engine-args field (``engine_field``)."""


@dataclass(frozen=True)
class CaptureSetting:
    """One row of the capture-settings table.

    Attributes:
        name: environment variable, or the engine's flag for :attr:`Kind.ENGINE_ARG` rows.
        value: the value to set (``""`` for a flag that takes none).
        reason: why a captured worker needs it, one sentence.
        scope: which layouts need it.
        failure_cases: ids of the failure cases it prevents (``docs/tensor-parallel.md``).
        engine: ``"vllm"``, ``"sglang"``, ``"trtllm"`` when only that engine reads it, else ``None``.
        kind: environment variable or engine argument.
        engine_field: for engine arguments, the engine-args attribute (vLLM ``EngineArgs``) the flag sets.
    """

    name: str
    value: str
    reason: str
    scope: Scope = Scope.ANY
    failure_cases: tuple[str, ...] = ()
    engine: str | None = None
    kind: Kind = Kind.ENV
    engine_field: str = ""

    def requirement(self) -> str:
        """How a refusal names it: ``NAME=value`` for variables, the flag for engine arguments."""
        return self.name if self.kind is Kind.ENGINE_ARG else f"{self.name}={self.value}"


@dataclass(frozen=True)
class EngineSettings:
    """What one engine declares (``gpusnap.adapters.engines.<name>.settings.SETTINGS``).

    Attributes:
        name: the engine's name, as its adapters report it (``engine``) and its rows carry it.
        markers: program or ``-m`` module names that run it (``vllm`` matches ``vllm serve …`` and
            ``python -m vllm.entrypoints…``); the daemon's preflight recognises the engine by them.
        tensor_parallel_flags: its command-line flags that give a tensor-parallel size.
        rows: the capture settings only this engine reads (each with ``engine=name``).
    """

    name: str
    markers: tuple[str, ...] = ()
    tensor_parallel_flags: tuple[str, ...] = ()
    rows: tuple[CaptureSetting, ...] = ()

    def __post_init__(self) -> None:
        strays = [s.name for s in self.rows if s.engine != self.name]
        if strays:
            raise ValueError(f"engine {self.name}'s capture settings {strays} name another engine")
