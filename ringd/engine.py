"""The leader's side of generation: admit a request, drive the ring, stream tokens.

A request enters as token ids. The engine sends its prompt to stage 0 in
prefill chunks (the last prompt token alone, as mlx-lm's ``generate_step``
does, so the ring's arithmetic is the single process's), and then, for each
token the last stage sends back, immediately feeds that token to stage 0
again, before anyone reads it: the ring never waits on HTTP. The consumer of
``generate`` gets the tokens with their text, stop strings already applied.
When the consumer stops listening, for any reason, a RELEASE frees the
request's caches on every stage.

When the ring breaks (a stage died), requests in flight are suspended, not
failed; once the leader has a new ring they are replayed on it: the same
prompt chunks, then every token already produced fed back one at a time and
sampled silently (so a seeded sampler's key advances exactly as before), so
the new ring's caches are bit for bit the old ones and the stream carries on
with the next token, none missing, none repeated. Frames of an older ring
(its term) are ignored. (A request that started from a cached prefix is
replayed from its first token: correct, but its caches are then the cold
run's rather than bit for bit the interrupted ring's.)

Admission: a request's whole context (prompt plus max_tokens) is booked on
every stage's KV capacity (``admission.KvLedger``) before it enters the ring.
Cached prefixes are evicted first to make room; then it waits in a bounded
FIFO queue, and a full queue or a wait past ``queue_timeout_s`` is a 429 with
Retry-After. A context that could never fit is a 400.

Prefix reuse: a request that ends normally leaves its caches on the stages
(``prefix.PrefixIndex``); a later one sharing its prefix starts from them.

The engine knows nothing of HTTP; ``api.py`` turns its events into OpenAI
responses.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from mlx_lm.generate import TextStateMachine

from wire.frames import Frame, FrameError, MsgType

from .admission import AdmissionError, KvLedger
from .logs import about
from .metrics import Metrics
from . import steps
from .steps import KvOptions
from .placement import Plan
from .prefix import MIN_REUSE_TOKENS, PrefixIndex
from .sampling import SamplingParams

log = logging.getLogger(__name__)

# Requests generating at once on this leader. Each holds KV caches on every
# stage; past this a request is refused with 429 rather than queued forever.
MAX_ACTIVE_REQUESTS = 64
# Longest wait for the ring to answer one step. A prefill chunk of a large
# model on a slow Mac takes seconds; two minutes of silence means the ring is
# broken, and the request fails instead of hanging.
STEP_TIMEOUT_S = 120.0
# Prompt tokens per prefill frame. Smaller chunks let stage k+1 start on chunk
# i while stage k computes chunk i+1; larger ones cost fewer frames.
DEFAULT_PREFILL_CHUNK_TOKENS = 512
# Requests waiting for KV room. Past this a client is better off told to come
# back (429) than kept waiting behind a long queue.
MAX_QUEUED_REQUESTS = 32
# Longest a request waits for KV room before a 429; generating a long answer
# takes about this long, so waiting longer rarely pays off.
QUEUE_TIMEOUT_S = 60.0
# Finished requests whose caches the stages keep for prefix reuse.
DEFAULT_PREFIX_CACHE_ENTRIES = 8
# Retry-After for a 429: seconds until KV room is likely.
RETRY_AFTER_S = 2


class EngineError(Exception):
    """A request could not be served; ``status`` is the HTTP status to answer with."""

    status = 500
    retry_after: int | None = None  # seconds, for a 429

    def __init__(self, message: str, status: int | None = None, retry_after: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.retry_after = retry_after


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


@dataclass
class _Flight:
    """One request in the ring, as the leader sees it."""

    rid: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    queue: asyncio.Queue
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    term: int | None = None  # the ring computing it; None while suspended
    reuse: tuple[int, int] | None = None  # (cached prefix, positions kept) for its first ring
    cached: int = 0  # prompt tokens served from a cached prefix
    sent: int = 0  # positions sent to the current ring: what its caches will hold
    failed: bool = False  # a stage reported an error: its caches are not whole
    request_id: str | None = None  # the client's name for it (logs.py)

    def about(self, **fields) -> dict:
        """``extra`` for a log line about this request."""
        return about(self.request_id, self.term, rid=f"{self.rid:x}", **fields)

    @property
    def done(self) -> bool:
        return self.finished or len(self.generated) >= self.max_tokens


class _Text:
    """A request's text, token by token: detokenized, stop strings held back until they cannot match."""

    def __init__(self, detokenizer, stop: list[str], eos_ids: set[int], max_tokens: int):
        self.detokenizer = detokenizer
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
        if token in self.eos_ids:
            finish, text = "stop", ""
        else:
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


