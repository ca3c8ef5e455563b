"""A stock ``vllm serve`` on the GPU (vLLM 0.26 installed at ``/tmp/engine-site``: docs/engines.md, "What is tested"):
a small Llama with dummy bf16 weights and vLLM's default CUDA graphs, gpusnap installed into the engine's
path and ``GPUSNAP_AGENT_SOCKET`` set, nothing else changed. Skipped, with the reason, where no vLLM is there.

One server, in turn:

- it holds no established TCP connection (the plugin's ``file://`` rendezvous at world size 1), and listens
  only on loopback or any address (so it can come up in a private network namespace);
- an offload that fails inside the engine process (a file-size limit on ``VLLM::EngineCore``: its write of
  the weights fails with EFBIG) resumes every process, and the server keeps serving the same tokens;
- a default ``gpusnap dump`` (no flags): the weights leave the image for the buffer store from their
  address-stable arenas, the KV cache is released, the CUDA checkpoint carries neither (GPU memory at capture
  below the weights' bytes), and ``inspect`` says so per process;
- the restore (gpusnapd with ``--gpu-prefill auto``, the buffer store on tmpfs) answers with the same greedy
  token ids, its CUDA graphs replaying over weights and KV cache back at their addresses, and serves a new
  prompt as the source did;
- a second snapshot of the same model (the restored server, captured again) adds no blob bytes;
- a restore onto the GPU through ``--gpu-map`` and in a private network namespace serves the same tokens.

A second server runs with ``GPUSNAP_VLLM_POOLS=1`` (issue 29: the CUDA graph pool, persistent buffers and
workspaces in arenas too) and ``GPUSNAP_SCRATCH_POISON``: ``inspect`` names the regions in arenas, its GPU
memory at capture is printed beside the first server's (``MEASURED``), and the restored server, its scratch memory
poisoned before the canary, gives the same greedy tokens for both prompts, twice.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.adapters.vllm_model import make_tiny_llama
from tests.adapters.vllm_server import VllmServer, engine_env, install_gpusnap, pythonpath
from tests.conftest import DaemonProc, kill_tree, phase_seconds, start_daemon, stop_daemon
from tests.shortdirs import short_dir

ENGINE_SITE = Path(os.environ.get("GPUSNAP_ENGINE_SITE", "/tmp/engine-site"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (ENGINE_SITE / "vllm" / "__init__.py").exists(),
        reason=f"no vLLM at {ENGINE_SITE} (install vLLM 0.26 there, or set GPUSNAP_ENGINE_SITE: docs/engines.md)",
    ),
]

MODEL = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
"""About 0.23 GB of bf16 weights: small enough to start fast, with every kind of layer an 8B Llama has."""
PROMPT = [1, 5, 6, 7]
OTHER_PROMPT = [3, 9, 27, 81, 243]


def serve_args(kv_bytes: int = 512 << 20) -> list[str]:
    """The engine arguments of the GPU tests and the vLLM bench: vLLM's defaults (CUDA graphs on), bf16."""
    return [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--kv-cache-memory-bytes",
        str(kv_bytes),
    ]


def start_server(
    tmp: Path, daemon: DaemonProc, target: Path, model: Path, name: str, *args: str, env: dict[str, str] | None = None
) -> VllmServer:
    """``vllm serve MODEL`` (the ``vllm`` command's own module) with gpusnap installed at ``target``; ``env``:
    more of the server's environment (``GPUSNAP_VLLM_POOLS``…)."""
    env = engine_env(
        dict(os.environ),
        daemon.agent_socket,
        tmp / "wake",
        tmp / "rpc",
        PYTHONPATH=pythonpath(target, ENGINE_SITE),
        VLLM_USE_FLASHINFER_SAMPLER="0",  # flashinfer is not in the device bundle
        **(env or {}),
    )
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
    return VllmServer(argv, model, tmp / f"{name}.log", env, *args)


def blob_bytes(buffer_dir: Path) -> int:
    return sum(f.stat().st_size for f in buffer_dir.rglob("*") if f.is_file())


def dump(daemon: DaemonProc, pid: int, name: str, *args: str) -> dict[str, Any]:
    return dict(
        json.loads(daemon.cli("-o", "json", "dump", str(pid), "--name", name, *args, check=True, timeout=900).stdout)
    )


def inspect(daemon: DaemonProc, name: str) -> dict[str, Any]:
    return dict(json.loads(daemon.cli("-o", "json", "inspect", name, check=True).stdout))


