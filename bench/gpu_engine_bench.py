"""make bench-gpu-engine: cold start versus restore of an LLM worker, to its first token.

The worker (tests/gpu/llm_worker.py) builds a Llama-style model with random bf16 weights on the GPU
and serves greedy generations through the gpusnap PyTorch adapter.

- cold start: process start → first generated token (the worker's own timestamps);
- restore: `gpusnap restore` issued → the restored worker's first token for a new request (restore
  includes verify, CRIU, CUDA restore, unlock and the agent's resume with its canary).

JSON is written to bench/results/gpu-engine-<label>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.conftest import start_daemon, stop_daemon  # noqa: E402
from tests.gpu.test_gpu_engine import request, start_llm  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size", default="1b", choices=["1b", "8b"])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpusnap-engine-bench-"))
    daemon = start_daemon(tmp)
    try:
        wd = tmp / "llm"
        proc = start_llm(daemon, wd, args.size)
        ready = json.loads((wd / "ready").read_text())
        cold = ready["t_first_token"] - ready["t_start"]
        before = request(wd, 1)["tokens"]
        dumped = json.loads(daemon.cli("-o", "json", "dump", str(proc.pid), check=True, timeout=1800).stdout)
        proc.wait(timeout=120)
        t0 = time.time()
        restored = json.loads(daemon.cli("-o", "json", "restore", dumped["id"], check=True, timeout=1800).stdout)
        answer = request(wd, 2)
        to_first_token = answer["t_done"] - t0
        same = answer["tokens"] == before
        restored_pid = restored["pid"]
        os.kill(restored_pid, signal.SIGKILL)
        node = json.loads(daemon.cli("-o", "json", "node", check=True).stdout)
    finally:
        stop_daemon(daemon)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "benchmark": "gpu-engine",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": {"kernel": platform.release(), "criu": node["host"]["criuVersion"],
                 "driver": node["host"].get("nvidiaDriverVersion", ""), "gpu": node["gpus"][0]["name"]},
        "model": {"size": args.size, "parameters": ready["params"], "dtype": "bfloat16"},
        "cold_start_to_first_token_s": cold,
        "restore_to_first_token_s": to_first_token,
        "speedup": cold / to_first_token,
        "same_tokens_after_restore": same,
        "image_bytes": dumped["size_bytes"],
        "checkpoint_phases": dumped["phases"],
        "restore_phases": restored["phases"],
    }
    print(json.dumps(result, indent=2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu-engine-{args.label + '-' if args.label else ''}{args.size}-{datetime.now(UTC):%Y%m%dT%H%M%S}.json"
    (out / name).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