class Engine:
    def __init__(
        self,
        node: str,
        tokenizer,
        send: Callable[[str, Frame], None],
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_active: int = MAX_ACTIVE_REQUESTS,
        step_timeout_s: float = STEP_TIMEOUT_S,
        kv: KvOptions | None = None,
        prefix_cache_entries: int = DEFAULT_PREFIX_CACHE_ENTRIES,
        max_queued: int = MAX_QUEUED_REQUESTS,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        metrics: Metrics | None = None,
    ):
        self.node = node
        self.metrics = metrics if metrics is not None else Metrics(node)
        self.tokenizer = tokenizer
        self.send = send
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_active = max_active
        self.step_timeout_s = step_timeout_s
        self.plan: Plan | None = None
        self.eos_ids = set(tokenizer.eos_token_ids)
        self._flights: dict[int, _Flight] = {}
        self.kv = kv
        self.ledger: KvLedger | None = None
        # A rotating cache that has wrapped cannot be trimmed to a prefix.
        self.prefix = PrefixIndex(0 if kv is not None and kv.max_size is not None else prefix_cache_entries)
        self._prefix_term: int | None = None  # the ring whose stages hold the indexed prefixes
        # The current ring's caches can be trimmed back only while they hold fewer positions
        # than this (None: any; 0: never, prefix reuse is off); why, for the status.
        self.prefix_limit: int | None = None
        self.prefix_note = ""
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self._waiting: collections.deque[tuple[int, int, asyncio.Future]] = collections.deque()
        # Random start: ids of a restarted leader never meet a stale session.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    @property
    def active(self) -> int:
        return len(self._flights)

    @property
    def queued(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    # --- admission --------------------------------------------------------------------

    async def _admit(self, rid: int, need: int, request_id: str | None) -> None:
        """Book ``need`` positions on every stage, waiting in line for room if there is none."""
        ledger = self.ledger
        if ledger is None:
            return
        try:
            ledger.check_possible(need)
        except AdmissionError as e:
            raise EngineError(str(e), 400) from None
        if not self._waiting and self._make_room(need):
            ledger.book(rid, need)
            return
        if self.queued >= self.max_queued:
            raise EngineError(
                f"the ring's KV cache is full and {self.max_queued} requests are already waiting; retry shortly",
                429, RETRY_AFTER_S,
            )  # fmt: skip
        fut = asyncio.get_running_loop().create_future()
        entry = (rid, need, fut)
        self._waiting.append(entry)
        log.info("req=%x: waiting for KV room (%d queued)", rid, self.queued, extra=about(request_id, rid=f"{rid:x}", queued=self.queued))
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return  # booked just as the time ran out
            raise EngineError(
                f"no KV room for this request within {self.queue_timeout_s:.0f} s; retry shortly", 429, RETRY_AFTER_S
            ) from None
        except BaseException:
            if fut.done() and not fut.cancelled() and self.ledger is ledger:
                ledger.release(rid)  # booked just as the client left
                self._wake()
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)

    def _make_room(self, need: int) -> bool:
        """Evict cached prefixes, oldest first, until ``need`` positions fit; False if they cannot."""
        ledger = self.ledger
        while not ledger.fits(need):
            key = self.prefix.pop_oldest()
            if key is None:
                return False
            self._evict(key, "room")
        return True

    def _evict(self, key: int, why: str) -> None:
        """Drop a cached prefix: ``why`` "room" (a request needed its KV room) or "entries"
        (prefix_cache_entries are kept at most)."""
        self.metrics.eviction(why)
        if self.ledger is not None:
            self.ledger.release(key)
        if self.plan is not None and self._prefix_term == self.plan.term:
            try:
                self.send(self.plan.stages[0].node, steps.release(key, self.plan.term, "evict"))
            except Exception as e:  # the ring is breaking; its stores go with it
                log.debug("could not evict cached prefix %x: %s", key, e)

    def _wake(self) -> None:
        """Admit waiting requests, in order, while they fit."""
        while self._waiting and self.ledger is not None:
            rid, need, fut = self._waiting[0]
            if fut.done():
                self._waiting.popleft()
                continue
            if not self._make_room(need):
                return
            self.ledger.book(rid, need)
            fut.set_result(None)
            self._waiting.popleft()

    def _first_stage(self) -> str:
        if self.plan is None:
            raise EngineError("the ring is not ready", 503)
        return self.plan.stages[0].node

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_tokens: int,
        stop: list[str] = (),
        resume: list[int] = (),
        request_id: str | None = None,
        emit_resumed: bool = False,
    ) -> AsyncIterator[TokenEvent]:
        """Generate up to ``max_tokens`` after ``prompt``.

        ``resume``: tokens already generated and streamed to the client by an
        earlier leader (a follower carries the stream over): they are replayed
        like a failover replay and not yielded again; the stream goes on after them.
        ``request_id``: the client's name for the request, in every line about it
        on every stage. ``emit_resumed``: yield the ``resume`` tokens first, marked
        ``resumed``, so a consumer that reads the text (tool calls, reasoning) can
        bring its own state to where the stream was.
        """
        arrived = time.monotonic()
        if not prompt:
            raise EngineError("the prompt is empty", 400)
        if len(self._flights) >= self.max_active:
            raise EngineError(f"{self.max_active} requests are already generating; retry shortly", 429, RETRY_AFTER_S)
        self._first_stage()  # 503 now if there is no ring
        rid = next(self._ids)
        await self._admit(rid, len(prompt) + max_tokens, request_id)
        self.metrics.queue_wait.observe(time.monotonic() - arrived)
        if self.plan is None:  # the ring broke while we waited
            if self.ledger is not None:
                self.ledger.release(rid)
            raise EngineError("the ring is not ready", 503)
        flight = _Flight(rid, list(prompt), params, max_tokens, asyncio.Queue(), generated=list(resume), request_id=request_id)
        if self._prefix_term == self.plan.term:
            flight.reuse = self.prefix.take(flight.prompt)
            if flight.reuse is not None:
                flight.cached = flight.reuse[1]
                if self.ledger is not None:  # its positions are now part of this request's booking
                    self.ledger.release(flight.reuse[0])
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
        produced, last, first_after = 0, None, None
        outcome = "ended by its client"  # unless it finishes or fails
        try:
            try:
                self._start(flight)
            except ConnectionError as e:
                self._wait_for_ring(flight, e)
            text = _Text(self.tokenizer.detokenizer, stop, self.eos_ids, flight.max_tokens)
            for token in resume:  # the client has their text: bring the state to where it was
                piece, _ = text.next(token)
                if emit_resumed:
                    yield TokenEvent(token, piece, 0.0, [], None, 0, resumed=True)
            while True:
                try:
                    async with asyncio.timeout(self.step_timeout_s):
                        sampled = await flight.queue.get()
                except TimeoutError:
                    raise EngineError(
                        f"the ring did not answer within {self.step_timeout_s:.0f} s (STEP_TIMEOUT_S)", 503
                    ) from None
                if isinstance(sampled, EngineError):
                    raise sampled
                token = sampled.token
                piece, finish = text.next(token)
                top = list(sampled.top)
                now = time.monotonic()
                if last is None:
                    first_after = now - arrived
                    if not resume:  # a carried-over stream's first token here is not its first
                        self.metrics.first_token(first_after)
                self.metrics.token(now - last if last is not None else None)
                last = now
                produced += 1
                if finish is not None:
                    outcome = f"finished ({finish})"
                yield TokenEvent(token, piece, sampled.logprob, top, finish, flight.cached, stop_sequence=text.matched)
                if finish is not None:
                    return
        except EngineError as e:
            outcome = f"failed ({e.status}: {e})"
            raise
        finally:
            flight.finished = True
            del self._flights[rid]
            self._end(flight)
            duration = time.monotonic() - arrived
            self.metrics.request_duration.observe(duration)
            log.info(
                "req=%x: %s after %d tokens in %.2f s", rid, outcome, produced, duration,
                extra=flight.about(
                    outcome=outcome, completion_tokens=produced, duration_s=round(duration, 4),
                    ttft_s=round(first_after, 4) if first_after is not None else None,
                ),
            )  # fmt: skip

    def _end(self, flight: _Flight) -> None:
        """Free (or keep, as a cached prefix) the request's caches on every stage, and its booking."""
        rid, plan = flight.rid, self.plan
        on_ring = flight.term is not None and plan is not None and flight.term == plan.term
        keep = (
            on_ring
            and not flight.failed
            and self.prefix.max_entries > 0
            and self._prefix_term == plan.term
            and flight.sent >= MIN_REUSE_TOKENS
            and (self.prefix_limit is None or flight.sent < self.prefix_limit)
        )
        if on_ring:
            try:
                self.send(plan.stages[0].node, steps.release(rid, flight.term, "keep" if keep else "release"))
            except Exception as e:  # the ring may be gone; stages expire idle sessions
                log.warning("req=%x: could not send RELEASE: %s", rid, e, extra=flight.about())
                keep = False
        if keep:
            tokens = (flight.prompt + flight.generated)[: flight.sent]
            if self.ledger is not None:
                self.ledger.book(rid, len(tokens))  # now the entry's, no longer the request's
            for old in self.prefix.add(rid, tokens):
                self._evict(old, "entries")
        elif self.ledger is not None:
            self.ledger.release(rid)
        self._wake()

    def _start(self, flight: _Flight) -> None:
        """Send the request to the current ring: its prompt, then (a replay) its tokens so far."""
        plan = self.plan
        first, term = plan.stages[0].node, plan.term
        flight.term = term
        # As generate_step: all but the last prompt token in chunks that only fill
        # the caches, then one token at a time, each sampled.
        fed = flight.prompt + flight.generated
        body = flight.prompt[:-1]
        # The first frame opens the request on every stage: sampling, KV options,
        # and (on its first ring only) the cached prefix it starts from.
        begin = flight.reuse[1] if flight.reuse is not None else 0
        open_ = steps.Open(flight.params.to_wire(), self.kv, flight.reuse, flight.request_id)
        flight.reuse = None  # a replay on another ring starts cold
        flight.sent = begin
        chunk = self.prefill_chunk_tokens
        for start in range(begin, len(body), chunk):
            self._send_step(flight, first, term, start, body[start : start + chunk], False, open_)
            open_ = None
        # A replay: tokens whose samples the client already has are sampled again silently.
        for offset in range(max(len(body), begin), len(fed) - 1):
            self._send_step(flight, first, term, offset, [fed[offset]], True, open_, silent=True)
            open_ = None
        self._send_step(flight, first, term, len(fed) - 1, [fed[-1]], True, open_)

    def _send_step(self, flight, first, term, offset, tokens, sample, open_, silent=False) -> None:
        # One row per micro-batch, named by its request (scheduler.py is to batch them).
        row = steps.Row(flight.rid, offset, tuple(tokens), sample, silent, open_)
        self.send(first, steps.Forward(flight.rid, term, (row,)).frame())
        flight.sent = offset + len(tokens)

    def on_frame(self, peer: str, frame: Frame) -> None:
        """A TOKEN or ERROR frame from ``peer`` (event loop)."""
        flight = self._flights.get(frame.request_id)
        if flight is None or flight.finished:
            return  # released already: a token in flight when the client left
        plan = self.plan
        d = frame.descriptor
        if plan is None or not isinstance(d, dict) or d.get("term") != flight.term or flight.term != plan.term:
            return  # from a ring this request has left (suspended, or replayed elsewhere)
        # Tokens come from the last stage only; errors from any stage of this ring.
        senders = [plan.stages[-1].node] if frame.type == MsgType.TOKEN else [s.node for s in plan.stages]
        if peer not in senders:
            log.warning(
                "req=%x: ignoring %s from %s, which is not %s in plan term %d", frame.request_id, frame.type.name, peer,
                "its last stage" if frame.type == MsgType.TOKEN else "a stage", plan.term, extra=flight.about(peer=peer),
            )  # fmt: skip
            return
        try:
            if frame.type != MsgType.TOKEN:
                failure = steps.Failure.parse(frame)
                flight.queue.put_nowait(self._error(flight, f"node {failure.node}: {failure.message}", failure.status))
                return
            answer = steps.Tokens.parse(frame)
        except FrameError as e:
            flight.queue.put_nowait(self._error(flight, f"malformed {frame.type.name} frame from {peer}: {e}", 500))
            return
        for rid, why in answer.failed:
            if rid == flight.rid:
                flight.queue.put_nowait(self._error(flight, why, 500))
                return
        for sampled in answer.rows:
            if sampled.rid == flight.rid:
                self._take(flight, sampled)

    def _take(self, flight: _Flight, sampled: steps.Sampled) -> None:
        """A token sampled for ``flight``: queue it for its consumer and feed it back at once."""
        expected = len(flight.prompt) + len(flight.generated)
        if sampled.offset != expected:
            flight.queue.put_nowait(self._error(flight, f"a token for position {sampled.offset}, expected {expected}", 500))
            return
        token, offset = sampled.token, sampled.offset
        flight.generated.append(token)
        flight.queue.put_nowait(sampled)
        if token in self.eos_ids or flight.done or self.plan is None:
            return
        # Feed the token back now; the consumer reads it when it can.
        try:
            self._send_step(flight, self.plan.stages[0].node, self.plan.term, offset, [token], True, None)
        except ConnectionError as e:
            self._wait_for_ring(flight, e)

    def _wait_for_ring(self, flight: _Flight, e: Exception) -> None:
        """The first stage cannot be reached: the ring is breaking, and the leader re-plans
        (reconcile.py). Hold the request for the next ring, which replays it, instead of failing it."""
        log.warning("req=%x: cannot reach the ring's first stage (%s); holding it for the next ring", flight.rid, e, extra=flight.about())
        flight.term = None

    def _error(self, flight: _Flight, message: str, status: int = 503) -> EngineError:
        """The request fails with ``message``: what its consumer raises when it reads it."""
        flight.finished = flight.failed = True
        return EngineError(message, status)

    def suspend_all(self, reason: str) -> None:
        """The ring broke: hold every request until ``set_plan`` gives a new one."""
        self.plan = None
        for flight in self._flights.values():
            if not flight.finished:
                flight.term = None
        if self._flights:
            log.warning("%d request(s) suspended: %s", len(self._flights), reason)

    def set_plan(self, plan: Plan, ledger: KvLedger | None = None, prefix_limit: tuple[int | None, str] = (None, "")) -> None:
        """A ring is ready: serve new requests on it and replay the suspended ones.

        ``ledger`` is the new ring's KV capacity (None: unlimited); the requests
        in flight are booked on it as they are, over capacity if need be.
        ``prefix_limit``: how long a cached prefix its caches can be trimmed back
        from (None: any, 0: none), and why.
        """
        self.plan = plan
        self.prefix_limit, self.prefix_note = prefix_limit
        if self.prefix_note:
            log.info("%s", self.prefix_note)
        if self._prefix_term != plan.term:
            self.prefix.clear()  # new stages, empty stores
            self._prefix_term = plan.term
        self.ledger = ledger
        if ledger is not None:
            for flight in self._flights.values():
                ledger.book(flight.rid, len(flight.prompt) + flight.max_tokens)
            for key in self.prefix.keys():
                ledger.book(key, len(self.prefix.tokens(key)))
        self._wake()
        for flight in list(self._flights.values()):
            if flight.finished or flight.term == plan.term:
                continue
            if flight.generated and (flight.generated[-1] in self.eos_ids or flight.done):
                continue  # it has every token it will get; its consumer is finishing
            self.metrics.replays.inc()
            log.info(
                "req=%x: replaying %d tokens on ring term %d", flight.rid, len(flight.prompt) + len(flight.generated), plan.term,
                extra=about(flight.request_id, plan.term, rid=f"{flight.rid:x}", replayed_tokens=len(flight.prompt) + len(flight.generated)),
            )  # fmt: skip
            try:
                self._start(flight)
            except ConnectionError as e:
                self._wait_for_ring(flight, e)

    def fail_all(self, reason: str) -> None:
        """No ring can serve: every request in flight ends with a 503."""
        self.plan = None
        for flight in self._flights.values():
            if not flight.finished:
                flight.queue.put_nowait(self._error(flight, reason))
