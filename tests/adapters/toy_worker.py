"""A worker with a toy "engine" and the gpusnap agent, for agent round trips without an inference engine.

    python toy_worker.py WORKDIR [--fail-quiesce] [--child-without-agent] [--attach-wait S]

The engine's "weights" are 32 MiB of random bytes made at start-up, so the tokens it generates can only
be reproduced from the same memory. Its "KV cache" (64 MiB) is freed by quiesce and rebuilt by resume.
Each WORKDIR/go-N file makes it generate for N and write WORKDIR/tokens-N. WORKDIR/events logs the adapter
calls; WORKDIR/context.json gets the restore context, and WORKDIR/contexts.jsonl one line per restored copy.
With ``--child-without-agent`` it starts a child process and names it as one of its engine's processes
(``expect_pids``), without giving it an agent.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time

from gpusnap.adapters import EngineAdapter, HelloFacts, RestoreContext, start_agent


class ToyEngine:
    def __init__(self) -> None:
        self.weights = os.urandom(32 << 20)
        self.kv: bytearray | None = bytearray(64 << 20)
        self.paused = False

    def generate(self, prompt: list[int], n: int) -> list[int]:
        if self.paused or self.kv is None:
            raise RuntimeError("engine is paused")
        digest = hashlib.sha256(self.weights + bytes(prompt)).digest()
        return [b % 512 for b in digest[:n]]


class ToyAdapter(EngineAdapter):
    engine = "toy"

    def __init__(
        self,
        engine: ToyEngine,
        workdir: str,
        fail_quiesce: bool,
        slow_quiesce: float = 0.0,
        expect_pids: tuple[int, ...] = (),
    ):
        self.expect_pids = expect_pids
        self.e = engine
        self.workdir = workdir
        self.fail_quiesce = fail_quiesce
        self.slow_quiesce = slow_quiesce

    def info(self) -> HelloFacts:
        return HelloFacts(expect_pids=tuple(self.expect_pids))

    def log(self, what: str) -> None:
        with open(os.path.join(self.workdir, "events"), "a") as fh:
            fh.write(what + "\n")

    async def warm_up(self) -> list[int]:
        self.log("warm_up")
        return self.e.generate([1, 5, 6, 7], 2)

    async def quiesce(self) -> None:
        self.log("quiesce")
        self.e.paused = True
        await asyncio.sleep(self.slow_quiesce)
        if self.fail_quiesce:
            raise RuntimeError("KV cache release failed (injected)")
        self.e.kv = None

    async def resume(self, context: RestoreContext | None) -> None:
        self.log(f"resume restored={context is not None}")
        if context is not None:
            with open(os.path.join(self.workdir, "context.json"), "w") as fh:
                json.dump(
                    {
                        "values": dict(context.values),
                        "TOY_PORT": os.environ.get("TOY_PORT"),
                        "TOY_GONE": os.environ.get("TOY_GONE"),
                    },
                    fh,
                )
            with open(os.path.join(self.workdir, "contexts.jsonl"), "a") as fh:  # one line per restored copy
                fh.write(
                    json.dumps(
                        {
                            "values": dict(context.values),
                            "TOY_PORT": os.environ.get("TOY_PORT"),
                            "netns": os.stat("/proc/self/ns/net").st_ino,
                            "pid": os.getpid(),
                        }
                    )
                    + "\n"
                )
        self.e.kv = bytearray(64 << 20)
        self.e.paused = False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--fail-quiesce", action="store_true")
    ap.add_argument("--slow-quiesce", type=float, default=0.0, help="seconds quiesce takes")
    ap.add_argument("--child-without-agent", action="store_true")
    ap.add_argument("--attach-wait", type=float, default=30.0, help="seconds to wait for the agent to attach")
    args = ap.parse_args()
    engine = ToyEngine()
    children: tuple[int, ...] = ()
    if args.child_without_agent:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], stdin=subprocess.DEVNULL)
        children = (child.pid,)
    agent = start_agent(ToyAdapter(engine, args.workdir, args.fail_quiesce, args.slow_quiesce, children))
    agent.wait_attached(args.attach_wait)
    with open(os.path.join(args.workdir, "ready"), "w") as fh:
        fh.write(str(os.getpid()))
    n = 1
    while True:
        go = os.path.join(args.workdir, f"go-{n}")
        if os.path.exists(go):
            try:
                tokens = engine.generate([1, 5, 6, 7], 8)
                out = json.dumps(tokens)
            except RuntimeError as exc:
                out = json.dumps({"error": str(exc)})
            with open(os.path.join(args.workdir, f"tokens-{n}.tmp"), "w") as fh:
                fh.write(out)
            os.rename(os.path.join(args.workdir, f"tokens-{n}.tmp"), os.path.join(args.workdir, f"tokens-{n}"))
            n += 1
        time.sleep(0.02)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
