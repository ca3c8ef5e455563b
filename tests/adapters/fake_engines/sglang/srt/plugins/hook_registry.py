"""``sglang/srt/plugins/hook_registry.py``: ``HookRegistry.register(target, hook, hook_type)`` and
``apply_hooks()``, for functions and methods (BEFORE: ``hook(*args, **kwargs)`` returns ``None`` or new
``(args, kwargs)``; AFTER: ``hook(result, *args, **kwargs)`` returns ``None`` or a new result)."""

from __future__ import annotations

import enum
import functools
import pkgutil
from collections.abc import Callable
from typing import Any


class HookType(enum.Enum):
    BEFORE = "before"
    AFTER = "after"


class HookRegistry:
    _hooks: dict[str, list[tuple[HookType, Callable[..., Any]]]] = {}
    _patched: set[str] = set()

    @classmethod
    def register(cls, target: str, hook: Callable[..., Any], hook_type: HookType = HookType.AFTER) -> None:
        cls._hooks.setdefault(target, []).append((hook_type, hook))

    @classmethod
    def apply_hooks(cls) -> None:
        for target, hooks in cls._hooks.items():
            if target in cls._patched:
                continue
            owner_path, attr = target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            fn = getattr(owner, attr)
            for hook_type, hook in hooks:
                fn = _wrap(fn, hook, hook_type)
            setattr(owner, attr, fn)
            cls._patched.add(target)


def _wrap(original: Callable[..., Any], hook: Callable[..., Any], hook_type: HookType) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if hook_type is HookType.BEFORE:
            changed = hook(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return original(*args, **kwargs)
        result = original(*args, **kwargs)
        changed = hook(result, *args, **kwargs)
        return result if changed is None else changed

    return wrapper
