"""What a request gets for a field it leaves unset, as the model's own files say.

An Ollama model carries sampling defaults, stop words, a length and a context
(its params layer) and a system prompt (its system layer) next to its weights;
``ollama/store.py`` reads them and ``ollama/params.py`` parses them into a
``ModelDefaults``. Whatever API a request came by, the request's own value wins;
a field neither sets keeps ringd's default (``ring.sampling.SamplingParams``'s,
no stop words, until the context ends). ``http/request.py``'s
``with_model_defaults`` applies them, once, where ``serving.py`` opens a request.

A plain value: no I/O, no HTTP. A model with no such layers (every directory and
plain GGUF file) has the empty one, which changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


# The SamplingParams fields a model's defaults may set.
SAMPLED = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ModelDefaults:
    # SamplingParams' fields (SAMPLED) -> the value a request that leaves one unset samples with.
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] | None = None  # None: none of the model's own
    max_tokens: int | None = None  # None: until the context ends
    # Tokens a request's prompt and answer may take together (Ollama's num_ctx): at most the
    # model's own context length, which it lowers; a request may ask for another (Ollama's options.num_ctx).
    context: int | None = None
    system: str | None = None  # the system message of a chat that starts without one
    source: str = ""  # where they come from, for messages ("ollama:smollm2")

    def __bool__(self) -> bool:
        return bool(self.sampling) or any(v is not None for v in (self.stop, self.max_tokens, self.context, self.system))

