"""Greedy decoding whose decode step is one captured CUDA graph (used by llm_worker.py ``--graphs``).

The model runs over a transformers ``StaticCache`` with explicit position ids, cache positions and a 4-D
additive attention mask, so a decode step has fixed shapes and fixed tensors: it is captured once with
``torch.cuda.graph`` (the step's argmax included) and replayed for every later token. The graph reads the
model's weights at the device addresses they had at capture, which is what an address-stable reload must
preserve. The prompt's prefill runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch


def _static_cache(model: Any, max_len: int) -> Any:
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older transformers: sized and placed up front
        return StaticCache(
            config=model.config, max_batch_size=1, max_cache_len=max_len, device=model.device, dtype=model.dtype
        )


class GraphDecoder:
    """Greedy generation for batch 1 with a CUDA-graph decode step.

    Args:
        model: a transformers causal LM on one GPU.
        max_len: prompt plus generated tokens, at most.
    """

    def __init__(self, model: Any, max_len: int = 64):
        self.model = model
        self.max_len = max_len
        dev = model.device
        self.cache = _static_cache(model, max_len)
        self.neg = torch.finfo(model.dtype).min
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.mask = torch.zeros(1, 1, 1, max_len, dtype=model.dtype, device=dev)
        self.next = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        out = self.model(
            input_ids=self.ids,
            position_ids=self.pos[None],
            cache_position=self.pos,
            past_key_values=self.cache,
            attention_mask=self.mask,
            use_cache=True,
        )
        self.next.copy_(out.logits[0, -1].argmax())

    def _prefill(self, prompt: list[int]) -> int:
        dev = self.model.device
        self.cache.reset()
        n = len(prompt)
        pos = torch.arange(n, device=dev)
        allowed = torch.arange(self.max_len, device=dev)[None, :] <= pos[:, None]
        mask = torch.where(allowed, 0.0, self.neg).to(self.model.dtype)[None, None]
        out = self.model(
            input_ids=torch.tensor([prompt], device=dev),
            position_ids=pos[None],
            cache_position=pos,
            past_key_values=self.cache,
            attention_mask=mask,
            use_cache=True,
        )
        return int(out.logits[0, -1].argmax())

    def _set(self, token: int, position: int) -> None:
        self.ids.fill_(token)
        self.pos.fill_(position)
        self.mask.fill_(self.neg)
        self.mask[..., : position + 1] = 0.0

    def capture(self, prompt: list[int]) -> None:
        """Warm up the decode step on a side stream, then capture it (after a prefill of ``prompt``)."""
        with torch.inference_mode():
            first = self._prefill(prompt)
            self._set(first, len(prompt))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step()
            torch.cuda.synchronize()
            self.graph = graph

    def generate(self, prompt: list[int], n: int, *, eager: bool = False) -> list[int]:
        """``n`` greedy tokens after ``prompt``; decode steps replay the graph (or run eagerly)."""
        if len(prompt) + n > self.max_len:
            raise ValueError(f"prompt plus {n} tokens exceed {self.max_len}")
        with torch.inference_mode():
            tokens = [self._prefill(prompt)]
            for i in range(n - 1):
                self._set(tokens[-1], len(prompt) + i)
                if eager or self.graph is None:
                    self._step()
                else:
                    self.graph.replay()
                tokens.append(int(self.next.item()))
            torch.cuda.synchronize()
        return tokens
