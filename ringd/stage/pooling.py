"""An embedding's pooling on the last stage: its final hidden states, row by row, to one vector.

A request opened with a pool (``steps.Open.pool``) comes to the last stage in
rows like any prompt (prefill chunks, then its last token alone); each row's
final hidden states (after the model's norm, before its head) are folded in as
they come, so a long input never holds more than one chunk's activations: a
running sum for "mean", the first position's for "cls", the latest position's
for "last". The vector goes back as it is (float32, not normalized): each API
normalizes as it does (OpenAI's and Ollama's ``/api/embed`` do, Ollama's legacy
``/api/embeddings`` does not).

It ignores the network and the rows' order on the ring (``runner.py``).
"""

from __future__ import annotations

import mlx.core as mx


class Pooling:
    def __init__(self, kind: str):
        self.kind = kind  # one of steps.POOLINGS
        self.pooled: mx.array | None = None  # [H] float32: the sum, first or last position
        self.positions = 0

    def add(self, hidden: mx.array) -> None:
        """One row's final hidden states, ``[1, L, H]``, the next L positions of the input (lazily)."""
        h = hidden[0].astype(mx.float32)
        if self.kind == "mean":
            total = h.sum(axis=0)
            self.pooled = total if self.pooled is None else self.pooled + total
        elif self.kind == "last" or self.pooled is None:  # "cls" keeps the first position's
            self.pooled = h[-1] if self.kind == "last" else h[0]
        self.positions += h.shape[0]

    def arrays(self) -> list[mx.array]:
        """What to evaluate with the row's caches: the pooling so far, not its lazy graph."""
        return [self.pooled] if self.pooled is not None else []

    def vector(self) -> mx.array:
        if self.pooled is None:
            raise ValueError("nothing was pooled")
        return self.pooled / self.positions if self.kind == "mean" else self.pooled
