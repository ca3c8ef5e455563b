"""PyTorch adapter: for workers with their own generation loop.

The worker names its warm-up (a deterministic request returning token ids), and optionally how to
quiesce and resume. Defaults: quiesce = ``torch.cuda.synchronize()`` + ``torch.cuda.empty_cache()``
(cached but unused blocks are not captured), resume = nothing to do.

``buffers`` names the tensors to keep out of the image, typically the weights::

    TorchAdapter(warm_up, buffers=lambda: dict(model.named_parameters()))

They are written to gpusnapd's buffer store at capture and read back on resume through pinned memory,
which restores an 8B model's weights far faster than CRIU and the CUDA checkpoint carry them
(``docs/performance.md``).
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
    ):
        self._warm_up = warm_up
        self._quiesce = quiesce or _default_quiesce
        self._resume = resume
        self._health = health or warm_up
        self._lock = lock
        self._held = False
        self._buffers = buffers

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
        return dict(self._buffers()) if self._buffers is not None else {}

    async def health(self) -> list[int]:
        return list(await _maybe_await(self._health()))
