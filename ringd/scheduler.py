"""The leader's schedule of the ring: which rows each micro-batch holds, and how many are in flight.

Sans-I/O (as ``reconcile.py``): events in (a request joins, a micro-batch's
tokens come back, a request leaves, the ring is lost, a new ring is up),
commands out (``Send`` a micro-batch to stage 0, ``Deliver`` a token to its
request, ``Release`` a request's caches). Nothing here touches the network,
MLX or the clock, so every interleaving can be tried under Hypothesis against
a simulated ring (tests/test_scheduler.py). ``engine.py`` is its asyncio shell.

The ring is a pipeline: with P stages, one micro-batch at a time leaves P-1
stages idle. So up to ``max_in_flight`` micro-batches go around at once, each
with its own rows: while stage k computes one, stage k-1 computes the next.
A request's next step needs its last token, so a request waits for the token
it samples before its next row goes; rows whose tokens are known already (a
prompt's chunks, a replay's tokens) go without waiting, several micro-batches
of one request in flight at once, so a long prompt's chunks are computed by
every stage at once, as a pipeline. A request's rows follow each other in
order, and every stage applies them in the order the leader sent them (frames
of one sender on one link keep their order, and every micro-batch takes the
same path), which is what keeps each stage's caches right.

- A row is one request's step: a prompt chunk (``sample`` false), the prompt's
  last token (sampled, as mlx-lm's ``generate_step``), or a token fed back.
- Decode rows of ready requests fill a micro-batch, longest-waiting first, up
  to ``max_rows`` and to an even share of the decoding requests per slot in
  flight (so 8 streams on 3 stages go round as micro-batches of 3, 3 and 2, each
  stage busy, rather than one of 8 with two stages idle). A micro-batch that
  comes back goes out again with the same rows in the same order, which keeps
  the stages' batched caches as they are (sessions.py). A prompt's chunks travel in micro-batches of their own, taking
  turns with the decode micro-batches, so running streams keep flowing while a
  long prompt prefills.
- A request that leaves (its client went, or it finished) while a micro-batch
  of it is in flight is released when that micro-batch comes back: a RELEASE
  must follow the request's last FORWARD around the ring.
- Ring lost: micro-batches in flight are void (their tokens never delivered);
  on the new ring every live request is replayed: its prompt, then each token
  already delivered fed back and sampled silently (a seeded sampler's key
  advances exactly as before), so the stream carries on with the next token,
  none missing, none repeated.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# Micro-batches around the ring at once: one per stage keeps every stage busy.
DEFAULT_MAX_IN_FLIGHT = 3
# Rows in one decode micro-batch: each is a request's KV cache read per layer.
DEFAULT_MAX_ROWS = 32
# Prompt tokens in one prefill row when nothing else decodes (as mlx-lm's prefill_step_size:
# big enough that a stage's matmuls run at full speed).
DEFAULT_PREFILL_CHUNK = 512
# Prompt tokens in one prefill row while other requests decode: a running stream's token
# waits behind up to max_in_flight - 1 such chunks at each stage, so its pause is about
# that chunk's compute around the ring; a quarter of the full chunk keeps it near a tenth
# of a long prompt's prefill (docs/benchmarks.md) at a small cost in prefill speed.
DEFAULT_INTERLEAVED_CHUNK = 128


@dataclass(frozen=True)
class Row:
    rid: int
    offset: int  # the position of tokens[0]: what the stage's caches must already hold
    tokens: tuple[int, ...]
    sample: bool  # the last stage samples after this row
    silent: bool = False  # a replayed step: sample (the key advances), deliver nothing


@dataclass(frozen=True)
class Send:
    """Send micro-batch ``batch`` of ``rows`` to stage 0 of ring ``term``."""

    batch: int
    term: int
    rows: tuple[Row, ...]


@dataclass(frozen=True)
class Deliver:
    rid: int
    token: int


@dataclass(frozen=True)
class Release:
    """Free the request's caches on every stage (it has no row in flight); they hold its first
    ``sent`` positions (prompt, then tokens), which a cached prefix may keep."""

    rid: int
    sent: int


@dataclass(frozen=True)
class Fail:
    """The request failed on the ring (``why``): it has left, its caches are released."""

    rid: int
    why: str


class SchedulerError(Exception):
    pass


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    max_tokens: int
    generated: list[int] = field(default_factory=list)  # tokens delivered
    sent: int = 0  # positions the current ring's caches hold: its rows that came back
    queued: int = 0  # positions handed to the current ring: its rows in flight too
    in_flight: list[int] = field(default_factory=list)  # the micro-batches holding its rows, in order
    leaving: bool = False
    waited: int = 0  # when it last got a row (the schedule's clock), for fairness
    stops: frozenset[int] = frozenset()  # tokens that end it (end of sequence)

    def done(self) -> bool:
        if self.leaving or len(self.generated) >= self.max_tokens:
            return True
        return bool(self.generated) and self.generated[-1] in self.stops

    @property
    def ready(self) -> bool:
        """Whether its next row's token is known (it is not waiting for the token it samples)."""
        return not self.done() and self.queued < len(self.prompt) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        """Its next row is a chunk of its prompt (all but the last token)."""
        return self.queued < len(self.prompt) - 1


