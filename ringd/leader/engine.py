"""The leader's side of generation: admit a request, drive the ring, stream tokens.

A request enters as token ids and joins the schedule (``scheduler.py``): its
prompt goes to stage 0 in prefill chunks (the last prompt token alone, as
mlx-lm's ``generate_step`` does, so the ring's arithmetic is the single
process's), then each token the last stage sends back is fed to stage 0 again
at once, before anyone reads it: the ring never waits on HTTP. Requests that
decode at the same time go around together, in micro-batches (``steps.py``),
up to one in flight per stage, so every stage works at once and each computes
its rows in one pass; a long prompt's chunks take turns with them. The
consumer of ``generate`` gets the tokens with their text, stop strings already
applied. When the consumer stops listening, for any reason, the request leaves
the schedule, and a RELEASE, once its last row is back, frees its caches on
every stage.

When the ring breaks (a stage died), requests in flight are suspended, not
failed; once the leader has a new ring they are replayed on it: the same
prompt chunks, then every token already produced fed back one at a time and
sampled silently (so a seeded sampler's key advances exactly as before), so
the new ring's caches hold what the old ones held (bit for bit where both
rings computed the request's rows alone; batched with others, up to rounding)
and the stream carries on with the next token, none missing, none repeated. Frames of an older ring
(its term) are ignored. (A request that started from a cached prefix is
replayed from its first token: correct, but its caches are then the cold
run's rather than bit for bit the interrupted ring's.)

Admission: a request's whole context (prompt plus max_tokens) is booked on
every stage's KV capacity (``admission.Admission``, over the ring's ``KvLedger``) before it enters the ring.
Cached prefixes are evicted first to make room; then it waits in a bounded
FIFO queue, and a full queue or a wait past ``queue_timeout_s`` is a 429 with
Retry-After. A context that could never fit is a 400.

Prefix reuse: a request that ends normally leaves its caches on the stages
(``prefix.PrefixIndex``); a later one sharing its prefix starts from them.

The engine knows nothing of HTTP; the API modules turn its events into
responses. The schedule itself is sans-I/O (``scheduler.py``); this is its
asyncio shell: frames out, frames in, tokens to consumers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

import numpy as np
from mlx_lm.generate import TextStateMachine

from ringd.ring import steps
from ringd.ring.media import PromptImages
from ringd.ring.plan import Plan
from ringd.leader.admission import FAILOVER_WAIT_S, MAX_QUEUED_REQUESTS, QUEUE_TIMEOUT_S, Admission, KvLedger
from ringd.leader.draft import Drafter, Proposal
from ringd.leader.pacing import DEFAULT_PREFILL_CHUNK_S, ChunkPacer
from ringd.leader.errors import RETRY_AFTER_S, EngineError
from ringd.leader.prefix import DEFAULT_PREFIX_CACHE_ENTRIES, MIN_REUSE_TOKENS, PrefixIndex, common_prefix
from ringd.leader.scheduler import DEFAULT_INTERLEAVED_CHUNK, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_ROWS, DEFAULT_NUM_DRAFT, DEFAULT_PREFILL_CHUNK, Deliver, Draft, Fail, Release, Scheduler, Send
from ringd.base.logs import about
from ringd.base.metrics import Metrics
from ringd.ring.sampling import SamplingParams
from ringd.ring.steps import KvOptions
from wire.frames import Frame, FrameError, MsgType

log = logging.getLogger(__name__)

# Requests generating at once on this leader. Each holds KV caches on every
# stage; past this a request is refused with 429 rather than queued forever.
MAX_ACTIVE_REQUESTS = 64
# An embedding runs as a prompt does, with greedy parameters the last stage never samples with,
# and its vector stands for the one token that ends its schedule (never fed back: max_tokens 1).
EMBEDDING_PARAMS = SamplingParams(temperature=0.0)
EMBEDDED_TOKEN = 0
# Longest a request waits for one that is leaving, and shares its prompt's start, to be kept as
# a cached prefix: its last row's way around the ring (tens of milliseconds on Macs), generously.
LEAVING_WAIT_S = 5.0
# Longest wait for the ring to answer one step. A prefill chunk of a large
# model on a slow Mac takes seconds; two minutes of silence means the ring is
# broken, and the request fails instead of hanging.
STEP_TIMEOUT_S = 120.0


@dataclass
class TokenEvent:
    token: int
    text: str  # text to emit now (stop strings are held back until they can't match)
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None = None  # "stop" or "length" on the last event
    cached_tokens: int = 0  # prompt tokens whose caches came from a cached prefix
    resumed: bool = False  # a token an earlier leader streamed (emit_resumed), not a new one
    stop_sequence: str | None = None  # the stop string that ended the request (Anthropic reports it)
    queued: int = 0  # the ring's answers for the request already waiting behind this one (its consumer lags)


@dataclass
class _Flight:
    """One request in the ring, as the leader sees it (its schedule is the scheduler's)."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    queue: asyncio.Queue  # steps.Sampled for each token, or the EngineError that ends it
    generated: list[int] = field(default_factory=list)  # tokens delivered (resumed ones first)
    finished: bool = False  # its consumer is done, or it failed
    failed: bool = False  # a stage reported an error: its caches are not whole
    reuse: tuple[int, int] | None = None  # (cached prefix, positions kept), until its first row goes
    cached: int = 0  # prompt tokens served from a cached prefix
    opened: int | None = None  # the ring (term) its first row went to: later rows there need no Open
    suspended: bool = False  # its ring was lost: replayed on the next
    released: bool = False  # its caches are released (or kept as a prefix): its booking is settled
    request_id: str | None = None  # the client's name for it (logs.py)
    arrived: float = 0.0  # when it reached the engine (time.monotonic())
    produced: int = 0  # tokens it yielded here
    first_token_s: float | None = None  # from arrival to its first token here
    last_token_at: float | None = None
    outcome: str = "ended by its client"  # unless it finishes or fails
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set with ``released``
    pool: str | None = None  # an embedding: pooled on the last stage (steps.POOLINGS), not sampled
    images: PromptImages | None = None  # its prompt's images: sent to the first stage before its first row on each ring
    waiting_since: float | None = None  # when its consumer began waiting for the ring's answer (loop time)
    watchdog: asyncio.TimerHandle | None = None  # fails that wait at step_timeout_s (``_overdue``)

    def about(self, term: int | None = None, **fields) -> dict:
        """``extra`` for a log line about this request."""
        return about(self.request_id, term, rid=f"{self.rid:x}", **fields)

    @property
    def key(self) -> list[int]:
        """Its prompt and answer so far as the prefix cache keys them (an image's positions by its bytes)."""
        return [*(self.images.key if self.images is not None else self.prompt), *self.generated]


class _Text:
    """A request's text, token by token: detokenized, stop strings held back until they cannot match."""

    def __init__(self, detokenizer, stop: list[str], eos_ids: set[int], max_tokens: int, ignore_eos: bool = False):
        self.detokenizer = detokenizer
        self.ignore_eos = ignore_eos  # an end token does not end it, and is spelt as nothing (vLLM's ignore_eos)
        self.stops = TextStateMachine({"normal": [(s, None) for s in stop]}) if stop else None
        self.state = self.stops.make_state() if self.stops else None
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.produced = 0
        # The last raw characters, as long as the longest stop: enough to tell which one matched.
        self._longest = max(map(len, stop), default=0)
        self._tail = ""
        self.stop_strings = list(stop)
        self.matched: str | None = None  # the stop string that ended it

    def next(self, token: int) -> tuple[str, str | None]:
        """The text to emit for ``token``, and the finish reason if it ends the request."""
        self.produced += 1
        finish = None
        if token in self.eos_ids and not self.ignore_eos:
            finish, text = "stop", ""
        else:
            text = ""
            if token not in self.eos_ids:
                self.detokenizer.add_token(token)
                text = self.detokenizer.last_segment
            if self.produced >= self.max_tokens:
                finish = "length"
        if finish is not None:
            self.detokenizer.finalize()
            text += self.detokenizer.last_segment
        if self.stops is not None:
            seen = self._tail + text
            self.state, text, state_name = TextStateMachine.step(self.state, text)
            if state_name is None:
                finish = "stop"
                # What was read up to the match's end (the state keeps what follows it); of the
                # stops that end there, the matcher (Aho-Corasick) takes the longest.
                through = seen[: len(seen) - len(self.state[3])]
                self.matched = max((s for s in self.stop_strings if through.endswith(s)), key=len, default=None)
            elif finish is not None:
                self.state, rest, _ = TextStateMachine.flush(self.state)
                text += rest
            self._tail = seen[-self._longest :]
        return text, finish



@dataclass(frozen=True)
class EngineSettings:
    """What an engine is tuned by, each default the one the config table gives (config.py cuts
    these from a Config; tests and benches set only what they change)."""

    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK
    prefill_chunk_s: float = DEFAULT_PREFILL_CHUNK_S  # a chunk's time at the slowest stage (0: chunks by count alone)
    max_active: int = MAX_ACTIVE_REQUESTS
    step_timeout_s: float = STEP_TIMEOUT_S
    kv: KvOptions | None = None  # a bounded or quantized KV cache; None: mlx-lm's default cache
    prefix_cache_entries: int = DEFAULT_PREFIX_CACHE_ENTRIES
    max_queued: int = MAX_QUEUED_REQUESTS
    queue_timeout_s: float = QUEUE_TIMEOUT_S
    micro_batches: int = 0  # 0: one in flight per stage of the ring
    max_batch_rows: int = DEFAULT_MAX_ROWS
    interleaved_chunk_tokens: int = DEFAULT_INTERLEAVED_CHUNK
    num_draft: int = DEFAULT_NUM_DRAFT  # proposals a step, with a draft model
    failover_wait_s: float = FAILOVER_WAIT_S

class Engine:
    def __init__(
        self,
        node: str,
        tokenizer,
        send: Callable[[str, Frame], None],
        settings: EngineSettings = EngineSettings(),
        metrics: Metrics | None = None,
        drafter: Drafter | None = None,
    ):
        self.node = node
        self.metrics = metrics if metrics is not None else Metrics(node)
        self.tokenizer = tokenizer
        self.send = send
        self.settings = settings
        self.prefill_chunk_tokens = settings.prefill_chunk_tokens
        self.max_active = settings.max_active
        self.step_timeout_s = settings.step_timeout_s
        self.failover_wait_s = settings.failover_wait_s
        self.plan: Plan | None = None
        self.eos_ids = set(tokenizer.eos_token_ids)
        self._flights: dict[int, _Flight] = {}  # every request until its booking is settled
        # Which rows go around the ring together, and when (scheduler.py); the end of sequence
        # ends a request there, so no row follows it.
        self.scheduler = Scheduler(
            max_in_flight=settings.micro_batches or DEFAULT_MAX_IN_FLIGHT, max_rows=settings.max_batch_rows,
            prefill_chunk=settings.prefill_chunk_tokens, stops=frozenset(self.eos_ids),
            interleaved_chunk=settings.interleaved_chunk_tokens, num_draft=settings.num_draft if drafter is not None else 0,
        )  # fmt: skip
        # Speculative decoding (draft.py): the draft model's proposals, asked for off the loop.
        self.drafter = drafter
        self._drafting: set[asyncio.Task] = set()
        # A sampled request's latest proposals with their distributions, until its verify row goes.
        self._proposals: dict[int, Proposal] = {}
        # Clear between a lost ring and the next (or the news that none can serve): requests
        # that arrive then wait for it (``ring_back``), as the requests it held do.
        self._settled = asyncio.Event()
        self._settled.set()
        # When each micro-batch around the ring was sent (term, time, its prompt chunk's tokens),
        # for ``watch`` and the pacer.
        self._sent_at: dict[int, tuple[int, float, int]] = {}
        # Prompt chunks sized to a time at the ring's slowest stage, so a new request's first
        # token never waits long behind a long prompt's chunks (pacing.py).
        self.pacer = ChunkPacer(settings.prefill_chunk_s, settings.prefill_chunk_tokens) if settings.prefill_chunk_s > 0 else None
        self.micro_batches = settings.micro_batches  # 0: one in flight per stage of the ring
        self.kv = kv = settings.kv
        # Who may enter now: KV room booked on the ring's ledger, or a place in line for it.
        self.admission = Admission(self._make_room, settings.max_queued, settings.queue_timeout_s)
        # A rotating cache that has wrapped cannot be trimmed to a prefix.
        self.prefix = PrefixIndex(0 if kv is not None and kv.max_size is not None else settings.prefix_cache_entries)
        self._prefix_term: int | None = None  # the ring whose stages hold the indexed prefixes
        # The current ring's caches can be trimmed back only while they hold fewer positions
        # than this (None: any; 0: never, prefix reuse is off); why, for the status.
        self.prefix_limit: int | None = None
        self.prefix_note = ""
        # Random start: ids of a restarted leader never meet a stale session.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    @property
    def prefill_chunk(self) -> int:
        """The most prompt tokens a chunk takes now: the pacer's size, or the configured count."""
        return self.pacer.chunk if self.pacer is not None else self.prefill_chunk_tokens

    @property
    def active(self) -> int:
        return sum(not f.finished for f in self._flights.values())

    @property
    def queued(self) -> int:
        return self.admission.queued

    @property
    def ledger(self) -> KvLedger | None:
        return self.admission.ledger

    # --- admission --------------------------------------------------------------------

    async def _admit_on_ring(self, rid: int, need: int, request_id: str | None) -> None:
        """Book ``need`` positions on the ring that serves. A request that arrives while a lost
        ring is being re-planned (or whose booking went with it while it waited for room) waits
        up to ``failover_wait_s`` for the next, as the requests the lost ring held do."""
        while True:
            if self.plan is None and not await self.ring_back(self.failover_wait_s):
                raise EngineError("the ring is not ready", 503)
            await self.admission.admit(rid, need, request_id)
            if self.plan is not None:
                return
            # The ring broke as room was found: the booking is void on the next ring's ledger.
            self.admission.release(rid)
            self.admission.wake()

    def _make_room(self, need: int) -> bool:
        """Evict cached prefixes, oldest first, until ``need`` positions fit; False if they cannot."""
        while not self.ledger.fits(need):
            key = self.prefix.pop_oldest()
            if key is None:
                return False
            self._evict(key, "room")
        return True

    def _evict(self, key: int, why: str) -> None:
        """Drop a cached prefix: ``why`` "room" (a request needed its KV room) or "entries"
        (prefix_cache_entries are kept at most)."""
        self.metrics.eviction(why)
        self.admission.release(key)
        if self.plan is not None and self._prefix_term == self.plan.term:
            try:
                self.send(self.plan.stages[0].node, steps.release(key, self.plan.term, "evict"))
            except Exception as e:  # the ring is breaking; its stores go with it
                log.debug("could not evict cached prefix %x: %s", key, e)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop: list[str] = (),
        resume: list[int] = (),
        request_id: str | None = None,
        emit_resumed: bool = False,
        ignore_eos: bool = False,
        images: PromptImages | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Generate up to ``max_tokens`` after ``prompt``.

        ``resume``: tokens already generated and streamed to the client by an
        earlier leader (a follower carries the stream over): they are replayed
        like a failover replay and not yielded again; the stream goes on after them.
        ``request_id``: the client's name for the request, in every line about it
        on every stage. ``emit_resumed``: yield the ``resume`` tokens first, marked
        ``resumed``, so a consumer that reads the text (tool calls, reasoning) can
        bring its own state to where the stream was. ``ignore_eos``: the end-of-sequence
        tokens do not end it (vLLM's option; a benchmark's fixed length): it runs to
        ``max_tokens`` or a ``stop`` string. ``images``: the prompt's, for the first stage's vision tower.
        """
        flight = await self._enter(prompt, params, max_tokens, resume, request_id, images=images)
        try:
            text = _Text(self.tokenizer.detokenizer, stop, self.eos_ids, max_tokens, ignore_eos)
            finish = None
            for token in resume:  # the client has their text: bring the state to where it was
                piece, finish = text.next(token)
                if emit_resumed:
                    yield TokenEvent(token, piece, 0.0, [], None, 0, resumed=True)
            if finish is not None:
                raise EngineError("the stream carried over had ended already: nothing is left to generate", 400)
            draft = self._speculates(params, len(prompt) + max_tokens)
            self._run(self.scheduler.join(flight.rid, flight.prompt, max_tokens, flight.generated, flight.cached, draft, frozenset() if ignore_eos else None))
            while True:
                event = await self._next(flight, text, bool(resume))
                yield event
                if event.finish_reason is not None:
                    return
        except EngineError as e:
            flight.outcome = f"failed ({e.status}: {e})"
            raise
        finally:
            self._leave(flight)

    async def embed(self, prompt: list[int], pool: str, request_id: str | None = None) -> np.ndarray:
        """The pooled final hidden states of ``prompt`` (float32, not normalized; ``pool``: one of
        ``steps.POOLINGS``), computed as a prompt is: in prefill chunks, its last token alone, so
        several embeddings share the ring's micro-batches with everything else. Its caches are freed
        after (a pooling needs every position computed: it neither starts from a cached prefix nor
        leaves one)."""
        flight = await self._enter(prompt, EMBEDDING_PARAMS, 1, [], request_id, pool)
        try:
            self._run(self.scheduler.join(flight.rid, flight.prompt, 1, stops=frozenset()))
            got = await self._answer(flight)
            if not isinstance(got, steps.Embedded):
                raise self._error(flight, "the ring sampled a token for an embedding: a stage that does not pool (mixed versions?)", 500)
            flight.outcome = "embedded"
            return got.vector
        except EngineError as e:
            flight.outcome = f"failed ({e.status}: {e})"
            raise
        finally:
            self._leave(flight)

    async def _enter(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        resume: list[int],
        request_id: str | None,
        pool: str | None = None,
        images: PromptImages | None = None,
    ) -> _Flight:
        """Admit a request on the ring that serves (waiting for room, or for the next ring) and
        open its flight, from a cached prefix where one shares its start."""
        arrived = time.monotonic()
        if not prompt:
            raise EngineError("the prompt is empty", 400)
        if self.active >= self.max_active:
            raise EngineError(f"{self.max_active} requests are already generating; retry shortly", 429, RETRY_AFTER_S)
        key = list(images.key) if images is not None else prompt
        if pool is None:  # before its booking: from the booking on, nothing awaits until its flight is open
            await self._kept_by_those_leaving(key)
        rid = next(self._ids)
        await self._admit_on_ring(rid, len(prompt) + max_tokens, request_id)
        self.metrics.queue_wait.observe(time.monotonic() - arrived)
        flight = _Flight(
            rid, list(prompt), params, max_tokens, asyncio.Queue(), generated=list(resume), request_id=request_id, arrived=arrived, pool=pool, images=images,
        )  # fmt: skip
        if self._prefix_term == self.plan.term and pool is None:
            flight.reuse = self.prefix.take(key)
            if flight.reuse is not None:
                flight.cached = flight.reuse[1]
                self.admission.release(flight.reuse[0])  # its positions are now part of this request's booking
        self._flights[flight.rid] = flight
        if resume:
            self.metrics.replays.inc()  # carried over from a leader that went away
            # Its ids cost this ring a decode step each, as they did where they were made
            # (usage counts them as the response's completion tokens, which they are).
            self.metrics.resumed_tokens.inc(len(resume))
        log.info(
            "req=%x: %d prompt tokens (%d cached), max_tokens=%d%s", rid, len(prompt), flight.cached, max_tokens,
            f", resuming after {len(resume)} tokens" if resume else "",
            extra=about(
                request_id, self.plan.term, rid=f"{rid:x}", prompt_tokens=len(prompt), cached_tokens=flight.cached,
                max_tokens=max_tokens, resumed=len(resume),
            ),
        )  # fmt: skip
        return flight

    async def _kept_by_those_leaving(self, prompt: list[int]) -> None:
        """Wait (up to LEAVING_WAIT_S) for a request that is leaving and shares ``prompt``'s start to
        be kept as a cached prefix. An agent's next turn arrives the moment the last answer ends, and
        one that ended early (its client stopped reading, or it repeated a call) still has a row on
        the ring, whose return releases it: without the wait the turn would find no prefix."""
        if self.prefix.max_entries <= 0:
            return  # nothing is kept to wait for
        for flight in list(self._flights.values()):
            if (
                flight.finished and not flight.released and not flight.failed and flight.pool is None
                and flight.rid in self.scheduler and common_prefix(flight.key, prompt) >= MIN_REUSE_TOKENS
            ):  # fmt: skip
                try:
                    async with asyncio.timeout(LEAVING_WAIT_S):
                        await flight.settled.wait()
                except TimeoutError:
                    pass  # it computes cold: no worse than without the wait
                return

    async def _answer(self, flight: _Flight) -> steps.Sampled | steps.Embedded:
        """The ring's next answer for ``flight``; an EngineError if the ring says it failed or says
        nothing for ``step_timeout_s``.

        The deadline moves with the request rather than being made anew per token: one timer per
        request (``_overdue``), armed by its first wait, fires at most every ``step_timeout_s`` and
        re-arms for the wait then under way, so a token costs a clock read, not a timer's set-up
        and cancel."""
        queue = flight.queue
        if queue.empty():
            loop = asyncio.get_running_loop()
            flight.waiting_since = loop.time()
            if flight.watchdog is None:
                flight.watchdog = loop.call_at(flight.waiting_since + self.step_timeout_s, self._overdue, flight)
            try:
                got = await queue.get()
            finally:
                flight.waiting_since = None
        else:  # the answer is here already: no wait, no deadline
            got = queue.get_nowait()
        if isinstance(got, EngineError):
            raise got
        return got

    def _overdue(self, flight: _Flight) -> None:
        """``flight``'s timer: fail the wait under way if it began ``step_timeout_s`` ago, else
        wait for that wait's deadline (none under way: the next wait arms it again)."""
        flight.watchdog = None
        since = flight.waiting_since
        if since is None or flight.finished:
            return
        loop = asyncio.get_running_loop()
        if loop.time() < since + self.step_timeout_s:
            flight.watchdog = loop.call_at(since + self.step_timeout_s, self._overdue, flight)
            return
        flight.queue.put_nowait(EngineError(f"the ring did not answer within {self.step_timeout_s:.0f} s (STEP_TIMEOUT_S)", 503))

    async def _next(self, flight: _Flight, text: _Text, resumed: bool) -> TokenEvent:
        """The request's next token from the ring, as text (``_answer``'s errors)."""
        sampled = await self._answer(flight)
        piece, finish = text.next(sampled.token)
        now = time.monotonic()
        if flight.last_token_at is None:
            flight.first_token_s = now - flight.arrived
            if not resumed:  # a carried-over stream's first token here is not its first
                self.metrics.first_token(flight.first_token_s)
        self.metrics.token(now - flight.last_token_at if flight.last_token_at is not None else None)
        flight.last_token_at = now
        flight.produced += 1
        if finish is not None:
            flight.outcome = f"finished ({finish})"
        return TokenEvent(
            sampled.token, piece, sampled.logprob, list(sampled.top), finish, flight.cached, stop_sequence=text.matched, queued=flight.queue.qsize()
        )

    def _leave(self, flight: _Flight) -> None:
        """However the request ended: it leaves the schedule, its booking is settled once no row of
        it is in flight, and one line says how it went."""
        rid = flight.rid
        flight.finished = True
        if flight.watchdog is not None:
            flight.watchdog.cancel()
        self._run(self.scheduler.leave(rid))
        if self.drafter is not None:
            self.drafter.forget(rid)
            self._proposals.pop(rid, None)
        if rid not in self.scheduler:  # else its RELEASE follows its last row, and settles it
            if flight.released:
                self._flights.pop(rid, None)
            else:
                self._settle(flight)  # no release will come: no ring holds its caches
        duration = time.monotonic() - flight.arrived
        self.metrics.request_duration.observe(duration)
        log.info(
            "req=%x: %s after %d tokens in %.2f s", rid, flight.outcome, flight.produced, duration,
            extra=flight.about(
                self.plan.term if self.plan else None, outcome=flight.outcome, completion_tokens=flight.produced,
                duration_s=round(duration, 4), ttft_s=round(flight.first_token_s, 4) if flight.first_token_s is not None else None,
            ),
        )  # fmt: skip

    def _speculates(self, params: SamplingParams, positions: int) -> bool:
        """Whether a request's decode steps verify the draft's proposals: a draft model is loaded,
        the request has nothing that follows its tokens (``SamplingParams.verifiable``; greedy or
        sampled) and asks no logprobs (the ring sends none for proposals it keeps), and every stage
        can cut a rejected proposal from its caches for as long as the request runs."""
        if self.drafter is None or not params.verifiable or params.logprobs:
            return False
        limits = [n for n in (self.prefix_limit, self.kv.max_size if self.kv is not None else None) if n is not None]
        return all(positions < n for n in limits)

    def _draft(self, ask: Draft) -> None:
        """Ask the draft model for proposals; the scheduler hears the answer (none if it fails)."""

        flight = self._flights.get(ask.rid)
        params = flight.params if flight is not None else None

        async def propose() -> None:
            try:
                proposal = await self.drafter.propose(ask.rid, ask.sequence, ask.k, params)
            except Exception:  # the step goes without proposals; the request carries on
                log.exception("req=%x: the draft model failed; this step goes without proposals", ask.rid)
                proposal = Proposal(())
            if proposal.probs is not None:
                self._proposals[ask.rid] = proposal
            self._run(self.scheduler.drafted(ask.rid, len(ask.sequence), proposal.tokens))

        task = asyncio.ensure_future(propose())
        self._drafting.add(task)
        task.add_done_callback(self._drafting.discard)

    # --- the ring ------------------------------------------------------------------------

    def _run(self, commands: list, answers: dict[int, steps.Sampled] | None = None, status: int = 500) -> None:
        """Carry out the scheduler's commands: micro-batches to stage 0, tokens to their
        consumers, failures, releases. ``answers``: the TOKEN frame's rows the Delivers are of;
        ``status``: the HTTP status of the Fails (503: the ring, not the request, is at fault)."""
        for c in commands:
            if isinstance(c, Send):
                self._send_batch(c)
            elif isinstance(c, Deliver):
                self._deliver(c, answers[c.rid])
            elif isinstance(c, Draft):
                self._draft(c)
            elif isinstance(c, Fail):
                flight = self._flights.get(c.rid)
                if flight is not None and not flight.finished:
                    flight.queue.put_nowait(self._error(flight, c.why, status))
                elif flight is not None:
                    flight.failed = True
            elif isinstance(c, Release):
                self._release(c)

    def _send_batch(self, send: Send) -> None:
        """A micro-batch to the ring's first stage; a request's first row there opens it (and a prompt's
        images go there before it)."""
        rows, probs, media = [], [], []
        for row in send.rows:
            flight = self._flights[row.rid]
            if flight.opened != send.term:  # its first row on this ring opens it on every stage
                flight.opened = send.term
                images = len(flight.images.files) if flight.images is not None else 0
                row = replace(row, open=steps.Open(flight.params.to_wire(), self.kv, flight.reuse, flight.request_id, flight.pool, images))
                flight.reuse = None  # a replay on another ring starts cold
                if images:
                    media.append(flight.images.frame(flight.rid, send.term))
            if row.verify and flight.params.temperature > 0:
                # Speculative sampling: the last stage tests each proposal against the draft's q.
                proposal = self._proposals.pop(row.rid, None)
                k = len(row.tokens) - 1
                if proposal is None or proposal.tokens[:k] != row.tokens[1:]:
                    raise AssertionError(f"req={row.rid:x}: a sampled verify row without the draft's distributions for its proposals")
                row = replace(row, probs=True)
                probs.append(steps.pack_draft(proposal.ids[:k], proposal.probs[:k], proposal.tails[:k]))
            rows.append(row)
        self.metrics.micro_batch_rows.observe(len(rows))
        self._sent_at[send.batch] = (send.term, time.monotonic(), 0 if send.rows[0].sample else len(send.rows[0].tokens))
        first, forward = self.plan.stages[0].node, steps.Forward(send.batch, send.term, tuple(rows))
        try:
            # This node's own stage 0 takes the micro-batch as it is; a peer, as the frame's bytes.
            # The payload: the drafts' distributions of sampled verify rows.
            payload = b"".join(probs)
            for frame in media:
                self.send(first, frame)
            self.send(first, forward.handed(payload) if first == self.node else forward.frame(payload=payload))
        except ConnectionError as e:
            # The ring is breaking: the leader re-plans (reconcile.py) and the next ring replays it.
            log.warning("batch=%x: cannot reach the ring's first stage (%s); its rows wait for the next ring", send.batch, e)

    def _deliver(self, deliver: Deliver, sampled: steps.Sampled) -> None:
        flight = self._flights.get(deliver.rid)
        if flight is None or flight.finished:
            return
        expected = len(flight.prompt) + len(flight.generated)
        if deliver.drafted:  # a proposal the ring kept: its position is the next, its logprob unsent
            sampled = steps.Sampled(deliver.rid, expected, deliver.token, 0.0)
        if sampled.offset != expected:
            flight.queue.put_nowait(self._error(flight, f"a token for position {sampled.offset}, expected {expected}", 500))
            self._run(self.scheduler.leave(flight.rid))
            return
        flight.generated.append(deliver.token)
        flight.queue.put_nowait(sampled)

    def _release(self, release: Release) -> None:
        """Free (or keep, as a cached prefix) a request's caches on every stage, and settle its booking."""
        rid, plan = release.rid, self.plan
        flight = self._flights.get(rid)
        keep = (
            flight is not None
            and not flight.failed
            and flight.pool is None
            and self.prefix.max_entries > 0
            and self._prefix_term == plan.term
            and release.sent >= MIN_REUSE_TOKENS
            and (self.prefix_limit is None or release.sent < self.prefix_limit)
        )
        try:
            self.send(plan.stages[0].node, steps.release(rid, plan.term, "keep" if keep else "release"))
        except Exception as e:  # the ring may be gone; stages expire idle sessions
            log.warning("req=%x: could not send RELEASE: %s", rid, e, extra=about(None, plan.term, rid=f"{rid:x}"))
            keep = False
        if keep:
            tokens = flight.key[: release.sent]
            self.admission.book(rid, len(tokens))  # now the entry's, no longer the request's
            for old in self.prefix.add(rid, tokens):
                self._evict(old, "entries")
            flight.released = True
            flight.settled.set()
            if flight.finished:
                del self._flights[rid]
            self.admission.wake()
        elif flight is not None:
            self._settle(flight)

    def _settle(self, flight: _Flight) -> None:
        """The request's booking goes (its caches are freed or gone); it is forgotten once its consumer is done."""
        flight.released = True
        flight.settled.set()
        self.admission.release(flight.rid)
        if flight.finished:
            self._flights.pop(flight.rid, None)
        self.admission.wake()

    def on_frame(self, peer: str, frame: Frame) -> None:
        """A TOKEN or ERROR frame from ``peer`` (event loop): a micro-batch's answer, or its failure."""
        plan = self.plan
        if plan is None or steps.term_of(frame) != plan.term:
            return  # from a ring the requests have left (suspended, or replayed elsewhere)
        # Tokens come from the last stage only; errors from any stage of this ring.
        senders = [plan.stages[-1].node] if frame.type == MsgType.TOKEN else [s.node for s in plan.stages]
        if peer not in senders:
            log.warning(
                "batch=%x: ignoring %s from %s, which is not %s in plan term %d", frame.request_id, frame.type.name, peer,
                "its last stage" if frame.type == MsgType.TOKEN else "a stage", plan.term,
            )  # fmt: skip
            return
        sent = self._sent_at.pop(frame.request_id, None)
        try:
            if frame.type == MsgType.TOKEN:
                if self.pacer is not None and sent is not None and sent[0] == plan.term:
                    trip, was = time.monotonic() - sent[1], self.pacer.chunk
                    self.scheduler.chunk_cap = self.pacer.came_back(trip, sent[2], len(self._sent_at) + 1)
                    if self.pacer.chunk != was:
                        log.debug("prompt chunks of %d tokens now (%.0f us a prompt token at the ring's slowest stage)", self.pacer.chunk, self.pacer.token_s * 1e6)
                answer = steps.Tokens.parse(frame)
                by_rid = {s.rid: s for s in answer.rows}
                sampled = {rid: s.token for rid, s in by_rid.items()}
                accepted = {rid: s.accepted for rid, s in by_rid.items() if s.accepted}
                for e in answer.embedded:  # an embedding's one answer: its schedule ends as a 1-token request's
                    by_rid[e.rid], sampled[e.rid] = e, EMBEDDED_TOKEN
                self._run(self.scheduler.tokens(answer.batch, answer.term, sampled, dict(answer.failed), accepted), by_rid)
            else:
                failure = steps.Failure.parse(frame)
                self._run(self.scheduler.failed(failure.batch, failure.term, f"node {failure.node}: {failure.message}"), status=failure.status)
        except FrameError as e:
            log.warning("batch=%x: malformed %s frame from %s: %s", frame.request_id, frame.type.name, peer, e)
            self._run(self.scheduler.failed(frame.request_id, plan.term, f"malformed {frame.type.name} frame from {peer}: {e}"))

    def _error(self, flight: _Flight, message: str, status: int = 503) -> EngineError:
        """The request fails with ``message``: what its consumer raises when it reads it."""
        flight.failed = True
        return EngineError(message, status)

    def watch(self, now: float | None = None) -> int:
        """Fail the micro-batches the ring has held longer than ``step_timeout_s`` (their requests
        get a 503), so a micro-batch lost on a ring that is still up never holds its slot and its
        requests forever. The coordinator calls this every heartbeat; returns how many failed."""
        now = time.monotonic() if now is None else now
        late = [(batch, term) for batch, (term, sent, _) in self._sent_at.items() if now - sent > self.step_timeout_s]
        for batch, term in late:
            del self._sent_at[batch]
            why = f"micro-batch {batch:x} did not come back from the ring within {self.step_timeout_s:.0f} s (STEP_TIMEOUT_S)"
            log.warning("%s; its requests fail", why)
            self._run(self.scheduler.failed(batch, term, why), status=503)
        return len(late)

    async def ring_back(self, timeout_s: float) -> bool:
        """Whether a ring serves, waiting up to ``timeout_s`` for the next one when the last was
        lost and another is being planned (not when none ever served, or none can)."""
        if self.plan is not None or self._settled.is_set():
            return self.plan is not None
        try:
            async with asyncio.timeout(timeout_s):
                await self._settled.wait()
        except TimeoutError:
            return False
        return self.plan is not None

    def suspend_all(self, reason: str) -> None:
        """The ring broke: hold every request until ``set_plan`` gives a new one."""
        if self.plan is not None:
            self._settled.clear()
        self.plan = None
        self._sent_at.clear()  # what was in flight is void, and replayed on the next ring
        self.scheduler.ring_lost()
        held = 0
        for flight in list(self._flights.values()):
            flight.reuse, flight.opened = None, None  # the next ring starts cold
            if flight.rid in self.scheduler:
                flight.suspended = True
                held += 1
            elif not flight.released:
                self._settle(flight)  # it was leaving: its caches went with the ring
        if held:
            log.warning("%d request(s) suspended: %s", held, reason)

    def set_plan(self, plan: Plan, ledger: KvLedger | None = None, prefix_limit: tuple[int | None, str] = (None, "")) -> None:
        """A ring is ready: serve new requests on it and replay the suspended ones.

        ``ledger`` is the new ring's KV capacity (None: unlimited); the requests
        in flight are booked on it as they are, over capacity if need be.
        ``prefix_limit``: how long a cached prefix its caches can be trimmed back
        from (None: any, 0: none), and why.
        """
        if self.plan is not None and self.plan.term != plan.term:
            self.suspend_all(f"plan term {plan.term} replaces term {self.plan.term}")
        self.plan = plan
        self._settled.set()
        self.prefix_limit, self.prefix_note = prefix_limit
        if self.prefix_note:
            log.info("%s", self.prefix_note)
        if self.drafter is not None and self.prefix_limit is not None:  # what _speculates will refuse, said once
            log.warning(
                "speculative decoding is off on this ring: a stage's linear-attention state cannot drop a rejected proposal"
                if self.prefix_limit == 0
                else f"speculative decoding only for requests of fewer than {self.prefix_limit} positions: a sliding window cannot drop a rejected proposal once it wraps"
            )
        if self._prefix_term != plan.term:
            self.prefix.clear()  # new stages, empty stores
            self._prefix_term = plan.term
            if self.pacer is not None:  # other Macs, other layers: their speed is measured anew
                self.pacer.reset()
                self.scheduler.chunk_cap = None
        self.admission.ledger = ledger
        if ledger is not None:
            for flight in self._flights.values():
                if not flight.released:
                    ledger.book(flight.rid, len(flight.prompt) + flight.max_tokens)
            for key in self.prefix.keys():
                ledger.book(key, len(self.prefix.tokens(key)))
        self.admission.wake()
        for flight in self._flights.values():
            if flight.suspended:
                flight.suspended = False
                self.metrics.replays.inc()
                log.info(
                    "req=%x: replaying %d tokens on ring term %d", flight.rid, len(flight.prompt) + len(flight.generated), plan.term,
                    extra=flight.about(plan.term, replayed_tokens=len(flight.prompt) + len(flight.generated)),
                )  # fmt: skip
        # Micro-batches in flight: one per stage keeps every stage busy.
        self.scheduler.max_in_flight = self.micro_batches or len(plan.stages)
        self._run(self.scheduler.ring_up(plan.term))

    def fail_all(self, reason: str) -> None:
        """No ring can serve: every request in flight ends with a 503."""
        self.suspend_all(reason)
        self._settled.set()
        for flight in list(self._flights.values()):
            flight.suspended = False
            if not flight.finished:
                flight.queue.put_nowait(self._error(flight, reason))
