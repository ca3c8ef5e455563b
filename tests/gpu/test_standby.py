"""A standby on a real GPU (``make test-gpu``): the 1B LLM worker with a CUDA graph over address-stable
weights is captured, restored ahead (``gpusnap standby``: stopped, CUDA-checkpointed, holding no GPU
memory), then activated onto a GPU named with ``--gpu`` with its weights prefilled by gpusnapd; it answers
with the capture-time greedy tokens. The CPU tests of the same path are tests/daemon/operations/test_standby.py,
tests/daemon/test_standby_cli.py and tests/adapters/test_prefill_cpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpusnap.daemon.drivers import proc as procs
from tests.conftest import kill_tree, start_daemon, stop_daemon, wait_for
from tests.gpu.test_gpu_engine import request, start_llm
from tests.shortdirs import short_dir

pytestmark = pytest.mark.gpu


def test_standby_holds_no_gpu_memory_and_activates_to_the_same_tokens(tmp_path: Path) -> None:
    buffers = short_dir("gpusnap-standby-", 0o700, "/dev/shm")  # a RAM tier
    d = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", "GPUSNAP_BUFFER_DIR": str(buffers)})
    wd = tmp_path / "llm"
    worker = start_llm(d, wd, "1b", "--graphs")
    up = 0
    try:
        before = request(wd, 1)["tokens"]
        d.cli("dump", str(worker.pid), "--name", "llm", check=True, timeout=900)
        assert worker.wait(timeout=60) == -9
        made = json.loads(d.cli("-o", "json", "standby", "llm", check=True, timeout=900).stdout)
        (sb,) = made["standbys"]
        up = sb["pid"]
        node = json.loads(d.cli("-o", "json", "node", check=True).stdout)
        on_gpu = {p["pid"] for g in node["gpus"] for p in g["processes"]}
        assert not on_gpu & set(sb["pids"]), "a standby holds no GPU memory"
        assert sb["host_memory_bytes"] > 0 and all(procs.stopped(p) for p in sb["pids"])
        wait_for(lambda: "GiB of blobs registered" in d.cli("node", check=True).stdout, 120, "weights not registered")
        gpu = node["gpus"][-1]["uuid"]  # any GPU of the same model
        done = json.loads(d.cli("-o", "json", "activate", sb["id"], "--gpu", gpu, check=True, timeout=900).stdout)
        assert done["pid"] == sb["pid"]
        assert request(wd, 2)["tokens"] == before, "the activated worker answers with the capture-time tokens"
        node = json.loads(d.cli("-o", "json", "node", check=True).stdout)
        assert any(p["pid"] in sb["pids"] for g in node["gpus"] if g["uuid"] == gpu for p in g["processes"])
        print(f"\nMEASURED standby {made['phases']}; activate {done['phases']}")
    finally:
        kill_tree(worker.pid, up)
        stop_daemon(d)
