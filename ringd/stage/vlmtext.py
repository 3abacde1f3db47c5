"""mlx-vlm's language model of a checkpoint, called as an mlx-lm ``Model`` is, for the families
whose decoder mlx-lm's text path does not compute as mlx-vlm does.

Qwen's vision-language decoders (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) place every position by
three numbers, its time, row and column (multimodal RoPE): text positions have the
three equal, an image's tokens take its grid's rows and columns, and the text after an
image goes on from past its largest. mlx-lm's text path of these checkpoints has one
number a position, so a prompt with an image would be computed wrong. Here ``Shard``
runs mlx-vlm's own language model instead, cut at the stage's bounds as any model is,
and the ring carries each position's three numbers (``positions``, [3, B, L], set for
each call): the first stage takes them from mlx-vlm's ``get_input_embeddings`` for a
prompt with images, every other row's are its own position three times.

mlx-vlm's language model keeps the last prompt's positions as its own state between
calls (it computes them when none are given); every call here gives them, so nothing
of one request leaks into another's.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

import numpy as np

from ringd.models import vision
from ringd.models.errors import ModelError
from ringd.models.vision import mlx_vlm

class VlmText(nn.Module):
    """The language part of an mlx-vlm ``Model``: ``language_model`` (its decoder and head)."""

    def __init__(self, language_model: nn.Module):
        super().__init__()
        self.language_model = language_model
        object.__setattr__(self, "positions", None)  # no parameter: the call's [3, B, L] positions

    @classmethod
    def load(cls, path: Path) -> "VlmText":
        """The checkpoint's language model, lazily (nothing is read until a stage evaluates it)."""
        try:
            model = mlx_vlm().utils.load_model(Path(path), lazy=True, strict=False)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"{path}: mlx-vlm cannot load the model: {type(e).__name__}: {e}") from None
        return cls(model.language_model)

    @classmethod
    def of(cls, info) -> "VlmText":
        """The language model of a GGUF model and its projector file (``models/vision.source``), its
        weights not read (a stage loads its own)."""
        return cls(vision.model_of(vision.source(info)[1]).language_model)

    @property
    def layers(self) -> list:
        return self.language_model.model.layers

    def __call__(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None) -> mx.array:
        if self.positions is None:
            raise RuntimeError("a three-axis model's call needs its positions")
        out = self.language_model(inputs, inputs_embeds=input_embeddings, cache=cache, position_ids=self.positions)
        return out.logits


def text_rope(start: int, n: int) -> np.ndarray:
    """[3, n] positions of ``n`` text positions from ``start`` on: the three numbers equal."""
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (3, n))


def plain_positions(offsets: mx.array | int, length: int) -> mx.array:
    """[3, B, L] positions of text: from each row's ``offsets`` on, the three numbers equal."""
    offsets = mx.array(offsets).reshape(-1, 1)
    return mx.broadcast_to((offsets + mx.arange(length))[None], (3, offsets.shape[0], length))
