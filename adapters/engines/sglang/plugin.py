"""gpusnap's SGLang plugin: a gpusnap agent in the front end and in every scheduler process, no engine change.

Installed with gpusnap, it is registered in SGLang's entry-point group for general plugins,
``sglang.srt.plugins`` (``python/sglang/srt/plugins/__init__.py``: ``load_plugins()``, called by
``Engine.__init__`` and ``Engine._launch_subprocesses`` in the front end and first thing in
``run_scheduler_process``, i.e. in every scheduler process; ``SGLANG_PLUGINS`` may restrict which plugins
load, so keep ``gpusnap`` in it if you set it). With ``GPUSNAP_AGENT_SOCKET`` unset, :func:`register`
returns at once. With it set, it blocks io_uring in the process and its children, applies the capture
settings (``gpusnap.adapters.contract.capture_settings``) and registers two hooks with SGLang's own
``HookRegistry`` (``sglang.srt.plugins.hook_registry``), which ``load_plugins`` applies:

- before ``Scheduler.run_event_loop`` (the model and KV cache exist): the scheduler's agent
  (:class:`~gpusnap.adapters.engines.sglang.processes.SglangSchedulerAdapter`, on its own thread and loop);
- after ``TokenizerManager.auto_create_handle_loop`` (the tokenizer manager's loop runs: the HTTP server's
  own warm-up request, or your first ``async_generate``): the front end's agent
  (:class:`~gpusnap.adapters.engines.sglang.processes.SglangFrontEnd`) on that loop. A synchronous ``Engine.generate``
  only runs its loop during a call, so the front end of a program that never awaits gets no agent, and its
  capture is refused (``AGENT_MISSING``).

Start SGLang with ``--enable-memory-saver`` (``torch_memory_saver`` installed) so that the KV cache can be
released. Imports only the standard library and gpusnap's adapters (protobuf).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from gpusnap.adapters.patching import activate, guarded

log = logging.getLogger(__name__)

SCHEDULER_LOOP = "sglang.srt.managers.scheduler.Scheduler.run_event_loop"
HANDLE_LOOP = "sglang.srt.managers.tokenizer_manager.TokenizerManager.auto_create_handle_loop"

_lock = threading.Lock()
_started = False


def register() -> None:
    """The plugin's entry point (see the module docstring); safe to call more than once."""
    if not activate("sglang"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SCHEDULER_LOOP, _before_scheduler_loop, HookType.BEFORE)
    HookRegistry.register(HANDLE_LOOP, _after_handle_loop, HookType.AFTER)


def _start(adapter: Any, loop: asyncio.AbstractEventLoop | None) -> None:
    global _started
    with _lock:
        if _started:
            return
        _started = True
    from gpusnap.adapters import agent

    if agent.current() is not None:
        log.warning("gpusnap: this process already runs a gpusnap agent; the SGLang plugin starts none")
        return
    agent.start_agent(adapter, loop=loop)
    log.info("gpusnap: agent started in %s (%s)", os.getpid(), adapter.info().get("role"))


def _before_scheduler_loop(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """``HookType.BEFORE`` on ``Scheduler.run_event_loop``: returns None (arguments unchanged)."""

    def start() -> None:
        from gpusnap.adapters.engines.sglang.processes import SglangSchedulerAdapter

        _start(SglangSchedulerAdapter(scheduler), None)

    guarded("attach to the SGLang scheduler", start)


def _after_handle_loop(result: Any, tokenizer_manager: Any, *args: Any, **kwargs: Any) -> None:
    """``HookType.AFTER`` on ``TokenizerManager.auto_create_handle_loop``: returns None (result unchanged)."""
    if _started:
        return

    def start() -> None:
        from gpusnap.adapters.engines.sglang.processes import SglangFrontEnd

        loop: asyncio.AbstractEventLoop | None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = getattr(tokenizer_manager, "event_loop", None)
        if loop is None or not loop.is_running():
            log.warning("gpusnap: SGLang's tokenizer manager has no running event loop; no agent for it")
            return
        _start(SglangFrontEnd(tokenizer_manager), loop)

    guarded("attach to the SGLang tokenizer manager", start)
