"""Embeddings, in the APIs that have them: OpenAI's ``/v1/embeddings``, Ollama's ``/api/embed``
and its older ``/api/embeddings``.

Each API's translation here parses its body into one ``EmbedRequest`` and writes the
vectors back in its own shape; ``Embedder`` runs it: the same checks as a generation
(``Serving.ready``: a leader, a ring that serves), then every input tokenized off the
event loop and checked against the context, then all of a request's inputs through the
ring at once (``Engine.embed``), so they share its micro-batches. A vector is the model's
final hidden states pooled as the model declares (``ModelInfo.pooling``: a GGUF file's
``pooling_type``, else the mean over the input), on the last stage. OpenAI's vectors and
``/api/embed``'s are normalized to unit length (as Ollama's are); the older route's are
not (nor are Ollama's).

Nothing here grows on the event loop with what a client sends: parsing (up to MAX_INPUTS
inputs, token ids each checked), tokenizing, and writing thousands of vectors as JSON or
base64 run in the executor (``endpoint.py`` runs ``parse`` and ``answer`` there).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ringd.http.errors import ApiError
from ringd.http.fields import valid_text
from ringd.http.ollama_api import check_model as check_ollama_model
from ringd.http.serving import max_chars_per_token
from ringd.leader.errors import EngineError
from ringd.models.naming import same_model
from ringd.ring.sampling import brief_repr

if TYPE_CHECKING:
    from ringd.http.node import Served
    from ringd.http.serving import Serving

# Inputs in one request: OpenAI's own limit. Each is a prompt through the ring.
MAX_INPUTS = 2048
# A request's inputs in the engine at once: they share micro-batches, and leave room
# among the engine's MAX_ACTIVE_REQUESTS for everyone else's requests.
INPUTS_IN_FLIGHT = 8
# Requests tokenized at once, off the event loop (each holds its inputs' text).
MAX_CONCURRENT_TOKENIZE = 2
# OpenAI's encodings of a vector.
ENCODINGS = ("float", "base64")


@dataclass
class EmbedRequest:
    inputs: list[str | list[int]]  # texts, or token ids
    where: str  # the body's field that holds them, for errors
    normalize: bool = True  # to unit length
    truncate: bool = False  # an input over the context is cut to fit (Ollama's default), not refused
    encoding: str = "float"  # OpenAI's encoding_format
    model: str = ""  # the model as the client named it (Ollama answers with it)


@dataclass
class Embedded:
    vectors: list[np.ndarray]  # float32, one per input, in order
    prompt_tokens: int
    duration_ns: int


class Embedder:
    def __init__(self, serving: "Serving"):
        self.serving = serving
        self._tokenizing = asyncio.Semaphore(MAX_CONCURRENT_TOKENIZE)
        self._chars_per_token: dict[int, int] = {}  # by tokenizer (id): the longest token's characters

    async def embed(self, req: EmbedRequest, request_id: str | None, served: "Served") -> Embedded:
        """``req``'s vectors from the model ``served`` (the pool's instance the request named)."""
        started = time.monotonic_ns()
        engine = await self.serving.ready(served)
        async with self._tokenizing:
            prompts = await asyncio.get_running_loop().run_in_executor(None, self._tokens, req, served)
        pool = served.info.pooling
        gate = asyncio.Semaphore(INPUTS_IN_FLIGHT)

        async def one(prompt: list[int]) -> np.ndarray:
            async with gate:
                # Each input under the request's own id (the id is checked as it is, at its limit).
                return await engine.embed(prompt, pool, request_id)

        try:
            # One input that fails ends the request, and the inputs still in the ring leave it.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(p)) for p in prompts]
        except BaseExceptionGroup as failed:
            e = next((x for x in failed.exceptions if isinstance(x, EngineError)), None)
            if e is None:
                raise
            raise ApiError(e.status, str(e), retry_after=e.retry_after) from None
        vectors = [t.result() for t in tasks]
        if req.normalize:
            vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        return Embedded(list(vectors), sum(map(len, prompts)), time.monotonic_ns() - started)

    def _tokens(self, req: EmbedRequest, served: "Served") -> list[list[int]]:
        """On an executor thread: each input's token ids, checked against the context (cut to it, with ``truncate``)."""
        info, tokenizer = served.info, served.tokenizer
        fits = info.context_length - 1  # the ring books one position past the input for its answer
        chars_per_token = self._chars_per_token.get(id(tokenizer))
        if chars_per_token is None:
            chars_per_token = self._chars_per_token[id(tokenizer)] = max_chars_per_token(tokenizer)
        out = []
        for i, item in enumerate(req.inputs):
            where = f"{req.where}[{i}]" if len(req.inputs) > 1 else req.where
            if isinstance(item, str):
                if not req.truncate and len(item) > fits * chars_per_token:
                    raise ApiError(400, f"{where} is {len(item)} characters, which cannot fit the model's context of {info.context_length} tokens", where, "context_length_exceeded")
                tokens = tokenizer.encode(item[: (fits + 1) * chars_per_token])
            else:  # token ids, checked against the vocabulary when parsed
                tokens = list(item)
            if not tokens:
                raise ApiError(400, f"{where} is empty: there is nothing to embed", where)
            if len(tokens) > fits:
                if not req.truncate:
                    raise ApiError(400, f"{where} is {len(tokens)} tokens; the model's context is {info.context_length}", where, "context_length_exceeded")
                tokens = tokens[:fits]
            out.append(tokens)
        return out


