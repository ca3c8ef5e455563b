"""SGLang and TensorRT-LLM in their real process layouts (multi-process fakes, tests/adapters/fake_engines,
real CPU tensors), with gpusnap installed into the environment as a user would, captured and restored through
the daemon with real CRIU:

- SGLang, TP=2: front end (tokenizer manager) + ``sglang::scheduler_TP0`` / ``_TP1`` + ``sglang::detokenizer``,
  spawned; gpusnap's plugin is loaded by the engine (entry point ``sglang.srt.plugins``), one agent in the
  front end and one in each scheduler;
- TensorRT-LLM: the ``LLM`` front end + its executor worker process, gpusnap enabled by its one documented
  call; one agent in each.

For each: an offload that fails in one model process (a file-size limit on it: its write of the weights fails
with EFBIG) leaves every process resumed and serving; ``dump --no-offload --leave-running`` against ``dump``
of the same engine: the image shrinks by at least 90 % of the weight bytes, which the buffer store holds, and
the weights are the model processes'; the restored engine gives the same greedy tokens. Then an engine where
one model process has no agent is refused, naming that process, and keeps serving.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.adapters import torch_venv
from tests.conftest import DaemonProc, kill_tree, phase_seconds, wait_for

pytestmark = [torch_venv.needs_venv, pytest.mark.slow, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
USER = HERE / "fake_engine_user.py"
FAKES = HERE / "fake_engines"
PROMPT = [1, 5, 6, 7]
OTHER_PROMPT = [3, 9, 27, 81, 243]


class Engine:
    """One fake engine's user program (``fake_engine_user.py``) and its process tree."""

    def __init__(self, daemon: DaemonProc, tmp: Path, target: Path, name: str, engine: str, *args: str, **env: str):
        self.wd = tmp / name
        self.wd.mkdir()
        penv = torch_venv.plugin_env(daemon, tmp, target, **env)
        penv["PYTHONPATH"] = f"{target}:{FAKES}"
        self.proc: subprocess.Popen[bytes] = torch_venv.start(
            USER, [engine, str(self.wd), *args], penv, self.wd / "out"
        )
        self.n = 0

    def wait_ready(self) -> None:
        wait_for(lambda: (self.wd / "ready").exists() or self.proc.poll() is not None, 240, "engine did not start")
        assert self.proc.poll() is None, self.log()

    def generate(self, prompt: list[int]) -> list[int]:
        self.n += 1
        tmp = self.wd / f".go-{self.n}"  # whole when it appears: the engine reads go-N as soon as it exists
        tmp.write_text(json.dumps(prompt))
        tmp.rename(self.wd / f"go-{self.n}")
        out = self.wd / f"tokens-{self.n}"
        wait_for(out.exists, 120, f"engine did not answer request {self.n}: {self.log()}")
        result = json.loads(out.read_text())
        assert "tokens" in result, result
        return list(result["tokens"])

    def process(self, title: str) -> int:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.cmdline()[:1] == [title]:
                return int(child.pid)
        raise AssertionError(f"no {title} process")

    def log(self) -> str:
        return (self.wd / "out").read_text()[-3000:]


def _dump(daemon: DaemonProc, pid: int, name: str, *args: str) -> dict[str, Any]:
    res = daemon.cli("-o", "json", "dump", str(pid), "--name", name, *args, timeout=600)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _capture_and_restore(
    daemon: DaemonProc, engine: Engine, name: str, model_pid: int, model_title: str, models: list[str]
) -> None:
    """The checks every engine gets (see the module docstring); ``models``: the model processes' titles."""
    before, other = engine.generate(PROMPT), engine.generate(OTHER_PROMPT)

    limit = resource.prlimit(model_pid, resource.RLIMIT_FSIZE)
    resource.prlimit(model_pid, resource.RLIMIT_FSIZE, (1 << 20, limit[1]))  # its weight files stop at 1 MiB
    failed = daemon.cli("dump", str(engine.proc.pid), "--name", f"{name}-fail", timeout=600)
    resource.prlimit(model_pid, resource.RLIMIT_FSIZE, limit)
    assert failed.returncode == 4, failed.stderr
    assert model_title in failed.stderr and "File too large" in failed.stderr, failed.stderr
    assert engine.proc.poll() is None
    assert engine.generate(PROMPT) == before, "every process resumed: the source keeps serving"
    assert daemon.cli("inspect", f"{name}-fail").returncode == 3, "no half-written snapshot is listed"

    full = _dump(daemon, engine.proc.pid, f"{name}-full", "--no-offload", "--leave-running")
    assert engine.generate(PROMPT) == before, "serving again after --leave-running"
    off = _dump(daemon, engine.proc.pid, name)
    snap = dict(json.loads(daemon.cli("-o", "json", "inspect", name, check=True).stdout))
    weights = int(snap["buffer_bytes"])
    assert weights >= (8 << 20) * len(models), "each model process's weights are named"
    assert full["size_bytes"] - off["size_bytes"] >= 0.9 * weights, (full["size_bytes"], off["size_bytes"], weights)
    for ref in snap["buffers"]:
        blob = daemon.store / "buffers" / "sha256" / str(snap["worker"]["uid"]) / ref["sha256"]
        assert blob.stat().st_size == int(ref["size_bytes"]), "the buffer store holds the weights"
    agents = [snap["worker"], *snap.get("agents", [])]
    assert [a["role"] for a in agents] == ["frontend"] + ["worker"] * len(models), agents
    workers = {a["instance_id"]: a for a in agents if a["role"] == "worker"}
    assert sorted(a["process"] for a in workers.values()) == sorted(models), agents
    assert all(a["weights"].startswith("offloaded") for a in workers.values()), agents
    assert {b["agent"] for b in snap["buffers"]} == set(workers), "the weights are the model processes'"
    assert "offload" in phase_seconds(off), phase_seconds(off)
    assert engine.proc.wait(timeout=60) == -9

    restored = json.loads(daemon.cli("-o", "json", "restore", name, check=True, timeout=600).stdout)
    try:
        assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"], phase_seconds(restored)
        assert engine.generate(PROMPT) == before, "the restored engine gives the same greedy tokens"
        assert engine.generate(OTHER_PROMPT) == other
        print(
            f"\nMEASURED {name}: image {full['size_bytes']} B without offload, {off['size_bytes']} B with, "
            f"{weights} B of weights in the buffer store; dump {off['phases']}; restore {restored['phases']}"
        )
    finally:
        kill_tree(restored["pid"])


