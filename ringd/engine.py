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
(its term) are ignored.

The engine knows nothing of HTTP; ``api.py`` turns its events into OpenAI
responses.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from mlx_lm.generate import TextStateMachine

from wire.frames import Frame, MsgType

from .placement import Plan
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


class EngineError(Exception):
    """A request could not be served; ``status`` is the HTTP status to answer with."""

    status = 500

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


@dataclass
class TokenEvent:
    token: int
    text: str  # text to emit now (stop strings are held back until they can't match)
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: str | None = None  # "stop" or "length" on the last event


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

    @property
    def done(self) -> bool:
        return self.finished or len(self.generated) >= self.max_tokens


class Engine:
    def __init__(
        self,
        node: str,
        tokenizer,
        send: Callable[[str, Frame], None],
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        max_active: int = MAX_ACTIVE_REQUESTS,
        step_timeout_s: float = STEP_TIMEOUT_S,
    ):
        self.node = node
        self.tokenizer = tokenizer
        self.send = send
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_active = max_active
        self.step_timeout_s = step_timeout_s
        self.plan: Plan | None = None
        self.eos_ids = set(tokenizer.eos_token_ids)
        self._flights: dict[int, _Flight] = {}
        # Random start: ids of a restarted leader never meet a stale session.
        self._ids = itertools.count(secrets.randbits(62) + 1)

    @property
    def active(self) -> int:
        return len(self._flights)

    def _first_stage(self) -> str:
        if self.plan is None:
            raise EngineError("the ring is not ready", 503)
        return self.plan.stages[0].node

    async def generate(
        self, prompt: list[int], params: SamplingParams, max_tokens: int, stop: list[str] = ()
    ) -> AsyncIterator[TokenEvent]:
        if not prompt:
            raise EngineError("the prompt is empty", 400)
        if len(self._flights) >= self.max_active:
            raise EngineError(f"{self.max_active} requests are already generating; retry shortly", 429)
        self._first_stage()  # 503 now if there is no ring
        flight = _Flight(next(self._ids), list(prompt), params, max_tokens, asyncio.Queue())
        self._flights[flight.rid] = flight
        rid = flight.rid
        log.info("req=%x: %d prompt tokens, max_tokens=%d", rid, len(prompt), max_tokens)
        try:
            try:
                self._start(flight)
            except ConnectionError as e:
                raise EngineError(f"cannot reach the ring's first stage: {e}", 503) from None
            detokenizer = self.tokenizer.detokenizer
            stops = TextStateMachine({"normal": [(s, None) for s in stop]}) if stop else None
            stop_state = stops.make_state() if stops else None
            produced = 0
            while True:
                try:
                    frame = await asyncio.wait_for(flight.queue.get(), self.step_timeout_s)
                except asyncio.TimeoutError:
                    raise EngineError(
                        f"the ring did not answer within {self.step_timeout_s:.0f} s (STEP_TIMEOUT_S)", 503
                    ) from None
                if frame.type == MsgType.ERROR:
                    d = frame.descriptor
                    status = 503 if d.get("status") == 503 else 500
                    raise EngineError(f"node {d.get('node', '?')}: {d.get('message', '?')}", status)
                d = frame.descriptor
                token = d["token"]
                produced += 1
                finish = None
                if token in self.eos_ids:
                    finish, text = "stop", ""
                else:
                    detokenizer.add_token(token)
                    text = detokenizer.last_segment
                    if produced >= flight.max_tokens:
                        finish = "length"
                if finish is not None:
                    detokenizer.finalize()
                    text += detokenizer.last_segment
                if stops is not None:
                    stop_state, text, state_name = TextStateMachine.step(stop_state, text)
                    if state_name is None:
                        finish = "stop"
                    elif finish is not None:
                        stop_state, rest, _ = TextStateMachine.flush(stop_state)
                        text += rest
                yield TokenEvent(token, text, d["logprob"], [tuple(p) for p in d.get("top", [])], finish)
                if finish is not None:
                    return
        finally:
            flight.finished = True
            del self._flights[rid]
            if flight.term is not None and self.plan is not None and flight.term == self.plan.term:
                try:
                    self.send(self.plan.stages[0].node, Frame(MsgType.RELEASE, rid, {"term": flight.term}))
                except Exception as e:  # the ring may be gone; stages expire idle sessions
                    log.warning("req=%x: could not send RELEASE: %s", rid, e)

    def _start(self, flight: _Flight) -> None:
        """Send the request to the current ring: its prompt, then (a replay) its tokens so far."""
        plan = self.plan
        first, term, rid = plan.stages[0].node, plan.term, flight.rid
        flight.term = term
        # As generate_step: all but the last prompt token in chunks that only fill
        # the caches, then one token at a time, each sampled.
        fed = flight.prompt + flight.generated
        body = flight.prompt[:-1]
        open_ = flight.params.to_wire()
        chunk = self.prefill_chunk_tokens
        for start in range(0, len(body), chunk):
            self._send_step(first, term, rid, start, body[start : start + chunk], False, open_)
            open_ = None
        # A replay: tokens whose samples the client already has are sampled again silently.
        for offset in range(len(body), len(fed) - 1):
            self._send_step(first, term, rid, offset, [fed[offset]], True, open_, silent=True)
            open_ = None
        self._send_step(first, term, rid, len(fed) - 1, [fed[-1]], True, open_)

    def _send_step(self, first, term, rid, offset, tokens, sample, open_, silent=False) -> None:
        d = {"term": term, "offset": offset, "tokens": tokens, "sample": sample}
        if open_ is not None:
            d["open"] = open_
        if silent:
            d["silent"] = True
        self.send(first, Frame(MsgType.FORWARD, rid, d))

    def on_frame(self, frame: Frame) -> None:
        """A TOKEN or ERROR frame from the ring (event loop)."""
        flight = self._flights.get(frame.request_id)
        if flight is None or flight.finished:
            return  # released already: a token in flight when the client left
        d = frame.descriptor
        if d.get("term") != flight.term:
            return  # from a ring this request has left (suspended, or replayed elsewhere)
        if frame.type != MsgType.TOKEN:
            flight.finished = True
            flight.queue.put_nowait(frame)
            return
        token, offset = d.get("token"), d.get("offset")
        expected = len(flight.prompt) + len(flight.generated)
        if type(token) is not int or offset != expected or not isinstance(d.get("logprob"), (int, float)):
            flight.queue.put_nowait(self._error(flight, f"malformed TOKEN frame (offset {offset!r}, expected {expected})", 500))
            return
        flight.generated.append(token)
        flight.queue.put_nowait(frame)
        if token in self.eos_ids or flight.done or self.plan is None:
            return
        # Feed the token back now; the consumer reads it when it can.
        try:
            self._send_step(self.plan.stages[0].node, self.plan.term, flight.rid, offset, [token], True, None)
        except ConnectionError as e:
            flight.queue.put_nowait(self._error(flight, f"cannot reach the ring's first stage: {e}"))

    def _error(self, flight: _Flight, message: str, status: int = 503) -> Frame:
        flight.finished = True
        return Frame(MsgType.ERROR, flight.rid, {"node": self.node, "message": message, "status": status, "term": flight.term})

    def suspend_all(self, reason: str) -> None:
        """The ring broke: hold every request until ``set_plan`` gives a new one."""
        self.plan = None
        for flight in self._flights.values():
            if not flight.finished:
                flight.term = None
        if self._flights:
            log.warning("%d request(s) suspended: %s", len(self._flights), reason)

    def set_plan(self, plan: Plan) -> None:
        """A ring is ready: serve new requests on it and replay the suspended ones."""
        self.plan = plan
        for flight in list(self._flights.values()):
            if flight.finished or flight.term == plan.term:
                continue
            if flight.generated and (flight.generated[-1] in self.eos_ids or flight.done):
                continue  # it has every token it will get; its consumer is finishing
            log.info("req=%x: replaying %d tokens on ring term %d", flight.rid, len(flight.prompt) + len(flight.generated), plan.term)
            try:
                self._start(flight)
            except ConnectionError as e:
                flight.queue.put_nowait(self._error(flight, f"cannot reach the ring's first stage: {e}"))

    def fail_all(self, reason: str) -> None:
        """No ring can serve: every request in flight ends with a 503."""
        self.plan = None
        for flight in self._flights.values():
            if not flight.finished:
                flight.queue.put_nowait(self._error(flight, reason))
