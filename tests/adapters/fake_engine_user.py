"""A user program of the fake SGLang or TensorRT-LLM (tests/adapters/fake_engines), driven through files.

    python fake_engine_user.py sglang|trtllm WORKDIR [--tp N] [--seed S]

SGLang: ``sgl.Engine(…, enable_memory_saver=True, disable_cuda_graph=True)`` and ``async_generate``, with
gpusnap's plugin loaded by the engine itself (entry point ``sglang.srt.plugins``). TensorRT-LLM: the one
documented line ``gpusnap.adapters.engines.trtllm.plugin.enable()`` first, then ``LLM(…, sleep_config=SleepConfig(),
cuda_graph_config=None)`` and ``generate_async``. WORKDIR/ready appears after the first request;
WORKDIR/go-N (a JSON prompt) makes the program answer WORKDIR/tokens-N (``{"tokens": [...]}`` or
``{"error": "..."}``), greedy, 8 tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

PROMPT = [3, 1, 4, 1, 5]

Generate = Callable[[list[int], int], Awaitable[list[int]]]


async def serve(generate: Generate, wd: Path) -> None:
    await generate(PROMPT, 2)  # SGLang's tokenizer manager binds its loop at the first request
    (wd / "ready").write_text(json.dumps({"pid": os.getpid()}))
    n = 0
    while True:
        n += 1
        go = wd / f"go-{n}"
        while not go.exists():
            await asyncio.sleep(0.05)
        try:
            out = {"tokens": await generate(json.loads(go.read_text()), 8)}
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        tmp = wd / f".tokens-{n}"
        tmp.write_text(json.dumps(out))
        tmp.rename(wd / f"tokens-{n}")


async def sglang_main(wd: Path, tp: int, seed: int) -> None:
    import sglang as sgl

    engine = sgl.Engine(
        model_path="fake", tp_size=tp, device="cpu", disable_cuda_graph=True, enable_memory_saver=True, random_seed=seed
    )

    async def generate(prompt: list[int], n: int) -> list[int]:
        out = await engine.async_generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": n})
        return list(out["output_ids"])

    await serve(generate, wd)


async def trtllm_main(wd: Path, tp: int, seed: int) -> None:
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm.llmapi import SleepConfig

    llm = LLM(model="fake", tensor_parallel_size=tp, sleep_config=SleepConfig(), cuda_graph_config=None, seed=seed)

    async def generate(prompt: list[int], n: int) -> list[int]:
        out = await llm.generate_async(prompt, SamplingParams(max_tokens=n, top_k=1)).aresult()
        return list(out.outputs[0].token_ids)

    await serve(generate, wd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("engine", choices=["sglang", "trtllm"])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    if a.engine == "trtllm":  # first thing, before any event loop (uvloop's hold an io_uring) or the LLM exists
        import gpusnap.adapters.engines.trtllm.plugin as gpusnap_trtllm

        gpusnap_trtllm.enable()
    main = sglang_main if a.engine == "sglang" else trtllm_main
    asyncio.run(main(a.workdir, a.tp, a.seed))
