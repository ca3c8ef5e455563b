"""A tensor-parallel worker (torch.distributed) for capture and restore tests, on CPU or on GPUs.

    python tp_worker.py WORKDIR [--world 2] [--seed S] [--device cpu|cuda] [--size mlp|1b|8b]
                        [--mode auto|recreate|suspend]

The launcher (this script without ``--rank``) holds the gpusnap agent and starts one process per rank
(``--rank R``), which it drives over pipes (commands on the rank's stdin, JSON replies on a pipe of
their own so that library output cannot mix in).

* ``--device cpu`` (default, ``--size mlp``): each rank holds its shard of a Megatron-style MLP, ``A``
  split by columns and ``B`` by rows; a step computes ``relu(x @ A_r) @ B_r`` and sums the shards with
  ``all_reduce`` over gloo (TCP on loopback). Rank 0 also computes the tokens from the unsharded weights
  (the reference).
* ``--device cuda`` (``--size 1b|8b``): rank R runs on GPU R and holds its shard of a Llama-style decoder
  in bf16 (random weights from the seed, sharded by hand the Megatron way: attention heads and the MLP's
  inner dimension split across ranks, ``o_proj`` and ``down_proj`` rows split and summed with
  ``all_reduce`` over NCCL); greedy decoding without a KV cache.

Around a capture the ranks' process groups go through :class:`gpusnap.adapters.distributed.ProcessGroups`
(``--mode``): quiesce suspends or tears them down, resume brings them back on a fresh file rendezvous.
WORKDIR/go-N makes the launcher run one request and write WORKDIR/tokens-N (JSON ``{"ranks": [[tokens of
rank 0], …], "reference": [...], "all_reduce": [...], "modes": [...]}``). WORKDIR/ready holds the ranks'
PIDs, the NCCL version and whether it can suspend. WORKDIR/events logs the adapter calls.
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
import zlib
from collections.abc import Callable
from typing import IO, Any

PROMPT = [3, 1, 4, 1, 5]
MLP = dict(hidden=256, ffn=1024, vocab=512, steps=8)
LLAMA = {
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, steps=16),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, steps=16),
}


# ------------------------------------------------------------------------------------------------- models


def mlp_model(rank: int, world: int, seed: int) -> tuple[Callable[[], list[int]], Callable[[], list[int]] | None]:
    """(sharded greedy decode, unsharded reference on rank 0 else None) of the CPU MLP."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    h, f, v, steps = MLP["hidden"], MLP["ffn"], MLP["vocab"], MLP["steps"]
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(v, h, generator=gen)
    a_full = torch.randn(h, f, generator=gen) / h**0.5
    b_full = torch.randn(f, v, generator=gen) / f**0.5
    shard = f // world
    a = a_full[:, rank * shard : (rank + 1) * shard].clone()
    b = b_full[rank * shard : (rank + 1) * shard].clone()

    def decode(step: Callable[[Any], Any]) -> list[int]:
        x = embed[PROMPT].mean(0)
        out = []
        for _ in range(steps):
            t = int(torch.argmax(step(x)))
            out.append(t)
            x = embed[t]
        return out

    def sharded(x: Any) -> Any:
        y = torch.relu(x @ a) @ b
        dist.all_reduce(y)
        return y

    if rank != 0:
        return (lambda: decode(sharded)), None
    return (lambda: decode(sharded)), (lambda: decode(lambda x: torch.relu(x @ a_full) @ b_full))


