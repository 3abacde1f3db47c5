"""When two names mean one model: the rules the model list, the pool and Ollama's API share.

A request names a model as its client spells it: ``smollm2``, ``smollm2:latest``,
``ollama:library/smollm2:latest``, ``vendor/m`` for ``vendor/m.gguf``. Every part that
compares model names asks here, so that what the model list finds, what the pool
routes to and what Ollama's API answers for are the same model.

Names come from any HTTP client: they are only compared, never made into a path.
"""

from __future__ import annotations

from ringd.models.ollama import store
from ringd.models.errors import ModelError

# What Ollama's clients put after an untagged name.
LATEST = ":latest"


def tagged(name: str) -> str:
    """Ollama's form of a name: ``smollm2`` is ``smollm2:latest`` (a tag is after the last slash)."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + LATEST


def ollama_spelling(name: str) -> str:
    """A listed name as Ollama's clients spell names: tagged, a model of Ollama's store without
    ringd's ``ollama:`` (``ollama:smollm2:135m`` is ``smollm2:135m``, ``tiny-a`` is ``tiny-a:latest``).
    ``match`` finds the model by it again."""
    return tagged(name.removeprefix(store.PREFIX))


def same_model(a: str, b: str) -> bool:
    """Whether two names a request may use name the same model (``smollm2``, ``smollm2:latest``)."""
    return tagged(a) == tagged(b)


def ollama_key(name: str) -> store.OllamaName | None:
    """The model an Ollama name means, its left-out parts filled in as Ollama fills them (None if it
    is no Ollama name). Parts are compared as spelt, as the store's folders are (``ollama/store.py``)."""
    try:
        return store.parse_name(name.removeprefix(store.PREFIX))
    except ModelError:
        return None


def gguf_stem(name: str) -> str | None:
    """A GGUF file's name without ``.gguf`` (None for any other name): what a request may call it."""
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else None
