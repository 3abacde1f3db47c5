"""One engine under every API: check a ``Request``, render it, generate, read the outputs.

Each API's translation (``openai_api.py``, ``anthropic_api.py``, ``ollama_api.py``,
``responses_api.py``) parses its body into a ``request.Request``; the endpoint
driver (``endpoint.py``) calls ``Serving.open`` and hands the ``Output`` events
back to the translation, which writes them in its own format. So
the same checks, in the same order, guard every API: the model's name, the
model's own defaults for what the request leaves unset (``request.with_model_defaults``:
an Ollama model's params and system layers; the one place they apply), a ring
that is ready, sampling parameters against the vocabulary, a prompt that fits
the context (characters before tokens, so an absurd prompt is refused before
it is paid for), a grammar that compiles; and the same engine, stop handling,
metrics and request ids serve them. Refusals are ``ApiError`` with the API's
own field names (``Request.names``); each API renders them in its own shape.

Work off the event loop: rendering (template, tokenizer) and grammar checks run
in an executor, a few at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, AsyncIterator

from ringd.http.errors import ApiError
from ringd.http.images import ImageError, decode_all
from ringd.models.errors import ModelError
from ringd.models import vision
from ringd.models.vision import Processor, image_token_id, sees
from ringd.ring.media import Picture, PromptImages
from ringd.http.reader import Reader
from ringd.http.render import Rendered, RenderError, render
from ringd.http.request import Output, Request, Usage, with_model_defaults
from ringd.leader.errors import EngineError
from ringd.ring.sampling import SamplingError

log = logging.getLogger(__name__)

# How many times one request may move to another replica whose ring serves (each move after its
# own ring was lost for good): more than a cluster has replicas to lose.
MAX_REPLICA_HANDOFFS = 4

if TYPE_CHECKING:
    from ringd.http.node import ApiNode, Served
    from ringd.leader.engine import Engine

# Prompts rendered and grammars checked at once: CPU-bound work off the event
# loop that holds a copy of the prompt; a burst of giant requests waits its turn.
MAX_CONCURRENT_RENDERS = 2
# Grammars already checked against this model's tokenizer, by their text: an
# agent sends the same tools and schema with every turn.
CHECKED_GRAMMARS = 256
# Processors kept of models that see (each a tokenizer and an image processor, some MB): more
# than a pool holds models at once.
MAX_PROCESSORS = 8


class Generation:
    """One request's outputs: iterate for ``Output`` events; ``usage`` counts as they come.

    And when it happened (``time.monotonic_ns``): the request arrived
    (``received_ns``, given by the driver), was opened (checked and rendered),
    had its first token, ended; Ollama reports the durations between them.
    """

    def __init__(self, req: Request, rendered: Rendered, events, tokenizer, resumed: int, received_ns: int | None = None):
        self.req = req
        self.rendered = rendered
        self.created = int(time.time())
        self.usage = Usage(prompt_tokens=len(rendered.prompt), completion_tokens=resumed)
        self.opened_ns = time.monotonic_ns()
        self.received_ns = self.opened_ns if received_ns is None else received_ns
        self.first_ns: int | None = None
        self.ended_ns: int | None = None
        # Answers the ring has sent that wait behind the output just yielded: the next output
        # comes without waiting, so a stream may write both at once (endpoint.py).
        self.backlog = 0
        self._events = events
        self._reader = Reader(rendered.read)
        self._tokenizer = tokenizer

    @property
    def prompt(self) -> list[int]:
        return self.rendered.prompt

    async def __aiter__(self) -> AsyncIterator[Output]:
        try:
            async for ev in self._events:
                final = ev.finish_reason is not None
                text, reasoning, pieces = self._reader.feed(ev.text, final)
                if ev.resumed:
                    continue  # the client has it: it only brings the reader to where it was
                if self.first_ns is None:
                    self.first_ns = time.monotonic_ns()
                self.usage.completion_tokens += 1
                self.usage.cached_tokens = ev.cached_tokens
                if reasoning or (self._reader.state == "reasoning" and not text):
                    self.usage.reasoning_tokens += 1
                finish = ev.finish_reason
                if self._reader.repeated:
                    finish = "tool_calls"  # a call came again: what it would go on writing is not wanted
                elif finish in ("stop", "length") and self._reader.calls:
                    finish = "tool_calls"  # max_tokens cut a list of calls: the complete ones are the answer
                self.backlog = ev.queued
                yield Output(ev.token, ev.logprob, ev.top_logprobs, text, reasoning, pieces, finish, ev.cached_tokens, ev.stop_sequence)
                if finish is not None and ev.finish_reason is None:
                    break  # ended here, not by the engine: the consumer's aclose() releases it on every stage
            self.ended_ns = time.monotonic_ns()
        except EngineError as e:
            raise ApiError(e.status, str(e), retry_after=e.retry_after) from None

    async def aclose(self) -> None:
        # However the consumer ends (done, failed, cancelled by a disconnect), closing
        # the engine's generator sends the RELEASE that frees every stage.
        await self._events.aclose()


class Serving:
    def __init__(self, node: "ApiNode"):
        self.d = node
        self._renders = asyncio.Semaphore(MAX_CONCURRENT_RENDERS)
        self._checked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._chars_per_token: dict[str, int] = {}  # by model: its tokenizer's longest entry
        self._processors: dict[str, Processor] = {}  # by model: a model that sees, its processor (loaded by its first image)
        self._processor_load = asyncio.Lock()

    async def open(
        self, req: Request, served: "Served", request_id: str | None, resumed: list[int] = (), received_ns: int | None = None
    ) -> Generation:
        """Check, render and start ``req`` on ``served`` (the model it names); its first token is
        not awaited here.

        ``resumed``: the ids a stream carried over already sent; ``received_ns``: when the request arrived."""
        req = with_model_defaults(req, served.info.defaults)
        engine = await self.ready(served)
        try:
            req.params.check_vocab(served.info.vocab_size)
        except SamplingError as e:
            raise ApiError(400, str(e), req.name(e.field) if e.field else None) from None
        seen = await self._seen(req, served)
        rendered = await self._rendered(req, served, seen)
        prompt = rendered.prompt
        images = rendered.images
        context = self._context(req, served)
        max_tokens = req.max_tokens if req.max_tokens is not None else context - len(prompt)
        if len(prompt) + max_tokens > context:
            raise ApiError(
                400,
                f"{len(prompt)} prompt tokens + {req.name('max_tokens')} {max_tokens} exceed the {self._context_name(req, served)} of {context} tokens",
                req.name("max_tokens"),
                "context_length_exceeded",
            )
        if len(resumed) >= max_tokens:
            raise ApiError(400, f"the stream carried over already holds max_tokens ({max_tokens}) tokens")
        params = req.params if rendered.grammar is None else dataclasses.replace(req.params, grammar=rendered.grammar)
        self.d.metrics.prompt_tokens.inc(len(prompt))
        events = self._generate(served, engine, prompt, params, max_tokens, req.stop, list(resumed), request_id, req.ignore_eos, images)
        gen = Generation(req, rendered, events, served.tokenizer, len(resumed), received_ns)
        if images is not None:
            gen.usage.image_tokens = sum(1 for t in images.key if t < 0)
        return gen

    def _generate(self, served: "Served", engine: "Engine", prompt, params, max_tokens, stop, resumed, request_id, ignore_eos, images) -> AsyncIterator:
        """``engine``'s events for the request (asked for now); should its replica's ring be lost for
        good (a 503: every Mac of its share gone, so it cannot re-form), the rest from another replica
        of the same model that serves, which replays the prompt and what was streamed, as a new leader does."""
        events = engine.generate(prompt, params, max_tokens, stop, resumed, request_id, emit_resumed=True, ignore_eos=ignore_eos, images=images)
        return self._carried(served, events, prompt, params, max_tokens, stop, resumed, request_id, ignore_eos, images)

    async def _carried(
        self, served: "Served", events: AsyncIterator, prompt, params, max_tokens, stop, resumed, request_id, ignore_eos, images
    ) -> AsyncIterator:
        produced: list[int] = []
        try:
            for _ in range(MAX_REPLICA_HANDOFFS + 1):
                try:
                    async for ev in events:
                        if not ev.resumed:
                            produced.append(ev.token)
                        yield ev
                    return
                except EngineError as e:
                    other = self._other_replica(served, e)
                    if other is None:
                        raise
                    log.warning("its ring is lost (%s); %d tokens in, the request goes on on %s", e, len(produced), other.name or other.model_id)
                    await events.aclose()
                    served = other
                    events = other.engine.generate(prompt, params, max_tokens, stop, [*resumed, *produced], request_id, ignore_eos=ignore_eos, images=images)
            raise EngineError(f"the request's ring was lost {MAX_REPLICA_HANDOFFS + 1} times", 503)
        finally:
            await events.aclose()

    def _other_replica(self, served: "Served", error: EngineError) -> "Served | None":
        """Another replica of ``served``'s model that serves, when ``error`` says ``served``'s ring
        cannot (a 503 while it is not ready); else None."""
        if error.status != 503 or served.readiness()[0]:
            return None
        other = self.d.loaded(served.model_id)
        return other if other is not None and other is not served and other.readiness()[0] else None

    async def ready(self, served: "Served") -> "Engine":
        """The engine, once a ring serves (a ring lost a moment ago: waiting for the next, as the
        requests in flight do); a 503 if this node does not lead or no ring serves."""
        engine = served.engine if self.d.leading else None
        if engine is None:
            raise ApiError(503, "this node does not lead; retry in a moment")
        ready, reason = served.readiness()
        if not ready and await engine.ring_back(self.d.failover_wait_s):
            ready, reason = served.readiness()
        if not ready:
            raise ApiError(503, f"the ring is not ready: {reason}")
        return engine

    async def count_tokens(self, req: Request, served: "Served") -> int:
        """The prompt tokens ``req`` would take (Anthropic's count_tokens): checked and rendered, not run."""
        return len((await self._rendered(with_model_defaults(req, served.info.defaults), served, await self._seen(req, served))).prompt)

    async def _seen(self, req: Request, served: "Served") -> "tuple[Processor, list[Picture]] | None":
        """A request's images, decoded (off the loop, bounded before work), and the model's processor
        that reads them with the prompt; None for a request without images. A 400 for a model
        that does not see, or an image that cannot be used, naming the part."""
        if not req.images:
            return None
        if not sees(served.info):
            # A GGUF model keeps its tower in a file of its own (llama.cpp's mmproj): say where it was looked for.
            where = f" (nor a projector file, mmproj*.gguf, beside {served.info.path.name})" if served.info.is_gguf else ""
            raise ApiError(400, f"{served.model_id} does not take images: it has no vision tower{where}", req.images[0].where)
        try:
            pictures = await decode_all(req.images, getattr(self.d, "fetch_image_urls", False))
        except ImageError as e:
            raise ApiError(400, str(e), str(e).partition(":")[0]) from None
        processor = self._processors.get(served.model_id)
        if processor is None:
            async with self._processor_load:
                processor = self._processors.get(served.model_id)
                if processor is None:
                    try:
                        processor = await asyncio.get_running_loop().run_in_executor(None, _processor_of, served.info)
                    except ModelError as e:
                        raise ApiError(503, f"{served.model_id}: images cannot be read here: {e}") from None
                    self._processors[served.model_id] = processor
                    while len(self._processors) > MAX_PROCESSORS:
                        self._processors.pop(next(iter(self._processors)))
        return processor, pictures

    def _context(self, req: Request, served: "Served") -> int:
        """The tokens ``req``'s prompt and answer may take together: the model's context length,
        or less where the request (Ollama's options.num_ctx) or else the model's defaults (an
        Ollama params layer's num_ctx) ask for less."""
        model = served.info.context_length
        return min(model, req.context or model)

    def _context_name(self, req: Request, served: "Served") -> str:
        return "model's context" if self._context(req, served) == served.info.context_length else "context asked for (num_ctx)"

    async def _rendered(self, req: Request, served: "Served", seen: "tuple[Processor, list[Picture]] | None" = None) -> Rendered:
        """The prompt (that fits the context) and the grammar (that compiles) of ``req``."""
        context = self._context(req, served)
        where = req.name("messages" if req.chat else "prompt")
        chars_per_token = self._chars_per_token.get(served.model_id)
        if chars_per_token is None:
            chars_per_token = self._chars_per_token[served.model_id] = max_chars_per_token(served.tokenizer)
            while len(self._chars_per_token) > CHECKED_GRAMMARS:
                self._chars_per_token.pop(next(iter(self._chars_per_token)))
        budget = context * chars_per_token
        # Every string of the request, counted before it is rendered or tokenized: off the loop,
        # as a request may hold a million of them.
        chars = await asyncio.get_running_loop().run_in_executor(None, req.prompt_chars, budget)
        if chars > budget:
            raise ApiError(
                400,
                f"the prompt{' and tools' if req.tools else ''} come to over {budget} characters, which cannot fit "
                f"the {self._context_name(req, served)} of {context} tokens (a token here spans at most {chars_per_token} characters)",
                where,
                "context_length_exceeded",
            )
        async with self._renders:
            rendered = await asyncio.get_running_loop().run_in_executor(None, self._render, req, served, seen)
        if rendered.grammar is not None:
            self._remember((served.model_id, rendered.grammar))
        prompt = rendered.prompt
        if isinstance(req.prompt, list):
            vocab = served.info.vocab_size
            if any(t >= vocab for t in prompt):
                raise ApiError(400, f"prompt token ids must be below the vocabulary size {vocab}", where)
        if len(prompt) >= context:
            raise ApiError(400, f"the prompt is {len(prompt)} tokens; the {self._context_name(req, served)} is {context}", where, "context_length_exceeded")
        return rendered

    def _render(self, req: Request, served: "Served", seen: "tuple[Processor, list[Picture]] | None" = None) -> Rendered:
        """On an executor thread: the prompt and grammar, the grammar checked against the tokenizer."""
        prepare = None
        if seen is not None:
            processor, pictures = seen
            prepare = functools.partial(_ids_with, processor, [p.image for p in pictures])
        try:
            rendered = render(req, served.tokenizer, getattr(self.d, "chat_template_kwargs", None), prepare)
        except RenderError as e:
            raise ApiError(400, str(e), e.field) from None
        if seen is not None:  # the images as the leader keeps them: hashed and joined here, off the loop
            files = tuple(p.raw for p in pictures)
            rendered.images = PromptImages.of(rendered.text, files, rendered.prompt, image_token_id(processor.config))
        if rendered.grammar is not None and (served.model_id, rendered.grammar) not in self._checked:
            from ringd.stage import grammar as grammars  # llguidance: loaded by the first request with a grammar

            try:
                grammars.check(rendered.grammar, served.tokenizer, served.info.vocab_size, req.name(_grammar_field(req)))
            except grammars.GrammarError as e:
                raise ApiError(400, str(e), e.where, "invalid_grammar") from None
        return rendered

    def _remember(self, grammar: tuple[str, str]) -> None:
        """On the event loop: ``grammar`` (model, text) compiles; later requests skip the check."""
        self._checked[grammar] = None
        self._checked.move_to_end(grammar)
        while len(self._checked) > CHECKED_GRAMMARS:
            self._checked.popitem(last=False)


def _processor_of(info) -> Processor:
    """The processor of a model that sees (its files where ``vision.source`` finds them). Reads files: off the loop."""
    return Processor.load(*vision.source(info))


def _ids_with(processor: Processor, images: list, text: str) -> list[int]:
    return processor.prepare(text, images).ids


def _grammar_field(req: Request) -> str:
    return "response_format" if req.response_format is not None else "tools"


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: its longest vocabulary entry.

    A text of n characters cannot encode to fewer than n / this tokens, so a
    prompt whose characters exceed context x this cannot fit, and is refused
    before it is tokenized. (Byte-level BPE entries spell one byte a character,
    which is at least one character of text; special tokens count with theirs.)
    """
    try:
        return max(1, max(len(t) for t in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError):
        return 1 << 16  # unknown tokenizer: the check still stops the absurd