def llama_model(rank: int, world: int, seed: int, size: str) -> Callable[[], list[int]]:
    """Greedy decode of this rank's shard of a Llama-style decoder on GPU ``rank`` (bf16)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    c = LLAMA[size]
    hidden, heads, kv_heads, ffn, vocab = c["hidden"], c["heads"], c["kv_heads"], c["ffn"], c["vocab"]
    hd = hidden // heads
    heads_r, kv_r, ffn_r = heads // world, kv_heads // world, ffn // world
    dev = torch.device("cuda", torch.cuda.current_device())
    dt = torch.bfloat16

    def param(name: str, shape: tuple[int, ...], shard: int | None, scale: float = 0.02) -> Any:
        """Seeded per (name, shard): every rank builds its own part, replicated ones identically."""
        g = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{seed}/{name}/{shard}".encode()))
        return (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dt)

    embed = param("embed", (vocab, hidden), None, 1.0)
    lm_head = param("lm_head", (vocab, hidden), None)
    final_norm = torch.ones(hidden, device=dev, dtype=dt)
    layers = []
    for i in range(c["layers"]):
        layers.append(
            dict(
                wq=param(f"{i}.q", (hidden, heads_r * hd), rank),
                wk=param(f"{i}.k", (hidden, kv_r * hd), rank),
                wv=param(f"{i}.v", (hidden, kv_r * hd), rank),
                wo=param(f"{i}.o", (heads_r * hd, hidden), rank),
                wg=param(f"{i}.gate", (hidden, ffn_r), rank),
                wu=param(f"{i}.up", (hidden, ffn_r), rank),
                wd=param(f"{i}.down", (ffn_r, hidden), rank),
                n1=torch.ones(hidden, device=dev, dtype=dt),
                n2=torch.ones(hidden, device=dev, dtype=dt),
            )
        )
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))

    def rms(x: Any, w: Any) -> Any:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * w

    def rope(x: Any, pos: Any) -> Any:  # x: [n_heads, T, hd]
        ang = pos[:, None].float() * inv_freq[None, :]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1).to(dt), torch.cat([ang.sin(), ang.sin()], -1).to(dt)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(ids: list[int]) -> int:
        t = len(ids)
        pos = torch.arange(t, device=dev)
        x = embed[torch.tensor(ids, device=dev)]
        for w in layers:
            h = rms(x, w["n1"])
            q = rope((h @ w["wq"]).view(t, heads_r, hd).transpose(0, 1), pos)
            k = rope((h @ w["wk"]).view(t, kv_r, hd).transpose(0, 1), pos)
            v = (h @ w["wv"]).view(t, kv_r, hd).transpose(0, 1)
            k, v = k.repeat_interleave(heads_r // kv_r, 0), v.repeat_interleave(heads_r // kv_r, 0)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, heads_r * hd)
            o = a @ w["wo"]
            dist.all_reduce(o)
            x = x + o
            h = rms(x, w["n2"])
            m = (F.silu(h @ w["wg"]) * (h @ w["wu"])) @ w["wd"]
            dist.all_reduce(m)
            x = x + m
        logits = rms(x[-1:], final_norm) @ lm_head.T
        return int(torch.argmax(logits[0].float()))

    def decode() -> list[int]:
        with torch.inference_mode():
            ids = list(PROMPT)
            for _ in range(c["steps"]):
                ids.append(forward(ids))
            torch.cuda.synchronize()
            return ids[len(PROMPT) :]

    return decode


# ------------------------------------------------------------------------------------------------- rank


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from gpusnap.adapters.distributed import ProcessGroups, nccl_supports_suspend, nccl_version

    reply_out = os.fdopen(args.reply_fd, "w", buffering=1)
    rank, world, cuda = args.rank, args.world, args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    pending = {"rdzv": args.rdzv}

    def init(_ctx: object) -> None:
        kw: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=pending["rdzv"], rank=rank, world_size=world, **kw
        )

    init(None)
    if cuda:
        decode, reference = llama_model(rank, world, args.seed, args.size), None
    else:
        decode, reference = mlp_model(rank, world, args.seed)
    groups = ProcessGroups(init, mode="recreate" if args.mode == "keep" else args.mode, timeout_s=300)
    version = nccl_version() if cuda else None
    hello = {
        "pid": os.getpid(),
        "nccl": list(version) if version else None,
        "can_suspend": nccl_supports_suspend(version),
    }
    reply_out.write(json.dumps(hello) + "\n")
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        try:
            if cmd == "step":
                probe = torch.full((4,), float(rank + 1), device="cuda" if cuda else "cpu")
                dist.all_reduce(probe)
                t0 = time.perf_counter()
                reply: dict[str, Any] = {
                    "tokens": decode(),
                    "all_reduce": probe.tolist(),
                    "decode_s": time.perf_counter() - t0,
                }
                if reference is not None:
                    reply["reference"] = reference()
            elif cmd == "suspend":
                mode = groups.suspend() if args.mode != "keep" else "keep"
                reply = {"mode": mode, "initialized": dist.is_initialized()}
            elif cmd == "resume":
                pending["rdzv"] = arg
                t0 = time.perf_counter()
                groups.resume(None)
                reply = {"initialized": dist.is_initialized(), "resume_s": time.perf_counter() - t0}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the launcher
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        reply_out.write(json.dumps(reply) + "\n")


# --------------------------------------------------------------------------------------------- launcher


class Ranks:
    """The rank processes and their pipes; every command goes to all ranks at once (they are collective)."""

    def __init__(self, args: argparse.Namespace):
        self.wd = args.workdir
        rdzv = self.fresh_rdzv()
        self.procs: list[subprocess.Popen[str]] = []
        self.replies: list[IO[str]] = []
        for r in range(args.world):
            read_fd, write_fd = os.pipe()
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        self.wd,
                        "--rank",
                        str(r),
                        "--world",
                        str(args.world),
                        "--seed",
                        str(args.seed),
                        "--rdzv",
                        rdzv,
                        "--device",
                        args.device,
                        "--size",
                        args.size,
                        "--mode",
                        args.mode,
                        "--reply-fd",
                        str(write_fd),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=sys.stderr,
                    text=True,
                    bufsize=1,
                    pass_fds=(write_fd,),
                )
            )
            os.close(write_fd)
            self.replies.append(os.fdopen(read_fd, "r"))
        self.hello = [self._read(r) for r in range(args.world)]

    def fresh_rdzv(self) -> str:
        """A rendezvous no earlier group (nor another restored copy) used."""
        return f"file://{os.path.join(self.wd, 'rdzv-' + secrets.token_hex(8))}"

    def _read(self, r: int) -> dict[str, Any]:
        text = self.replies[r].readline()
        if not text:
            raise RuntimeError(f"rank {r} exited ({self.procs[r].poll()})")
        reply: dict[str, Any] = json.loads(text)
        if "error" in reply:
            raise RuntimeError(f"rank {r}: {reply['error']}")
        return reply

    def command(self, line: str) -> list[dict[str, Any]]:
        for p in self.procs:
            stdin: IO[str] = p.stdin  # type: ignore[assignment]
            stdin.write(line + "\n")
            stdin.flush()
        return [self._read(r) for r in range(len(self.procs))]


def launcher_main(args: argparse.Namespace) -> None:
    from gpusnap.adapters import configure_capture_env, start_agent
    from gpusnap.adapters.engines.torch.adapter import TorchAdapter

    configure_capture_env(tensor_parallel=args.world)  # inherited by the ranks
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks talk over loopback: one host, and a restore
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # with --tcp established finds the same addresses
    wd = args.workdir
    ranks = Ranks(args)
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
            "reference": replies[0].get("reference"),
            "decode_s": max(r["decode_s"] for r in replies),
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
        with open(os.path.join(wd, "resume-times"), "a") as fh:
            fh.write(json.dumps([r["resume_s"] for r in replies]) + "\n")
        lock.release()

    start_agent(TorchAdapter(warm_up, quiesce=quiesce, resume=resume)).wait_attached(60)
    with open(os.path.join(wd, "ready.tmp"), "w") as fh:
        json.dump({"ranks": ranks.hello}, fh)
    os.rename(os.path.join(wd, "ready.tmp"), os.path.join(wd, "ready"))
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
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=("mlp", *LLAMA), default="mlp")
    ap.add_argument(
        "--mode",
        choices=("auto", "recreate", "suspend", "keep"),
        default="recreate",
        help="keep: leave the process groups up at quiesce (a worker that forgets to)",
    )
    ap.add_argument("--rank", type=int, default=-1)
    ap.add_argument("--rdzv", default="")
    ap.add_argument("--reply-fd", type=int, default=-1)
    args = ap.parse_args()
    if args.rank >= 0:
        rank_main(args)
    else:
        launcher_main(args)


if __name__ == "__main__":
    main()
