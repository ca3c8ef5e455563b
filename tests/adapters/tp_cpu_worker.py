"""A two-rank tensor-parallel worker on CPU (torch.distributed, gloo), for capture and restore with CRIU.

    python tp_cpu_worker.py WORKDIR [--world 2] [--seed S]

The launcher (this script without ``--rank``) holds the gpusnap agent and starts one process per rank
(``--rank R``), which it drives over pipes. Each rank holds its shard of a Megatron-style MLP: ``A``
split by columns, ``B`` by rows; a step computes ``relu(x @ A_r) @ B_r`` and sums the shards with
``all_reduce`` (gloo, TCP over loopback), so a token needs every rank. Rank 0 also computes the same
tokens from the unsharded weights (the reference).

Around a capture the ranks' process groups go through :class:`gpusnap.adapters.distributed.ProcessGroups`:
quiesce tears them down (gloo cannot suspend), so no socket between ranks is in the image, and resume
creates them again on a fresh file rendezvous. WORKDIR/go-N makes the launcher run one request and write
WORKDIR/tokens-N (JSON ``{"ranks": [[tokens of rank 0], …], "reference": [...], "all_reduce": [...],
"modes": [...]}``). WORKDIR/events logs the adapter calls.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

HIDDEN, FFN, VOCAB, STEPS = 256, 1024, 512, 8
PROMPT = [3, 1, 4, 1, 5]


# ------------------------------------------------------------------------------------------------- rank


def rank_main(wd: str, rank: int, world: int, seed: int, rdzv: str) -> None:
    import torch
    import torch.distributed as dist

    from gpusnap.adapters.distributed import ProcessGroups

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    a_full = torch.randn(HIDDEN, FFN, generator=gen) / HIDDEN**0.5
    b_full = torch.randn(FFN, VOCAB, generator=gen) / FFN**0.5
    shard = FFN // world
    a = a_full[:, rank * shard : (rank + 1) * shard].clone()
    b = b_full[rank * shard : (rank + 1) * shard].clone()
    if rank != 0:
        del a_full, b_full  # only rank 0 computes the reference
    pending = {"rdzv": rdzv}

    def init(_ctx: object) -> None:
        dist.init_process_group("gloo", init_method=pending["rdzv"], rank=rank, world_size=world)

    def tokens(step: Callable[[Any], Any]) -> list[int]:
        x = embed[PROMPT].mean(0)
        out = []
        for _ in range(STEPS):
            t = int(torch.argmax(step(x)))
            out.append(t)
            x = embed[t]
        return out

    def sharded(x: Any) -> Any:
        y = torch.relu(x @ a) @ b
        dist.all_reduce(y)
        return y

    groups = ProcessGroups(init, mode="recreate", timeout_s=60)
    init(None)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        try:
            if cmd == "step":
                probe = torch.full((4,), float(rank + 1))
                dist.all_reduce(probe)
                reply: dict[str, Any] = {"tokens": tokens(sharded), "all_reduce": probe.tolist()}
                if rank == 0:
                    reply["reference"] = tokens(lambda x: torch.relu(x @ a_full) @ b_full)
            elif cmd == "suspend":
                reply = {"mode": groups.suspend(), "initialized": dist.is_initialized()}
            elif cmd == "resume":
                pending["rdzv"] = arg
                groups.resume(None)
                reply = {"initialized": dist.is_initialized()}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the launcher
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# --------------------------------------------------------------------------------------------- launcher


class Ranks:
    """The rank processes and their pipes; every command goes to all ranks at once (they are collective)."""

    def __init__(self, wd: str, world: int, seed: int):
        self.wd = wd
        rdzv = self.fresh_rdzv()
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, wd, "--rank", str(r), "--world", str(world), "--seed", str(seed),
                 "--rdzv", rdzv],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            )
            for r in range(world)
        ]

    def fresh_rdzv(self) -> str:
        """A rendezvous no earlier group (nor another restored copy) used."""
        return f"file://{os.path.join(self.wd, 'rdzv-' + secrets.token_hex(8))}"

    def command(self, line: str) -> list[dict[str, Any]]:
        for p in self.procs:
            stdin: IO[str] = p.stdin  # type: ignore[assignment]
            stdin.write(line + "\n")
            stdin.flush()
        replies = []
        for r, p in enumerate(self.procs):
            stdout: IO[str] = p.stdout  # type: ignore[assignment]
            text = stdout.readline()
            if not text:
                raise RuntimeError(f"rank {r} exited ({p.poll()})")
            reply = json.loads(text)
            if "error" in reply:
                raise RuntimeError(f"rank {r}: {reply['error']}")
            replies.append(reply)
        return replies


def launcher_main(wd: str, world: int, seed: int) -> None:
    from gpusnap.adapters import configure_capture_env, start_agent
    from gpusnap.adapters.pytorch import TorchAdapter

    configure_capture_env()  # inherited by the ranks
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ranks = Ranks(wd, world, seed)
    lock = threading.Lock()
    modes: list[str] = []

    def log(what: str) -> None:
        with open(os.path.join(wd, "events"), "a") as fh:
            fh.write(what + "\n")

    def request() -> dict[str, Any]:
        replies = ranks.command("step")
        return {
            "ranks": [r["tokens"] for r in replies],
            "all_reduce": [r["all_reduce"] for r in replies],
            "reference": replies[0]["reference"],
            "modes": list(modes),
        }

    def warm_up() -> list[int]:
        log("warm_up")
        return list(request()["ranks"][0])

    def quiesce() -> None:
        lock.acquire()
        replies = ranks.command("suspend")
        modes.extend(r["mode"] for r in replies)
        log("quiesce " + ",".join(f"{r['mode']}:{r['initialized']}" for r in replies))

    def resume(ctx: object) -> None:
        replies = ranks.command("resume " + ranks.fresh_rdzv())
        log(f"resume restored={ctx is not None} " + ",".join(str(r["initialized"]) for r in replies))
        lock.release()

    start_agent(TorchAdapter(warm_up, quiesce=quiesce, resume=resume)).wait_attached(30)
    open(os.path.join(wd, "ready"), "w").close()
    n = 1
    while True:
        if os.path.exists(os.path.join(wd, f"go-{n}")):
            with lock:
                result = request()
            with open(os.path.join(wd, f"tokens-{n}.tmp"), "w") as fh:
                json.dump(result, fh)
            os.rename(os.path.join(wd, f"tokens-{n}.tmp"), os.path.join(wd, f"tokens-{n}"))
            n += 1
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--rdzv", default="")
    args = ap.parse_args()
    if args.rank >= 0:
        rank_main(args.workdir, args.rank, args.world, args.seed, args.rdzv)
    else:
        launcher_main(args.workdir, args.world, args.seed)


if __name__ == "__main__":
    main()