def _refused(daemon: DaemonProc, engine: Engine, missing_pid: int, title: str) -> None:
    before = engine.generate(PROMPT)
    res = daemon.cli("dump", str(engine.proc.pid), timeout=600)
    assert res.returncode == 4, res.stderr
    assert "AGENT_MISSING" in res.stderr or "has no gpusnap agent" in res.stderr, res.stderr
    assert f"PID {missing_pid} ({title})" in res.stderr, res.stderr
    assert engine.generate(PROMPT) == before, "a refused capture leaves the engine serving"


def test_sglang_tp2(daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path) -> None:
    a = Engine(daemon, tmp_path, gpusnap_target, "a", "sglang", "--tp", "2")
    b = Engine(daemon, tmp_path, gpusnap_target, "b", "sglang", "--tp", "2", FAKE_SGLANG_NO_PLUGINS_TP="1")
    try:
        a.wait_ready()
        b.wait_ready()
        models = ["sglang::scheduler_TP0", "sglang::scheduler_TP1"]
        _capture_and_restore(daemon, a, "sgl", a.process(models[1]), models[1], models)
        _refused(daemon, b, b.process(models[1]), models[1])
    finally:
        kill_tree(a.proc.pid, b.proc.pid)


def test_trtllm(daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path) -> None:
    a = Engine(daemon, tmp_path, gpusnap_target, "a", "trtllm")
    b = Engine(daemon, tmp_path, gpusnap_target, "b", "trtllm", FAKE_TRTLLM_WORKER_UNSET="GPUSNAP_AGENT_SOCKET")
    try:
        a.wait_ready()
        b.wait_ready()
        worker = _executor_worker(a)
        title = psutil.Process(worker).cmdline()[0]
        _capture_and_restore(daemon, a, "trt", worker, "trtllm", [title])
        _refused(daemon, b, _executor_worker(b), title)
    finally:
        kill_tree(a.proc.pid, b.proc.pid)


def _executor_worker(engine: Engine) -> int:
    """The executor worker: the front end's spawned child that runs ``spawn_main`` (not the resource tracker)."""
    for child in psutil.Process(engine.proc.pid).children():
        if "spawn_main" in " ".join(child.cmdline()):
            return int(child.pid)
    raise AssertionError("no executor worker process")


PLUGIN_PROBE = r"""
import json, sys
from importlib.metadata import entry_points
before = set(sys.modules)
(ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "gpusnap"]
ep.load()()
from sglang.srt.plugins.hook_registry import HookRegistry
import gpusnap.adapters.engines.trtllm.plugin as trt
trt.enable()
new = sorted({m.split(".")[0] for m in set(sys.modules) - before})
print(json.dumps({"target": ep.value, "hooks": sorted(HookRegistry._hooks), "modules": new,
                  "meta_path": sum(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)}))
"""


@pytest.mark.parametrize("socket_set", [False, True])
def test_plugins_inert_without_the_socket_and_light_with_it(
    gpusnap_target: Path, tmp_path: Path, socket_set: bool
) -> None:
    """The SGLang entry point and TensorRT-LLM's enable() register nothing without ``GPUSNAP_AGENT_SOCKET``;
    with it, SGLang gets its two hooks and TensorRT-LLM its post-import patches, and neither imports the
    engine's heavy modules (nor torch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GPUSNAP_"))}
    env["PYTHONPATH"] = f"{gpusnap_target}:{FAKES}"
    if socket_set:
        env["GPUSNAP_AGENT_SOCKET"] = str(tmp_path / "agent.sock")
    out = subprocess.run(
        [str(torch_venv.PYTHON), "-c", PLUGIN_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["target"] == "gpusnap.adapters.engines.sglang.plugin:register"
    expected = [
        "sglang.srt.managers.scheduler.Scheduler.run_event_loop",
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.auto_create_handle_loop",
    ]
    assert got["hooks"] == (expected if socket_set else []), got
    assert got["meta_path"] == (1 if socket_set else 0), got
    assert not {"torch", "tensorrt_llm", "grpc", "numpy"} & set(got["modules"]), got["modules"]
