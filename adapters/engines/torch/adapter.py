"""PyTorch adapter: for workers with their own generation loop.

The worker names its warm-up (a deterministic request returning token ids), and optionally how to
quiesce and resume. Defaults: quiesce = ``torch.cuda.synchronize()`` + ``torch.cuda.empty_cache()``
(cached but unused blocks are not captured), resume = nothing to do.

``buffers`` names the tensors to keep out of the image, typically the weights::

    TorchAdapter(warm_up, buffers=lambda: dict(model.named_parameters()))

They are written to gpusnapd's buffer store at capture and read back on resume through pinned memory,
which restores an 8B model's weights far faster than CRIU and the CUDA checkpoint carry them
(``docs/performance.md``).

A worker whose CUDA graphs read those tensors creates the adapter with ``stable_addresses=True`` *before*
capturing its graphs: the named tensors then move into VMM arenas (:func:`gpusnap.adapters.vmm.stabilize`)
and come back at the same device addresses after a restore, so the graphs stay valid::

    adapter = TorchAdapter(warm_up, buffers=lambda: dict(model.named_parameters()), stable_addresses=True)
    capture_graphs(model)
    start_agent(adapter)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gpusnap.adapters.base import EngineAdapter, RestoreContext

Hook = Callable[..., Any]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _default_quiesce() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class TorchAdapter(EngineAdapter):
    """Adapter over user callables (sync or async).

    Args:
        warm_up: ``() -> list[int]``: a deterministic generation; its tokens are the canary.
        quiesce: ``() -> None``; default synchronizes and empties the CUDA cache.
        resume: ``(RestoreContext | None) -> None``; default does nothing.
        health: ``() -> list[int]``; default ``warm_up``.
        lock: an asyncio lock the worker's own loop holds while generating, so quiesce waits for the
            current step (optional).
        buffers: ``() -> Mapping[str, torch.Tensor]``: tensors kept out of the image while quiesced
            (see :meth:`EngineAdapter.buffers`); default none.
        stable_addresses: move the CUDA tensors ``buffers`` names into VMM arenas now, so they keep their
            device addresses across offload and reload (see the module docstring). Tensors that quiesce
            later names but that were not moved here are refused (``ValueError`` at quiesce).

    Raises:
        ValueError: ``stable_addresses`` without ``buffers``.
        gpusnap.adapters.vmm.VmmError: moving the tensors failed (they are left where they were).
    """

    engine = "torch"

    def __init__(
        self,
        warm_up: Callable[[], list[int] | Awaitable[list[int]]],
        *,
        quiesce: Hook | None = None,
        resume: Hook | None = None,
        health: Callable[[], list[int] | Awaitable[list[int]]] | None = None,
        lock: asyncio.Lock | None = None,
        buffers: Callable[[], Mapping[str, Any]] | None = None,
        stable_addresses: bool = False,
    ):
        self._warm_up = warm_up
        self._quiesce = quiesce or _default_quiesce
        self._resume = resume
        self._health = health or warm_up
        self._lock = lock
        self._held = False
        self._buffers = buffers
        self.stable_addresses = stable_addresses
        if stable_addresses:
            if buffers is None:
                raise ValueError("stable_addresses=True needs buffers= (the tensors to keep at fixed addresses)")
            from gpusnap.adapters import vmm

            vmm.stabilize(buffers())

    async def warm_up(self) -> list[int]:
        return list(await _maybe_await(self._warm_up()))

    async def quiesce(self) -> None:
        if self._lock is not None and not self._held:
            await self._lock.acquire()
            self._held = True
        await _maybe_await(self._quiesce())

    async def resume(self, context: RestoreContext | None) -> None:
        if self._resume is not None:
            await _maybe_await(self._resume(context))
        if self._held and self._lock is not None:
            self._lock.release()
            self._held = False

    def buffers(self) -> Mapping[str, Any]:
        named = dict(self._buffers()) if self._buffers is not None else {}
        if self.stable_addresses:
            from gpusnap.adapters import vmm

            moving = [n for n, t in named.items() if vmm.movable(t)]
            if moving:
                raise ValueError(
                    f"{len(moving)} buffers (e.g. {moving[0]!r}) are not address-stable: they were "
                    "created after the adapter; a CUDA graph reading them would break at reload"
                )
        return named

    async def health(self) -> list[int]:
        return list(await _maybe_await(self._health()))
