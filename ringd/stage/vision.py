"""A vision-language model's vision tower and projector, on the ring's first stage.

mlx-vlm's own model code computes a prompt's input embeddings
(``Model.get_input_embeddings``: the tokens' embeddings, each image's features, from
its tower and projector, in its tokens' places, scaled as the family does); the first
stage starts its layers from them instead of from the tokens' embeddings
(``Shard.__call__(embeddings=...)``), and the language layers run, are cached,
batched and replayed as any model's.

Only the tower and projector are read into memory here: mlx-vlm's model is loaded
lazily and its language part is never evaluated, but for the token embeddings,
which are the shard's own (one table in memory, not two).

A prompt's embeddings are computed once, at its first row (all its images through
the tower at once, as mlx-vlm does), kept with its session while its chunks come, and
dropped after the last (``Prompt``). It ignores the network (``runner.py``) and what
the leader renders (``models/vision.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ringd.models import vision
from ringd.models.checkpoint import ModelInfo
from ringd.models.errors import ModelError
from ringd.models.gguf.mmproj import Mmproj
from ringd.models.vision import Processor, mlx_vlm
from ringd.ring.media import ImageError, Media, picture
from ringd.stage.shard import Shard, inner_model
from ringd.stage.vlmtext import text_rope


def _from_projector(info: ModelInfo, config: dict, embed_tokens) -> nn.Module:
    """mlx-vlm's model of ``config``, its vision tower and projector read from the GGUF model's
    projector file, in the dtype of the model's embeddings."""
    model = vision.model_of(config)
    weight = embed_tokens.weight if "weight" in embed_tokens else None
    dtype = weight.dtype if weight is not None and mx.issubdtype(weight.dtype, mx.floating) else mx.float16
    if "scales" in embed_tokens:  # quantized embeddings: their scales' dtype is the model's
        dtype = embed_tokens.scales.dtype
    model.load_weights(Mmproj.open(info.mmproj).weights(model, dtype), strict=False)
    return model


class VisionError(Exception):
    """A request's images cannot be seen here (damaged, or not what the leader's ids say): its own failure."""


@dataclass
class Prompt:
    """A prompt's input embeddings [1, L, D] on the first stage, for its chunks to start from; for a
    three-axis decoder (``vlmtext.py``), its positions [3, L] and ``shift``: what the positions
    after it add to their index (negative: an image's tokens span fewer positions than tokens)."""

    ids: list[int]
    embeddings: mx.array
    positions: np.ndarray | None = None
    shift: int = 0

    def rope(self, offset: int, n: int) -> np.ndarray:
        """The three-axis positions [3, n] of positions [offset, offset + n): the prompt's, and past
        its end each index plus ``shift``, the three numbers equal."""
        inside = self.positions[:, offset : offset + n]
        past = text_rope(offset + inside.shape[1] + self.shift, n - inside.shape[1])
        return np.concatenate([inside, past], axis=1).astype(np.int32)

    def chunk(self, offset: int, tokens: Sequence[int], embed) -> mx.array:
        """The input embeddings of positions [offset, offset + len(tokens)): the prompt's, which must
        hold ``tokens`` there; past its end (a replay's chunk takes the answer so far with the
        prompt's last positions), the tokens' own (``embed``: the model's embedding table)."""
        inside = max(0, min(offset + len(tokens), len(self.ids)) - offset)
        if self.ids[offset : offset + inside] != list(tokens[:inside]):
            raise VisionError(
                f"positions [{offset}, {offset + inside}) of the prompt are not those its images were prepared with "
                "(the leader's and this stage's processors disagree: mixed versions?)"
            )
        part = self.embeddings[:, offset : offset + inside]
        if inside == len(tokens):
            return part
        rest = embed(mx.array([tokens[inside:]], dtype=mx.int32)).astype(part.dtype)
        return mx.concatenate([part, rest], axis=1) if inside else rest

    def done_after(self, offset: int, n: int) -> bool:
        """Whether a row of ``n`` positions from ``offset`` ends the prompt (its embeddings go then)."""
        return offset + n >= len(self.ids)


class Vision:
    """The vision tower and projector of the model whose first layers ``shard`` holds."""

    def __init__(self, model, processor: Processor):
        self.model = model
        self.processor = processor

    @classmethod
    def load(cls, info: ModelInfo, shard: Shard) -> "Vision":
        """mlx-vlm's model of ``info``'s model, lazily, with ``shard``'s token embeddings; its tower and
        projector read into memory (from a GGUF model's projector file: ``gguf/mmproj.py``). On the
        compute thread."""
        path, config = vision.source(info)
        embed_tokens = inner_model(shard.model)[1].embed_tokens
        try:
            model = _from_projector(info, config, embed_tokens) if info.mmproj is not None else mlx_vlm().utils.load_model(Path(path), lazy=True, strict=False)
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"{info.name}: mlx-vlm cannot load the model's vision tower: {type(e).__name__}: {e}") from None
        language = getattr(model, "language_model", None)
        inner = getattr(language, "model", None)
        if inner is None or not hasattr(inner, "embed_tokens"):
            raise ModelError(f"{info.name}: mlx-vlm's {type(model).__module__} has no language_model.model.embed_tokens")
        inner.embed_tokens = embed_tokens
        mx.eval([v for name, v in tree_flatten(model.parameters()) if not name.startswith("language_model.")])
        return cls(model, Processor.load(path, config))

    def embed(self, tokens: mx.array) -> mx.array:
        """The tokens' own input embeddings (the model's table, as its code reads it before scaling)."""
        return self.model.language_model.model.embed_tokens(tokens)

    def prompt(self, media: Media) -> Prompt:
        """The input embeddings of ``media``'s prompt (lazily: evaluated with the first chunk that
        uses them). A VisionError for images that are not what they should be."""
        try:
            pictures = [picture(raw, f"image {i}").image for i, raw in enumerate(media.images)]
        except ImageError as e:
            raise VisionError(str(e)) from None
        prepared = self.processor.prepare(media.text, pictures)
        arrays = dict(prepared.arrays)
        pixels, mask = arrays.pop("pixel_values", None), arrays.pop("attention_mask", None)
        if pixels is None:
            raise VisionError("the model's processor made no pixels of the images")
        out = self.model.get_input_embeddings(mx.array([prepared.ids]), pixels, mask=mask, **arrays)
        positions = getattr(out, "position_ids", None)
        if positions is None:
            return Prompt(prepared.ids, out.inputs_embeds)
        shift = getattr(out, "rope_deltas", None)
        return Prompt(prepared.ids, out.inputs_embeds, np.array(positions[:, 0], dtype=np.int32), int(shift.item()) if shift is not None else 0)