class Translation(Protocol):
    """One API's side of an embedding route."""

    def parse(self, body: dict, served: "Served") -> EmbedRequest:
        """The body as the one embedding request of the model ``served`` (the instance the pool
        found by its name), or a 400 (404: a name that is not that model's)."""

    def answer(self, req: EmbedRequest, done: Embedded) -> Any:
        """The answer's body (a dict, or its JSON already as bytes); run off the event loop."""


def _inputs(v: Any, where: str, vocab_size: int, ids: bool) -> list[str | list[int]]:
    """A string or a list of them (``ids``: or token ids, a list of them or of lists), as a list."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and len(v) > MAX_INPUTS and not (ids and all(type(t) is int for t in v)):
        raise ApiError(400, f"{where} holds {len(v)} inputs; at most {MAX_INPUTS} are embedded in one request", where)
    if ids and isinstance(v, list) and v and all(type(t) is int for t in v):
        v = [v]
    ok = isinstance(v, list) and v and all(isinstance(x, str) or (ids and isinstance(x, list) and x and all(type(t) is int for t in x)) for x in v)
    if not ok:
        kinds = "a string, a list of strings, a list of token ids or a list of such lists" if ids else "a string or a list of strings"
        raise ApiError(400, f"{where} must be {kinds}, not empty; got {brief_repr(v)}", where)
    for i, x in enumerate(v):
        if isinstance(x, str):
            valid_text(x, f"{where}[{i}]")
        elif any(not 0 <= t < vocab_size for t in x):
            raise ApiError(400, f"{where}[{i}]: token ids must be in [0, {vocab_size})", f"{where}[{i}]")
    return v


def _dimensions(body: dict, width: int) -> None:
    dims = body.get("dimensions")
    if dims is not None and (type(dims) is not int or dims < 1):
        raise ApiError(400, f"dimensions must be a whole number of dimensions, at least 1; got {brief_repr(dims)}", "dimensions")
    if dims is not None and dims != width:
        raise ApiError(
            400, f"dimensions {brief_repr(dims)}: this model's embeddings have {width} dimensions and cannot be shortened; leave dimensions out",
            "dimensions",
        )  # fmt: skip


class OpenAIEmbeddings:
    """``POST /v1/embeddings``: ``input`` a string, a list of them, or token ids; ``encoding_format``
    float or base64 (little-endian float32, what OpenAI's SDKs ask for by default)."""

    def parse(self, body: dict, served: "Served") -> EmbedRequest:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required", "model")
        if not same_model(model, served.model_id):
            raise ApiError(404, f"model {brief_repr(model)} is not served here", "model", "model_not_found")
        fmt = body.get("encoding_format")
        fmt = "float" if fmt is None else fmt  # null is left out, as for dimensions
        if fmt not in ENCODINGS:
            raise ApiError(400, f"encoding_format must be one of {', '.join(ENCODINGS)}; got {brief_repr(fmt)}", "encoding_format")
        _dimensions(body, served.info.hidden_size)
        if "user" in body and not isinstance(body["user"], str):
            raise ApiError(400, "user must be a string", "user")
        return EmbedRequest(_inputs(body.get("input"), "input", served.info.vocab_size, ids=True), "input", encoding=fmt, model=served.model_id)

    def answer(self, req: EmbedRequest, done: Embedded) -> bytes:
        b64 = req.encoding == "base64"
        data = [
            {"object": "embedding", "index": i, "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()}
            for i, v in enumerate(done.vectors)
        ]
        usage = {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}
        return json.dumps({"object": "list", "data": data, "model": req.model, "usage": usage}).encode()


class OllamaEmbed:
    """Ollama's ``POST /api/embed`` (``input``: a string or a list; ``truncate``, default true, cuts
    an input to the context) and its older ``POST /api/embeddings`` (``legacy``: ``prompt``, one
    string, not normalized; an empty prompt gives an empty vector, as Ollama's does)."""

    keep_alive = True  # Ollama's embed calls set their model's keep_alive, as its generate calls do

    def __init__(self, legacy: bool = False):
        self.legacy = legacy

    def parse(self, body: dict, served: "Served") -> EmbedRequest:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required")
        check_ollama_model(model, served.model_id)
        if self.legacy:
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise ApiError(400, f"prompt must be a string; got {brief_repr(prompt)}")
            valid_text(prompt, "prompt")
            return EmbedRequest([prompt] if prompt else [], "prompt", normalize=False, truncate=True, model=model)
        else:
            truncate = body.get("truncate", True)
            if not isinstance(truncate, bool):
                raise ApiError(400, "truncate must be true or false")
            _dimensions(body, served.info.hidden_size)
        return EmbedRequest(_inputs(body.get("input"), "input", served.info.vocab_size, ids=False), "input", truncate=truncate, model=model)

    def answer(self, req: EmbedRequest, done: Embedded) -> bytes:
        if self.legacy:
            return json.dumps({"embedding": done.vectors[0].tolist() if done.vectors else []}).encode()
        return json.dumps(
            {
                "model": req.model,
                "embeddings": [v.tolist() for v in done.vectors],
                "total_duration": done.duration_ns,
                "load_duration": 0,
                "prompt_eval_count": done.prompt_tokens,
            }
        ).encode()
