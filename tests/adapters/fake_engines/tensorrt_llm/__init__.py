"""Fake ``tensorrt_llm`` (see ../README.md); ``LLM`` and ``SamplingParams`` resolve lazily."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("LLM", "SamplingParams"):
        from tensorrt_llm import llmapi

        return getattr(llmapi, name)
    raise AttributeError(name)
