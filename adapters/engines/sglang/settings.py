"""SGLang's capture settings (none of its own yet), the command lines that run it and its tensor-parallel
flags (:class:`~gpusnap.adapters.contract.settings.EngineSettings`; imports only the contract)."""

from __future__ import annotations

from gpusnap.adapters.contract.settings import EngineSettings

SETTINGS = EngineSettings(
    name="sglang", markers=("sglang",), tensor_parallel_flags=("--tp-size", "--tensor-parallel-size", "--tp")
)
