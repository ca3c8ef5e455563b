"""A PyTorch worker on CPU whose weights are named buffers: they leave the process image at capture.

    python torch_cpu_worker.py WORKDIR [--mib N] [--parts P] [--seed S] [--stable-fake [--chunk-mib M] [--fake-fail CALL]]

Its "model" is a random matrix of N MiB (float32, from seed S) plus a tied view of its first rows; with
``--parts P`` the N MiB are P matrices (``w``, ``w.1`` … ``w.<P-1>``; the later ones count in
``weights_sum``), as a model's many tensors are. Each
generation step multiplies a state vector by the weights and takes the argmax, so the tokens can only be
reproduced from the same weights. WORKDIR/go-N makes it generate 8 tokens and write WORKDIR/tokens-N
(JSON: {"tokens": [...], "weights_sum": float}, plus "ptr", the weights' address, with ``--stable-fake``).
WORKDIR/events logs the adapter calls. WORKDIR/fault, while it exists, holds ``PHASE:hang:SECONDS`` or
``PHASE:die`` (PHASE: warm_up, quiesce, offload, reload or resume): the worker then sleeps that long, or exits
with status 3, when that phase starts (tests/adapters/test_agent_faults.py). ``--stable-fake``: ``TorchAdapter(stable_addresses=True)`` over the fake VMM driver
(tests/fakes/cuda_vmm.py), whose arenas are host mappings, so the weights live in an arena that is
released (left reserved, ``PROT_NONE``) at capture and re-mapped at the same address after a restore.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

from gpusnap.adapters import start_agent
from gpusnap.adapters.engines.torch.adapter import TorchAdapter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", type=int, default=1)
    ap.add_argument("--stable-fake", action="store_true")
    ap.add_argument("--chunk-mib", type=int, default=0, help="arena chunk size (--stable-fake)")
    ap.add_argument("--fake-fail", default="", help="CALL: the fake driver's first CALL fails (--stable-fake)")
    args = ap.parse_args()
    if args.stable_fake:
        sys.path.append(str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.fakes
        from gpusnap.adapters import vmm
        from tests.fakes.cuda_vmm import FakeVmmDriver

        vmm._driver_module = FakeVmmDriver()
        if args.chunk_mib:
            vmm.CHUNK_BYTES = args.chunk_mib << 20
        if args.fake_fail:  # counted from now: the fault outlives CRIU in the image, like the rest of the fake
            vmm._driver_module.fail(args.fake_fail, result=1)
    wd = args.workdir
    gen = torch.Generator().manual_seed(args.seed)
    cols = 1024
    rows = args.mib * (1 << 20) // (4 * cols * args.parts)
    weights = {"w": torch.randn(rows, cols, generator=gen)}
    weights.update({f"w.{i}": torch.randn(rows, cols, generator=gen) for i in range(1, args.parts)})
    weights["w.head"] = weights["w"][:cols]  # tied: shares the storage, offloaded once
    lock = threading.Lock()

    def log(what: str) -> None:
        with open(os.path.join(wd, "events"), "a") as fh:
            fh.write(what + "\n")

    def fault(phase: str) -> None:
        try:
            spec = Path(wd, "fault").read_text().split(":")
        except FileNotFoundError:
            return
        if spec[0] != phase:
            return
        log(f"fault {':'.join(spec)}")
        if spec[1] == "die":
            os._exit(3)
        time.sleep(float(spec[2]))

    def generate(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            state = torch.zeros(cols)
            state[[p % cols for p in prompt]] = 1.0
            out = []
            for _ in range(n):
                token = int(torch.argmax(weights["w.head"] @ (weights["w"].T @ (weights["w"] @ state)) % 7.0))
                out.append(token)
                state = torch.roll(state, token % cols)
            return out

    def warm_up() -> list[int]:
        fault("warm_up")
        log("warm_up")
        return generate([1, 5, 6, 7], 2)

    def quiesce() -> None:
        lock.acquire()
        log("quiesce")
        fault("quiesce")

    def resume(ctx: object) -> None:
        fault("resume")
        arena = getattr(weights["w"], "_arena", None)
        log(
            f"resume restored={ctx is not None} resident={weights['w'].untyped_storage().nbytes()}"
            + (f" mapped={arena.mapped}" if arena is not None else "")
        )
        lock.release()

    adapter = TorchAdapter(
        warm_up, quiesce=quiesce, resume=resume, buffers=lambda: weights, stable_addresses=args.stable_fake
    )
    if args.stable_fake:
        from gpusnap.adapters import vmm

        weights["w"]._arena = vmm.arena_of(weights["w"].data_ptr())  # type: ignore[attr-defined]
    agent = start_agent(adapter)
    for phase in ("offload", "reload"):  # the agent's own steps: wrapped to meet the fault first
        step = getattr(agent, f"_{phase}")
        setattr(agent, f"_{phase}", lambda *a, _p=phase, _s=step, **k: (fault(_p), _s(*a, **k))[1])
    agent.wait_attached(30)
    open(os.path.join(wd, "ready"), "w").close()
    n = 1
    while True:
        if os.path.exists(os.path.join(wd, f"go-{n}")):
            with lock:
                tokens = generate([3, 1, 4, 1, 5], 8)
                total = float(sum(t.double().sum() for n, t in weights.items() if n != "w.head"))
            with open(os.path.join(wd, f"tokens-{n}.tmp"), "w") as fh:
                ptr = {"ptr": weights["w"].data_ptr()} if args.stable_fake else {}
                json.dump({"tokens": tokens, "weights_sum": total, **ptr}, fh)
            os.rename(os.path.join(wd, f"tokens-{n}.tmp"), os.path.join(wd, f"tokens-{n}"))
            n += 1
        time.sleep(0.005)


if __name__ == "__main__":
    main()