def test_stock_vllm_serve_with_cuda_graphs(tmp_path: Path) -> None:
    buffers = short_dir("gpusnap-vllm-", 0o700, "/dev/shm")  # a RAM tier, as in production
    daemon = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", "GPUSNAP_BUFFER_DIR": str(buffers)})
    target = install_gpusnap(sys.executable, tmp_path / "install")
    model = make_tiny_llama(tmp_path / "m", **MODEL)
    server = start_server(tmp_path, daemon, target, model, "serve", *serve_args())
    pids: list[int] = [server.proc.pid]
    try:
        server.wait_up(900)
        before, other = server.complete(PROMPT), server.complete(OTHER_PROMPT)
        core = server.titled("VLLM::EngineCore")
        tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        conns = [c for p in tree for c in p.net_connections(kind="inet")]
        assert not [c for c in conns if c.status == psutil.CONN_ESTABLISHED], conns
        bound = {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}
        assert bound <= {"127.0.0.1", "0.0.0.0", "::1", "::"}, f"listeners on the node's own address: {bound}"

        # an offload that fails in the engine process: everything resumes, the server keeps serving
        limit = resource.prlimit(core, resource.RLIMIT_FSIZE)
        resource.prlimit(core, resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
        failed = daemon.cli("dump", str(server.proc.pid), "--name", "vllm-fail", timeout=900)
        resource.prlimit(core, resource.RLIMIT_FSIZE, limit)
        assert failed.returncode == 4 and "File too large" in failed.stderr, failed.stderr
        assert server.complete(PROMPT) == before, "the source resumed, graphs and all"
        assert daemon.cli("inspect", "vllm-fail").returncode == 3, "no half-written snapshot is listed"

        # a default dump: weights to the buffer store, KV cache released, neither in the images
        dumped = dump(daemon, server.proc.pid, "vllm")
        assert {"warm-up", "quiesce", "offload", "gpu-checkpoint", "dump"} <= set(phase_seconds(dumped)), dumped[
            "phases"
        ]
        snap = inspect(daemon, "vllm")
        weights = int(snap["buffer_bytes"])
        assert weights >= 200 << 20, "the model's weights are in the buffer store"
        workers = [snap["worker"], *snap.get("agents", [])]
        engine = next(w for w in workers if w["process"].startswith("VLLM::EngineCore"))
        assert engine["weights"].startswith("offloaded: weights and KV cache in address-stable arenas"), engine
        assert int(engine["released_bytes"]) >= 512 << 20, "the KV cache was released, not saved"
        images = {int(i["pid"]): int(i["image_bytes"]) for i in snap["process_images"]}
        assert engine["pid"] in images, images
        at_capture = sum(int(g["gpu_memory_bytes"]) for g in snap["gpu_processes"])
        assert dumped["size_bytes"] < 8 << 30, "no weights or KV cache in the images"
        print(
            f"\nMEASURED vllm gpu: GPU memory at capture {at_capture} B, weights {weights} B, images {dumped['size_bytes']} B"
        )
        assert server.proc.wait(timeout=60) == -9
        blobs = blob_bytes(buffers)

        restored = json.loads(daemon.cli("-o", "json", "restore", "vllm", check=True, timeout=900).stdout)
        pids.append(restored["pid"])
        assert list(phase_seconds(restored))[-2:] == ["reload-buffers", "resume-worker"], restored["phases"]
        assert server.complete(PROMPT) == before, "the restored server gives the same greedy token ids"
        assert server.complete(OTHER_PROMPT) == other, "and serves new prompts as the source did"

        # the restored server, captured again: a second snapshot of the same model adds no blob bytes
        dump(daemon, restored["pid"], "vllm-again", "--leave-running")
        assert blob_bytes(buffers) == blobs, "the same weights are stored once"
        assert server.complete(PROMPT) == before

        # onto the GPU through --gpu-map, in a network namespace of its own, beside the running copy
        uuid = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)["gpus"][0]["uuid"]
        copy = json.loads(
            daemon.cli(
                "-o", "json", "restore", "vllm", "--gpu-map", f"{uuid}={uuid}", "--private-net", check=True, timeout=900
            ).stdout
        )
        pids.append(copy["pid"])
        assert server.complete(PROMPT, netns_of=copy["pid"]) == before, "the private copy serves the same tokens"
        print(f"MEASURED vllm gpu: dump {phase_seconds(dumped)} restore {phase_seconds(restored)}")
    finally:
        kill_tree(*pids)
        stop_daemon(daemon)


def test_vllm_serve_with_graph_pool_and_buffers_in_arenas(tmp_path: Path) -> None:
    buffers = short_dir("gpusnap-vllm-", 0o700, "/dev/shm")
    daemon = start_daemon(tmp_path / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", "GPUSNAP_BUFFER_DIR": str(buffers)})
    target = install_gpusnap(sys.executable, tmp_path / "install")
    model = make_tiny_llama(tmp_path / "m", **MODEL)
    pools = {"GPUSNAP_VLLM_POOLS": "1", "GPUSNAP_SCRATCH_POISON": "0xA5"}
    server = start_server(tmp_path, daemon, target, model, "pools", *serve_args(), env=pools)
    pids: list[int] = [server.proc.pid]
    try:
        server.wait_up(900)
        before, other = server.complete(PROMPT), server.complete(OTHER_PROMPT)
        dumped = dump(daemon, server.proc.pid, "pools")
        snap = inspect(daemon, "pools")
        workers = [snap["worker"], *snap.get("agents", [])]
        engine = next(w for w in workers if w["process"].startswith("VLLM::EngineCore"))
        assert "also in arenas: " in engine["weights"] and "graphs" in engine["weights"], engine
        at_capture = sum(int(g["gpu_memory_bytes"]) for g in snap["gpu_processes"])
        assert server.proc.wait(timeout=60) == -9
        for _ in range(2):
            restored = json.loads(daemon.cli("-o", "json", "restore", "pools", check=True, timeout=900).stdout)
            pids.append(restored["pid"])
            assert server.complete(PROMPT) == before, "the graphs replay over their pool, filled back"
            assert server.complete(OTHER_PROMPT) == other
            kill_tree(restored["pid"])
        print(
            f"\nMEASURED vllm gpu pools: GPU memory at capture {at_capture} B, images {dumped['size_bytes']} B, "
            f"buffers {dumped['buffer_bytes']} B; {engine['weights']}"
        )
    finally:
        kill_tree(*pids)
        stop_daemon(daemon)
