"""A Llama-style LLM worker (transformers, random bf16 weights) with the gpusnap agent (PyTorch adapter).

    python llm_worker.py WORKDIR [--size 1b|8b] [--no-agent] [--graphs] [--model-dir DIR [--save-model]]

Builds the model on the GPU from a fixed seed (no weights are downloaded), or loads it from DIR (a
transformers model directory, safetensors) like a production worker; ``--save-model`` writes the random
model to DIR and exits. Then it serves greedy
generations: each WORKDIR/go-N makes it generate 16 tokens (or the number the file holds) for a fixed
prompt and write WORKDIR/tokens-N
(JSON: {"tokens": [...], "t_done": <time.time()>}). WORKDIR/ready holds {"t_start", "t_first_token"}:
process start to first generated token is the cold start. The agent names the model's parameters as
buffers, so a capture keeps the weights out of the image.

With ``--graphs`` the decode step is a captured CUDA graph (graph_decode.py) that reads the weights; the
weights are moved into VMM arenas first (``TorchAdapter(stable_addresses=True)``), so they come back at
the same device addresses after a restore. WORKDIR/ready then also holds the graph's and an eager run's
tokens for the same prompt ("graph_tokens", "eager_tokens").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

T_START = time.time()

from gpusnap.adapters import configure_capture_env  # noqa: E402  (NCCL etc., before torch starts)

configure_capture_env()

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from gpusnap.adapters import start_agent  # noqa: E402
from gpusnap.adapters.engines.torch.adapter import TorchAdapter  # noqa: E402

SIZES = {
    # ~1.1B parameters (TinyLlama-shaped)
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        vocab_size=32000,
    ),
    # ~8.0B parameters (Llama-3-8B-shaped)
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    ),
}
PROMPT = [1, 415, 5565, 302, 4843, 349, 5465, 28723]


def _load(model_dir: str) -> LlamaForCausalLM:
    """Load a saved model straight onto the GPU (safetensors)."""
    try:
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16, device_map="cuda")
    except (ImportError, ValueError):  # older transformers want accelerate for device_map
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).to("cuda")
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--model-dir", default="")
    ap.add_argument("--save-model", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="decode with a captured CUDA graph over the weights")
    args = ap.parse_args()
    wd = args.workdir
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=4096, torch_dtype="bfloat16", **SIZES[args.size])
    torch.set_default_dtype(torch.bfloat16)
    if args.model_dir and not args.save_model:
        model = _load(args.model_dir)
    else:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config).eval()
    if args.save_model:
        model.save_pretrained(args.model_dir)
        return 0
    params = sum(p.numel() for p in model.parameters())
    lock = threading.Lock()
    adapter = None
    extra: dict[str, object] = {}

    def quiesce() -> None:  # hold the serving lock until resume: no generation while captured
        lock.acquire()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def make_adapter(stable: bool) -> TorchAdapter:
        return TorchAdapter(
            lambda: generate([1, 5, 6, 7], 2),
            quiesce=quiesce,
            resume=lambda ctx: lock.release(),
            buffers=lambda: dict(model.named_parameters()),
            stable_addresses=stable,
        )

    decoder = None
    if args.graphs:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.gpu
        from gpusnap.adapters import vmm
        from tests.gpu.graph_decode import GraphDecoder

        if args.no_agent:
            vmm.stabilize(dict(model.named_parameters()))
        else:
            adapter = make_adapter(True)  # moves the weights into VMM arenas: before the graph is captured
        assert all(vmm.is_stable(p) for p in model.parameters())
        decoder = GraphDecoder(model, max_len=64)
        decoder.capture(PROMPT)
        extra = {"graph_tokens": decoder.generate(PROMPT, 16), "eager_tokens": decoder.generate(PROMPT, 16, eager=True)}

    def generate(prompt: list[int], n: int) -> list[int]:
        if decoder is not None:
            with lock:
                return decoder.generate(prompt, n)
        with lock, torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return [int(t) for t in out[0, len(prompt) :].tolist()]

    first = generate(PROMPT, 1)
    t_first = time.time()
    torch.cuda.empty_cache()
    extra["gpu_allocated_bytes"] = torch.cuda.memory_allocated()
    extra["gpu_reserved_bytes"] = torch.cuda.memory_reserved()
    if not args.no_agent:
        start_agent(adapter or make_adapter(False)).wait_attached(60)
    with open(os.path.join(wd, "ready.tmp"), "w") as fh:
        json.dump({"t_start": T_START, "t_first_token": t_first, "params": params, "first": first, **extra}, fh)
    os.rename(os.path.join(wd, "ready.tmp"), os.path.join(wd, "ready"))
    n = 1
    while True:
        go = os.path.join(wd, f"go-{n}")
        if os.path.exists(go):
            with open(go) as fh:
                count = int(fh.read().strip() or 16)
            tokens = generate(PROMPT, count)
            with open(os.path.join(wd, f"tokens-{n}.tmp"), "w") as fh:
                json.dump({"tokens": tokens, "t_done": time.time()}, fh)
            os.rename(os.path.join(wd, f"tokens-{n}.tmp"), os.path.join(wd, f"tokens-{n}"))
            n += 1
        time.sleep(0.005)


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
