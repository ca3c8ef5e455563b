"""Hooks into an engine's classes, set when the engine imports their module, for gpusnap's engine plugins.

Used where an engine offers no hook registry of its own (vLLM's plugin, which vLLM loads in every process;
TensorRT-LLM's one-line :func:`gpusnap.adapters.engines.trtllm.plugin.enable`). Modules are patched when the engine
imports them (a post-import hook on ``sys.meta_path``), so a process imports nothing of the engine's on
gpusnap's account. A hook that fails is logged and never reaches the engine, which then serves without
gpusnap. Standard library only.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_hooks: dict[str, list[Callable[[ModuleType], None]]] = {}


class HookMissing(RuntimeError):
    """An engine release lacks a method a gpusnap plugin hooks: raised at start-up, when the engine imports
    the module (never swallowed by :func:`guarded`), so the engine stops with the version and the hook named
    instead of serving a worker that cannot be captured."""


def guarded(what: str, fn: Callable[[], None]) -> None:
    """Run a hook; a failure is logged and never reaches the engine (it serves without gpusnap), except
    :class:`HookMissing`, which stops the engine's start."""
    try:
        fn()
    except HookMissing:
        raise
    except Exception:
        log.exception("gpusnap: could not %s; this process has no gpusnap agent", what)


def missing(hook: str, engine: str) -> HookMissing:
    """The :class:`HookMissing` for ``hook`` (a dotted method name) absent from ``engine`` (``"vLLM 0.26.0"``)."""
    return HookMissing(
        f"gpusnap's plugin hooks {hook}, which {engine} does not have; run an engine release gpusnap supports "
        "(docs/engines.md), or unset GPUSNAP_AGENT_SOCKET to run the engine without gpusnap"
    )


def require(cls: type, name: str, engine: str) -> None:
    """Raise :class:`HookMissing` unless ``cls`` defines ``name`` itself (``engine``: e.g. ``"vLLM 0.26.0"``)."""
    if name not in cls.__dict__:
        raise missing(f"{cls.__module__}.{cls.__qualname__}.{name}", engine)


def around(cls: type, name: str, wrapper: Callable[..., Any]) -> None:
    """Replace ``cls.name`` by ``wrapper(original, self, *args, **kwargs)`` (once; a second call does nothing).

    Raises:
        KeyError: ``cls`` does not define ``name`` (use :func:`require` first where that must stop the engine).
    """
    original = cls.__dict__[name]
    if getattr(original, "_gpusnap", False):
        return

    @functools.wraps(original)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        return wrapper(original, self, *args, **kwargs)

    patched._gpusnap = True  # type: ignore[attr-defined]
    setattr(cls, name, patched)


def _wrap(cls: type, name: str, hook: Callable[..., None], *, run_after: bool) -> None:
    def wrapper(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        if not run_after:
            guarded(f"attach to {cls.__name__}", lambda: hook(self))
        result = original(self, *args, **kwargs)
        if run_after:
            guarded(f"attach to {cls.__name__}", lambda: hook(self))
        return result

    around(cls, name, wrapper)


def after(cls: type, name: str, hook: Callable[..., None]) -> None:
    """Run ``hook(self)`` once ``cls.name`` returned (guarded)."""
    _wrap(cls, name, hook, run_after=True)


def before(cls: type, name: str, hook: Callable[..., None]) -> None:
    """Run ``hook(self)`` before ``cls.name`` (guarded)."""
    _wrap(cls, name, hook, run_after=False)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of a hooked module so its hooks run after it executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _run_hooks(module)


_finder = _PostImportFinder()


def _run_hooks(module: ModuleType) -> None:
    for hook in _hooks.pop(module.__name__, []):
        guarded(f"patch {module.__name__}", functools.partial(hook, module))


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` now if ``name`` is imported, else right after the engine imports it."""
    module = sys.modules.get(name)
    if module is not None:
        guarded(f"patch {name}", functools.partial(hook, module))
        return
    _hooks.setdefault(name, []).append(hook)
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


ENV_SOCKET = "GPUSNAP_AGENT_SOCKET"
_activate_lock = threading.Lock()
_activated: set[str] = set()


def activate(engine: str) -> bool:
    """An engine plugin's first step: ``True`` the first time in this process that ``engine``'s plugin runs with
    ``GPUSNAP_AGENT_SOCKET`` set, after blocking io_uring in the process and its future children
    (:func:`gpusnap.adapters.io_uring.block_io_uring`) and applying the capture settings for ``engine``
    (:func:`gpusnap.adapters.env.configure_capture_env`), and saying in the log if gpusnapd cannot be reached at
    the socket (:func:`gpusnap.adapters.reach.check_at_start`); ``False`` otherwise (the plugin then does nothing)."""
    if not os.environ.get(ENV_SOCKET):
        return False
    with _activate_lock:
        if engine in _activated:
            return False
        _activated.add(engine)
    from gpusnap.adapters.env import configure_capture_env
    from gpusnap.adapters.io_uring import block_io_uring
    from gpusnap.adapters.reach import check_at_start

    block_io_uring()
    configure_capture_env(engine=engine)
    check_at_start(os.environ[ENV_SOCKET])  # said in the engine's log now, not found out at the first dump
    return True
