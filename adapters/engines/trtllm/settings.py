"""TensorRT-LLM's capture settings, the command lines that run it (``trtllm-serve``, ``python -m
tensorrt_llm…``) and its tensor-parallel flag (:class:`~gpusnap.adapters.contract.settings.EngineSettings`;
imports only the contract)."""

from __future__ import annotations

from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings, Scope

SETTINGS = EngineSettings(
    name="trtllm",
    markers=("tensorrt_llm", "trtllm"),
    tensor_parallel_flags=("--tp_size",),
    rows=(
        CaptureSetting(
            "TLLM_NCCL_SYMMETRIC_ZERO_COPY",
            "0",
            "TensorRT-LLM's NCCL registered windows are peer GPU memory",
            Scope.TENSOR_PARALLEL,
            ("FC-05", "FC-07"),
            engine="trtllm",
        ),
    ),
)
