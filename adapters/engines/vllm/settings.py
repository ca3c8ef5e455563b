"""vLLM's capture settings, the command lines that run it and its tensor-parallel flags
(:class:`~gpusnap.adapters.contract.settings.EngineSettings`; imports only the contract)."""

from __future__ import annotations

from gpusnap.adapters.contract.settings import CaptureSetting, EngineSettings, Kind, Scope

SETTINGS = EngineSettings(
    name="vllm",
    markers=("vllm",),
    tensor_parallel_flags=("--tensor-parallel-size", "-tp"),
    rows=(
        CaptureSetting(
            "VLLM_WORKER_MULTIPROC_METHOD",
            "spawn",
            "fork would copy CUDA state and open files into children",
            engine="vllm",
        ),
        CaptureSetting(
            "VLLM_ALLREDUCE_USE_SYMM_MEM",
            "0",
            "vLLM's symmetric-memory all-reduce maps peer GPU memory (CUDA IPC, multicast)",
            Scope.TENSOR_PARALLEL,
            ("FC-05", "FC-07"),
            engine="vllm",
        ),
        CaptureSetting(
            "--disable-custom-all-reduce",
            "",
            "vLLM's custom all-reduce shares GPU buffers between ranks over CUDA IPC",
            Scope.TENSOR_PARALLEL,
            ("FC-05", "FC-07"),
            engine="vllm",
            kind=Kind.ENGINE_ARG,
            engine_field="disable_custom_all_reduce",
        ),
    ),
)
