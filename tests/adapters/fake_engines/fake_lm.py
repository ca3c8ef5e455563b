"""The fakes' model: greedy decoding over real CPU tensors, vocab-parallel across tensor-parallel ranks.

Every rank holds the embedding (replicated) and its rows of the LM head; a step gives each rank's best
(logit, token id) over its rows, and the caller takes the best of the ranks (the real engines all-gather the
logits inside the TP group). The hidden state lives in the KV cache tensor between steps, so a KV cache that
was released and not re-created fails the next request. Tokens depend only on the seed and the prompt.
"""

from __future__ import annotations

import torch

VOCAB = 8192
HIDDEN = 256


class TinyLM(torch.nn.Module):
    def __init__(self, seed: int, rank: int = 0, world: int = 1):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        head = torch.randn(VOCAB, HIDDEN, generator=gen)
        rows = VOCAB // world
        self.offset = rank * rows
        self.embed = torch.nn.Parameter(embed, requires_grad=False)
        self.lm_head = torch.nn.Parameter(head[self.offset : self.offset + rows].clone(), requires_grad=False)

    def best(self, hidden: torch.Tensor) -> tuple[float, int]:
        value, index = torch.max(self.lm_head @ hidden, 0)
        return float(value), int(index) + self.offset


class KvCache:
    """One slot per request (the fakes run one request at a time); ``release``/``recreate`` free and re-allocate."""

    def __init__(self, slots: int = 4):
        self.buffer = torch.zeros(slots, HIDDEN)
        self._nbytes = self.buffer.untyped_storage().nbytes()

    @property
    def released(self) -> bool:
        return self.buffer.untyped_storage().nbytes() == 0

    def release(self) -> None:
        self.buffer.untyped_storage().resize_(0)

    def recreate(self) -> None:
        self.buffer.untyped_storage().resize_(self._nbytes)
        self.buffer.zero_()

    def prefill(self, model: TinyLM, prompt: list[int]) -> tuple[float, int]:
        if self.released:
            raise RuntimeError("a request reached the model while the KV cache is released")
        self.buffer[0] = model.embed[prompt].mean(0)
        return model.best(self.buffer[0])

    def decode(self, model: TinyLM, token: int) -> tuple[float, int]:
        if self.released:
            raise RuntimeError("a request reached the model while the KV cache is released")
        self.buffer[0] = torch.tanh(self.buffer[0] + model.embed[token])
        return model.best(self.buffer[0])


def pick(answers: list[tuple[float, int]]) -> int:
    """The best token over the ranks' answers (the lowest id on a tie)."""
    return min(answers, key=lambda a: (-a[0], a[1]))[1]
