"""Fake ``sglang`` (see ../README.md): ``sglang.Engine`` resolves lazily, so a spawned child imports only what it runs."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
