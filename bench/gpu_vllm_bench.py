"""make bench-gpu-vllm: a stock ``vllm serve`` (vLLM's default CUDA graphs) cold-started, then captured and
restored by gpusnap two ways in the same run, each to its first token.

- **cold start**: the server's launch → the first token of the first request (vLLM's import, dummy weights,
  memory profiling, torch.compile, CUDA graph capture, the HTTP server);
- **stock** (``dump --no-offload``): CRIU and the CUDA checkpoint carry everything (weights, KV cache, graph
  pools), ``--leave-running`` so the same server is captured again:
- **fast** (a default ``dump``): the weights go to the buffer store from their address-stable arenas, the KV
  cache is released, and the restore (gpusnapd with ``--gpu-prefill auto``, buffer store on tmpfs) fills the
  weights' device memory while CRIU restores the process; restored twice.

- **breakdown** (unless ``--no-breakdown``): one more default capture, ``--leave-running``, before the timed one,
  during which the workers report what GPU memory they still hold and who holds it
  (bench/memory_breakdown.py: torch's pools, the blocks by holder, arenas, the rest, and the floor of a CUDA
  context measured apart), so that the report's cost stays out of the timed capture;
- ``--pools``: the server runs with ``GPUSNAP_VLLM_POOLS=1`` (the CUDA graph pool, persistent buffers and
  workspaces in arenas too: docs/engines.md).

The JSON records, for the fast path: the checkpoint's phases, the image and buffer bytes, the GPU memory at
capture, each restore's phases and its page fill (the restore's ``pages filled: … GB by N threads in … s``), and
whether every restored server gave the source's greedy tokens.

Each restore is timed from the gRPC Restore call (an orchestrator's; the CLI adds its own start-up) to the
restored server's answer of one token, then asked for 16 tokens to compare with the source's. The model is a
Llama ``config.json`` of the chosen size (``--size 8b``: Llama-3-8B's shapes) with dummy bf16 weights; the
engine is vLLM from ``/tmp/engine-site`` (docs/engines.md, "What is tested, and where"); the timed restores are
bench/vllm_runs.py's. JSON:
``bench/results/gpu-vllm-h200-<size>-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import memory_breakdown, results_file  # noqa: E402
from bench.gpu_bench import wait_registered_ahead  # noqa: E402
from bench.vllm_runs import activate_to_first_token, make_standby, restore_to_first_token, timed_dump  # noqa: E402
from tests.adapters.vllm_model import make_tiny_llama  # noqa: E402
from tests.adapters.vllm_server import install_gpusnap, request  # noqa: E402
from tests.conftest import DaemonProc, kill_tree, phase_seconds, start_daemon, stop_daemon  # noqa: E402
from tests.gpu.test_vllm_gpu import ENGINE_SITE, PROMPT, start_server  # noqa: E402

SIZES: dict[str, dict[str, Any]] = {
    "8b": {  # Llama-3-8B
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
    "1b": {  # Llama-3.2-1B
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
}


def host_memory(root: int) -> list[dict[str, Any]]:
    """What each process of the tree holds in host memory before the capture (what CRIU's images will carry,
    but for the CUDA checkpoint's copy of device memory): its RSS, and its ten largest mappings by RSS."""
    out = []
    for proc in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        maps = sorted(proc.memory_maps(grouped=False), key=lambda m: -m.rss)
        out.append(
            {
                "pid": proc.pid,
                "title": (proc.cmdline() or [""])[0][:40],
                "rss_bytes": proc.memory_info().rss,
                "largest": [{"path": m.path or "[anon]", "addr": m.addr, "rss_bytes": m.rss} for m in maps[:10]],
            }
        )
    return out


def vllm_memory_lines(log: Path) -> list[str]:
    """vLLM's own lines about memory (model loading, KV cache, CUDA graph capture) from the server's log."""
    keys = ("Model loading took", "KV cache", "Graph capturing finished", "Available KV cache", "memory")
    return [
        line.strip()[:300] for line in log.read_text(errors="replace").splitlines() if any(k in line for k in keys)
    ][:20]


def standby_then_activate(daemon: DaemonProc, snapshot: str, port: int) -> dict[str, Any]:
    """Restore ``snapshot`` ahead (``gpusnap standby``: CPU side only, CUDA-checkpointed, no GPU memory), wait
    until gpusnapd has registered its weights for the fill, then time the gRPC Activate call → the server's
    first token, then its 16 greedy tokens for the prompt."""
    sb, made = make_standby(daemon, snapshot)
    registered = wait_registered_ahead(daemon)
    node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
    return {
        **made,
        "gpu_free_bytes_while_standing_by": [int(g["memory_free_bytes"]) for g in node["gpus"]],
        "blobs_registered": registered,
        **activate_to_first_token(daemon, sb.id, port, PROMPT),
    }


def engine_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ENGINE_SITE)},
        timeout=300,
    )
    return out.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="8b", choices=sorted(SIZES))
    ap.add_argument(
        "--buffer-dir", default="/dev/shm/gpusnap-bench-buffers", help="gpusnapd --buffer-dir (tmpfs: a RAM tier)"
    )
    ap.add_argument("--gpu-memory-utilization", default="0.2")
    ap.add_argument("--no-stock", action="store_true", help="leave the stock path out")
    ap.add_argument(
        "--standby", action="store_true", help="also a standby of the fast snapshot, activated: to first token"
    )
    ap.add_argument("--pools", action="store_true", help="GPUSNAP_VLLM_POOLS=1: graph pool and buffers in arenas")
    ap.add_argument("--no-breakdown", action="store_true", help="leave out the capture that reports GPU memory")
    results_file.add_arguments(ap)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-vllm-bench-"))
    Path(args.buffer_dir).mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(tmp / "d", extra_env={"GPUSNAP_GPU_PREFILL": "auto", "GPUSNAP_BUFFER_DIR": args.buffer_dir})
    target = install_gpusnap(sys.executable, tmp / "install")
    model = make_tiny_llama(tmp / "m", **SIZES[args.size])
    engine = ["--dtype", "bfloat16", "--max-model-len", "2048", "--gpu-memory-utilization", args.gpu_memory_utilization]
    pids: list[int] = []
    result: dict[str, Any] = {
        "vllm_version": engine_version(),
        "cuda_graphs": True,
        "model": {"size": args.size},
        "pools": args.pools,
    }
    reports = tmp / "memory-reports"
    env = memory_breakdown.env_for(reports)
    if args.pools:
        env["GPUSNAP_VLLM_POOLS"] = "1"
    breakdown = None
    try:
        t_launch = time.time()
        server = start_server(tmp, daemon, target, model, "serve", *engine, env=env)
        pids.append(server.proc.pid)
        server.wait_up(1500)
        first = request(server.port, PROMPT, 1)
        result["cold_start_to_first_token_s"] = float(first["t_done"]) - t_launch
        before = request(server.port, PROMPT, 16)["token_ids"]
        result["host_memory_before_capture"] = host_memory(server.proc.pid)
        result["vllm_memory_log"] = vllm_memory_lines(server.log)
        if not args.no_stock:
            stock_dump, stock_s = timed_dump(daemon, server.proc.pid, "stock", "--no-offload", "--leave-running")
            assert request(server.port, PROMPT, 16)["token_ids"] == before, "serving again after the stock capture"
        if not args.no_breakdown:
            memory_breakdown.request(reports)
            timed_dump(daemon, server.proc.pid, "breakdown", "--leave-running")
            memory_breakdown.withdraw(reports)
            assert request(server.port, PROMPT, 16)["token_ids"] == before, "serving again after the breakdown"
            floor = memory_breakdown.context_floor(memory_breakdown.engine_env(ENGINE_SITE))
            shown = json.loads(daemon.cli("-o", "json", "inspect", "breakdown", check=True).stdout)
            breakdown = memory_breakdown.combine(memory_breakdown.reports(reports), shown, floor)
        fast_dump, fast_s = timed_dump(daemon, server.proc.pid, "fast")
        server.proc.wait(timeout=120)
        registered = wait_registered_ahead(daemon)
        fast = [restore_to_first_token(daemon, "fast", server.port, PROMPT)]
        kill_tree(fast[0]["pid"])
        fast.append(restore_to_first_token(daemon, "fast", server.port, PROMPT))
        kill_tree(fast[1]["pid"])
        standby = None
        if args.standby:
            standby = standby_then_activate(daemon, "fast", server.port)
            kill_tree(standby["pid"])
        stock = None
        if not args.no_stock:
            stock = restore_to_first_token(daemon, "stock", server.port, PROMPT)
            kill_tree(stock["pid"])
        node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
        snap = json.loads(daemon.cli("-o", "json", "inspect", "fast", check=True).stdout)
    finally:
        kill_tree(*pids)
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(args.buffer_dir, ignore_errors=True)
    cold = result["cold_start_to_first_token_s"]
    best = min(r["restore_to_first_token_s"] for r in fast)
    same = (
        all(r["answer"] == before for r in fast)
        and (stock is None or stock["answer"] == before)
        and (standby is None or standby["answer"] == before)
    )
    result.update(
        {
            "host": {
                "criu": node["host"]["criu_version"],
                "driver": node["host"].get("nvidia_driver_version", ""),
                "gpu": node["gpus"][0]["name"],
            },
            "gpu_prefill": node.get("gpu_prefill", "off"),
            "engine_args": engine,
            "restore_to_first_token_s": fast[0]["restore_to_first_token_s"],
            "restore_to_first_token_again_s": fast[1]["restore_to_first_token_s"],
            "speedup": cold / best,
            "checkpoint_s": fast_s,
            "same_tokens_after_restore": same,
            "image_bytes": fast_dump["size_bytes"],
            "buffer_bytes": fast_dump["buffer_bytes"],
            "gpu_memory_at_capture_bytes": sum(int(g["gpu_memory_bytes"]) for g in snap.get("gpu_processes", [])),
            "blobs_registered_after_checkpoint": registered,
            "checkpoint_phases": phase_seconds(fast_dump),
            "restore_phases": fast[0]["phases"],
            "restore_again_phases": fast[1]["phases"],
            "restore_page_fill": [r["page_fill"] for r in fast],
            "restore_messages": fast[0]["messages"],
            "memory_breakdown": breakdown,
            "restore_call_s": [r["restore_call_s"] for r in fast],
            "processes": snap.get("processes", []),
            "stock": None
            if stock is None
            else {
                "restore_to_first_token_s": stock["restore_to_first_token_s"],
                "over_fast": stock["restore_to_first_token_s"] / best,
                "checkpoint_s": stock_s,
                "image_bytes": stock_dump["size_bytes"],
                "checkpoint_phases": phase_seconds(stock_dump),
                "restore_phases": stock["phases"],
            },
            "standby": None
            if standby is None
            else {
                **{k: v for k, v in standby.items() if k not in ("pid", "answer")},
                "cold_over_activation": cold / standby["activation_to_first_token_s"],
                "restore_over_activation": best / standby["activation_to_first_token_s"],
            },
            "targets": {
                "restore_to_first_token_s": 1.5,
                "speedup": 50,
                "checkpoint_s": 5,
                "activation_s": 0.4,
                "gpu_memory_at_capture_bytes": 600_000_000,
                "image_bytes": 2_500_000_000,
            },
        }
    )
    print(json.dumps(result, indent=2))
    label = args.label or f"h200-{args.size}" + ("-pools" if args.pools else "")
    results_file.write(result, "gpu-vllm", args.out, label)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