class Scheduler:
    def __init__(
        self,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_rows: int = DEFAULT_MAX_ROWS,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        stops: frozenset[int] = frozenset(),
        interleaved_chunk: int = DEFAULT_INTERLEAVED_CHUNK,
    ):
        if min(max_in_flight, max_rows, prefill_chunk, interleaved_chunk) < 1:
            raise SchedulerError("max_in_flight, max_rows, prefill_chunk and interleaved_chunk must be at least 1")
        self.stops = frozenset(stops)
        self.max_in_flight = max_in_flight
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.interleaved_chunk = interleaved_chunk
        self.term: int | None = None  # None: no ring (lost, or not yet up)
        self._requests: dict[int, _Request] = {}
        self._in_flight: dict[int, tuple[int, bool, tuple[Row, ...]]] = {}  # batch -> (term, a prompt's chunk, rows)
        self._batches = itertools.count(1)
        self._clock = itertools.count(1)
        self._prefill_turn = False  # the next micro-batch is a prompt's chunk, if one is waiting

    # --- what is there ---------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def __contains__(self, rid: int) -> bool:
        return rid in self._requests

    def generated(self, rid: int) -> list[int]:
        return list(self._requests[rid].generated)

    # --- events ----------------------------------------------------------------------

    def join(self, rid: int, prompt: list[int], max_tokens: int, generated: list[int] = (), cached: int = 0) -> list:
        """A request enters. ``generated``: tokens an earlier leader delivered already (replayed
        silently, as after a lost ring). ``cached``: positions of its prompt the current ring's
        caches hold already (a cached prefix); its first row starts there."""
        if rid in self._requests:
            raise SchedulerError(f"request {rid:x} is already scheduled")
        if not prompt or max_tokens < 1 or len(generated) > max_tokens:
            raise SchedulerError("a request needs a prompt, max_tokens of at least 1, and no more tokens generated than that")
        if not 0 <= cached < len(prompt):
            raise SchedulerError(f"a cached prefix of {cached} positions must leave the prompt's last token ({len(prompt)}) to compute")
        req = _Request(rid, list(prompt), max_tokens, list(generated), waited=next(self._clock), stops=self.stops)
        req.sent = req.queued = cached if self.term is not None else 0
        self._requests[rid] = req
        if req.done():  # every token delivered already: nothing to compute
            del self._requests[rid]
            return []
        return self._fill()

    def leave(self, rid: int) -> list:
        """The request ends (its client went, or it finished): its caches are freed once no row of it is in flight."""
        req = self._requests.get(rid)
        if req is None:
            return []
        req.leaving = True
        out = self._retire(req)
        return out + self._fill()

    def tokens(self, batch: int, term: int, sampled: dict[int, int], failed: dict[int, str] | None = None) -> list:
        """Micro-batch ``batch`` of ring ``term`` came back, with a token for each row that sampled
        aloud, or the reason its row failed on the way (``failed``); a row with neither fails."""
        held = self._in_flight.get(batch)
        if held is None or held[0] != term or term != self.term:
            return []  # a void micro-batch (an older ring's): nothing in it counts
        del self._in_flight[batch]
        failed = failed or {}
        out = []
        for row in held[2]:
            req = self._requests.get(row.rid)
            if req is None or batch not in req.in_flight:
                continue
            req.in_flight.remove(batch)
            req.sent = row.offset + len(row.tokens)
            req.waited = next(self._clock)
            if row.rid in failed or row.sample and not row.silent and not req.leaving and row.rid not in sampled:
                if not req.leaving:
                    out.append(Fail(row.rid, failed.get(row.rid) or f"micro-batch {batch} came back without its token"))
                req.leaving = True
            elif row.sample and not row.silent and not req.leaving:
                req.generated.append(sampled[row.rid])
                out.append(Deliver(row.rid, sampled[row.rid]))
            out += self._retire(req)
        return out + self._fill()

    def failed(self, batch: int, term: int | None, why: str) -> list:
        """Micro-batch ``batch`` failed as a whole on ring ``term``: every request in it fails."""
        held = self._in_flight.get(batch)
        if held is None or held[0] != term or term != self.term:
            return []
        return self.tokens(batch, term, {}, {row.rid: why for row in held[2]})

    def ring_lost(self) -> None:
        """The ring broke: what is in flight is void; every request waits for the next ring."""
        self.term = None
        self._in_flight.clear()
        for req in list(self._requests.values()):
            req.in_flight = []
            req.sent = req.queued = 0
            if req.leaving:  # its caches went with the ring
                del self._requests[req.rid]

    def ring_up(self, term: int) -> list:
        """A new ring (``term``) serves: every request is replayed on it from its first token."""
        if self.term is not None and self._in_flight:
            self.ring_lost()
        self.term = term
        for req in self._requests.values():
            req.sent = req.queued = 0
        return self._fill()

    # --- the schedule ----------------------------------------------------------------

    def _retire(self, req: _Request) -> list:
        if req.in_flight or not req.done():
            return []
        del self._requests[req.rid]
        return [Release(req.rid, req.sent)] if self.term is not None and req.sent > 0 else []

    def _next_row(self, req: _Request, chunk: int = 0) -> Row:
        """The request's next step on the current ring (a prompt's chunk of at most ``chunk`` tokens)."""
        prompt, at = req.prompt, req.queued
        if at < len(prompt) - 1:  # a chunk of the prompt before its last token
            end = min(at + chunk, len(prompt) - 1)
            return Row(req.rid, at, tuple(prompt[at:end]), sample=False)
        # The prompt's last token samples the first token; each token fed back, the next.
        # On a replay the tokens sampled were delivered already: sampled again silently.
        k = at - len(prompt)  # the token fed back, -1 for the prompt's last
        token = prompt[-1] if k < 0 else req.generated[k]
        return Row(req.rid, at, (token,), sample=True, silent=k + 1 < len(req.generated))

    def _ready(self) -> list[_Request]:
        return sorted((r for r in self._requests.values() if r.ready), key=lambda r: r.waited)

    def _fill(self) -> list:
        """Micro-batches for every free slot in flight."""
        out = []
        while self.term is not None and len(self._in_flight) < self.max_in_flight:
            rows = self._take()
            if not rows:
                break
            batch = next(self._batches)
            for row in rows:
                req = self._requests[row.rid]
                req.in_flight.append(batch)
                req.queued = row.offset + len(row.tokens)
            self._in_flight[batch] = (self.term, not rows[0].sample, rows)
            out.append(Send(batch, self.term, rows))
        return out

    def _take(self) -> tuple[Row, ...]:
        ready = self._ready()
        prefill = [r for r in ready if r.prefilling]
        decode = [r for r in ready if not r.prefilling]
        decoding = sum(1 for r in self._requests.values() if not r.done() and not r.prefilling)
        # Prompts' chunks keep a slot free for decoding while anything decodes (if there are
        # two slots or more), so running streams wait for one chunk at a time at most.
        chunks = sum(1 for _, is_prefill, _ in self._in_flight.values() if is_prefill)
        if chunks >= max(1, self.max_in_flight - (1 if decoding else 0)):
            prefill = []
        # Prompts' chunks and decode steps take turns; either goes alone if the other has nothing.
        if prefill and (self._prefill_turn or not decode):
            self._prefill_turn = False
            chunk = min(self.prefill_chunk, self.interleaved_chunk) if decoding else self.prefill_chunk
            return (self._next_row(prefill[0], chunk),)
        self._prefill_turn = True
        # An even share of the decoding requests per slot: every stage gets a micro-batch.
        share = -(-decoding // self.max_in_flight)
        return tuple(self._next_row(r) for r in decode[: max(1, min(self.max_rows, share))])
