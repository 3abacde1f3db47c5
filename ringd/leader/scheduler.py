"""The leader's schedule of the ring: which rows each micro-batch holds, and how many are in flight.

Sans-I/O (as ``reconcile.py``): events in (a request joins, a micro-batch's
tokens come back, a request leaves, the ring is lost, a new ring is up),
commands out (``Send`` a micro-batch to stage 0, ``Deliver`` a token to its
request, ``Release`` a request's caches). Nothing here touches the network,
MLX or the clock, so every interleaving can be tried under Hypothesis against
a simulated ring (tests/leader/test_scheduler.py). ``engine.py`` is its asyncio shell.

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
- The ready requests wait in two queues (a prompt's chunk next, or a decode step),
  heaps ordered by when each last got a row (a prompt that one full chunk finishes before
  longer ones: a new short chat's first token does not wait for a round of long prompts'
  chunks), kept as requests change, so a
  micro-batch costs the same whether 1 request runs or 64 (as vLLM keeps its
  waiting and running queues), not a sort of every request per token.
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
- Speculative decoding (a request that may ``draft``): before its next decode
  step the engine's draft model proposes up to ``num_draft`` tokens (``Draft``,
  answered by ``drafted``); the row feeds the last token and the proposals
  (``verify``), the last stage samples every position and answers how many
  proposals it ``accepted`` and the token after them, so one trip around the
  ring yields up to ``num_draft + 1`` tokens. The stages' caches hold the
  rejected proposals' positions until the request's next row, whose offset says
  where to cut them (runner.py).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ringd.ring.steps import Row  # the one row type: what the scheduler decides is what the ring carries

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
# Proposals per speculative step: mlx-lm's server default. More pay when the draft agrees
# often and a trip around the ring is dear; each one not kept costs its position's compute.
DEFAULT_NUM_DRAFT = 3
# The most a step may propose: a verify row computes this many positions more than a plain one.
MAX_NUM_DRAFT = 16


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
    drafted: bool = False  # a draft's proposal the ring accepted (it sent no logprob for it)


@dataclass(frozen=True)
class Draft:
    """Propose up to ``k`` tokens after ``sequence`` (the request's prompt and tokens so far)
    with the draft model; answer with ``Scheduler.drafted``."""

    rid: int
    sequence: tuple[int, ...]
    k: int


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
    speculative: bool = False  # its decode steps verify a draft's proposals
    draft: tuple[int, ...] | None = None  # proposals for its next decode row
    drafting: bool = False  # a Draft is out for it
    joined: int = 0  # its place among the requests, in the order they joined (Drafts go in it)
    queued_as: tuple[bool, int, int] | None = None  # (prefilling, rank, waited) of its entry in a ready queue

    def draft_size(self, num_draft: int) -> int:
        """Proposals its next row may carry: never past max_tokens, whatever is accepted."""
        return max(0, min(num_draft, self.max_tokens - len(self.generated) - 1)) if self.speculative else 0

    def live_decode(self) -> bool:
        """Its next row feeds back the newest token (not the prompt, not a replay)."""
        return self.queued == len(self.prompt) + len(self.generated) - 1 and bool(self.generated)

    def done(self) -> bool:
        if self.leaving or len(self.generated) >= self.max_tokens:
            return True
        return bool(self.generated) and self.generated[-1] in self.stops

    def waits_for_draft(self, num_draft: int) -> bool:
        return self.draft is None and self.live_decode() and self.draft_size(num_draft) > 0

    def ready(self, num_draft: int) -> bool:
        """Whether its next row's tokens are known (it is not waiting for the token it samples,
        nor for its draft's proposals)."""
        return not self.done() and self.queued < len(self.prompt) + len(self.generated) and not self.waits_for_draft(num_draft)

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
        num_draft: int = 0,
    ):
        if min(max_in_flight, max_rows, prefill_chunk, interleaved_chunk) < 1 or not 0 <= num_draft <= MAX_NUM_DRAFT:
            raise SchedulerError(f"max_in_flight, max_rows, prefill_chunk and interleaved_chunk must be at least 1, num_draft 0 to {MAX_NUM_DRAFT}")
        self.stops = frozenset(stops)
        self.max_in_flight = max_in_flight
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.interleaved_chunk = interleaved_chunk
        # The most tokens a prompt's chunk takes now, whichever of the two above applies: the
        # engine sizes chunks to a time (pacing.py); None: the counts alone.
        self.chunk_cap: int | None = None
        self.num_draft = num_draft  # proposals per verify row (0: no speculative decoding)
        self.term: int | None = None  # None: no ring (lost, or not yet up)
        self._requests: dict[int, _Request] = {}
        self._in_flight: dict[int, tuple[int, bool, tuple[Row, ...]]] = {}  # batch -> (term, a prompt's chunk, rows)
        self._batches = itertools.count(1)
        self._clock = itertools.count(1)
        self._prefill_turn = False  # the next micro-batch is a prompt's chunk, if one is waiting
        # The ready requests, (rank, waited, rid), longest-waiting first within a rank: [decode
        # steps, prompts' chunks] (a prompt's rank: 0 if one full chunk finishes it, else 1).
        # An entry counts while it is its request's ``queued_as`` and the request is ready; others
        # are dropped when they reach the top.
        self._queues: tuple[list, list] = ([], [])
        self._decoding: set[int] = set()  # requests past their prompt's chunks, not done
        self._touched: dict[int, None] = {}  # speculative requests changed since the last _fill looked for Drafts
        self._joins = itertools.count()
        self.proposed = 0  # a draft's proposals verified around the ring, in all
        self.kept = 0  # of them, those the ring kept

    # --- what is there ---------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def __contains__(self, rid: int) -> bool:
        return rid in self._requests

    def generated(self, rid: int) -> list[int]:
        return list(self._requests[rid].generated)

    # --- events ----------------------------------------------------------------------

    def join(
        self, rid: int, prompt: list[int], max_tokens: int, generated: list[int] = (), cached: int = 0, draft: bool = False,
        stops: frozenset[int] | None = None,
    ) -> list:
        """A request enters. ``generated``: tokens an earlier leader delivered already (replayed
        silently, as after a lost ring). ``cached``: positions of its prompt the current ring's
        caches hold already (a cached prefix); its first row starts there. ``draft``: its decode
        steps verify a draft model's proposals (when ``num_draft`` is above 0). ``stops``: the
        tokens that end it, if not the schedule's (none: it runs to ``max_tokens``)."""
        if rid in self._requests:
            raise SchedulerError(f"request {rid:x} is already scheduled")
        if not prompt or max_tokens < 1 or len(generated) > max_tokens:
            raise SchedulerError("a request needs a prompt, max_tokens of at least 1, and no more tokens generated than that")
        if not 0 <= cached < len(prompt):
            raise SchedulerError(f"a cached prefix of {cached} positions must leave the prompt's last token ({len(prompt)}) to compute")
        stops = self.stops if stops is None else frozenset(stops)
        req = _Request(rid, list(prompt), max_tokens, list(generated), waited=next(self._clock), stops=stops, speculative=draft, joined=next(self._joins))
        req.sent = req.queued = cached if self.term is not None else 0
        if req.done():  # every token delivered already: nothing to compute
            return []
        self._requests[rid] = req
        self._touch(req)
        return self._fill()

    def leave(self, rid: int) -> list:
        """The request ends (its client went, or it finished): its caches are freed once no row of it is in flight."""
        req = self._requests.get(rid)
        if req is None:
            return []
        req.leaving = True
        self._touch(req)
        out = self._retire(req)
        return out + self._fill()

    def drafted(self, rid: int, length: int, tokens: tuple[int, ...]) -> list:
        """The draft model's proposals after the first ``length`` tokens of request ``rid``'s
        sequence (none: its next row goes without). Stale answers count for nothing."""
        req = self._requests.get(rid)
        if req is None or not req.drafting:
            return []
        req.drafting = False
        if length == len(req.prompt) + len(req.generated):
            req.draft = tuple(tokens)[: req.draft_size(self.num_draft)]
        self._touch(req)
        return self._fill()

    def tokens(
        self, batch: int, term: int, sampled: dict[int, int], failed: dict[int, str] | None = None, accepted: dict[int, int] | None = None
    ) -> list:
        """Micro-batch ``batch`` of ring ``term`` came back, with a token for each row that sampled
        aloud, or the reason its row failed on the way (``failed``); a row with neither fails.
        ``accepted``: for a verify row, how many of its proposals the ring kept (the token
        sampled follows them)."""
        held = self._in_flight.get(batch)
        if held is None or held[0] != term or term != self.term:
            return []  # a void micro-batch (an older ring's): nothing in it counts
        del self._in_flight[batch]
        failed, accepted = failed or {}, accepted or {}
        out = []
        for row in held[2]:
            req = self._requests.get(row.rid)
            if req is None or batch not in req.in_flight:
                continue
            req.in_flight.remove(batch)
            req.sent = row.offset + len(row.tokens)
            req.waited = next(self._clock)
            kept = accepted.get(row.rid, 0)
            if row.rid not in failed and (not 0 <= kept <= len(row.tokens) - 1 or kept and not row.verify):
                failed[row.rid] = f"the ring accepted {kept} proposals of a row with {len(row.tokens) - 1 if row.verify else 0}"
            if row.rid in failed or row.sample and not row.silent and not req.leaving and row.rid not in sampled:
                if not req.leaving:
                    out.append(Fail(row.rid, failed.get(row.rid) or f"micro-batch {batch} came back without its token"))
                req.leaving = True
            elif row.sample and not row.silent and not req.leaving:
                if row.verify:  # the caches keep the row's first token and the proposals accepted
                    req.sent = req.queued = row.offset + 1 + kept
                    self.proposed += len(row.tokens) - 1
                    self.kept += kept
                for i, token in enumerate(row.tokens[1 : 1 + kept] + (sampled[row.rid],)):
                    if req.done():  # a stop among the proposals ends it there
                        break
                    req.generated.append(token)
                    out.append(Deliver(row.rid, token, drafted=i < kept))
            self._touch(req)
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
            req.draft = None
            if req.leaving:  # its caches went with the ring
                self._forget(req)
            else:
                self._touch(req)

    def ring_up(self, term: int) -> list:
        """A new ring (``term``) serves: every request is replayed on it from its first token."""
        if self.term is not None and self._in_flight:
            self.ring_lost()
        self.term = term
        for req in self._requests.values():
            req.sent = req.queued = 0
            self._touch(req)
        return self._fill()

    # --- the schedule ----------------------------------------------------------------

    def _retire(self, req: _Request) -> list:
        if req.in_flight or not req.done():
            return []
        self._forget(req)
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
        if req.draft and req.live_decode():
            return Row(req.rid, at, (token, *req.draft), sample=True, verify=True)
        return Row(req.rid, at, (token,), sample=True, silent=k + 1 < len(req.generated))

    def _forget(self, req: _Request) -> None:
        """The request leaves the schedule (its entries in the ready queues are dropped when met)."""
        del self._requests[req.rid]
        self._decoding.discard(req.rid)
        self._touched.pop(req.rid, None)

    def _touch(self, req: _Request) -> None:
        """After any change to ``req``: its place in the ready queues and among the decoding."""
        done, prefilling = req.done(), req.prefilling
        if done or prefilling:
            self._decoding.discard(req.rid)
        else:
            self._decoding.add(req.rid)
        if req.speculative:
            self._touched[req.rid] = None
        rank = self.rank(req)
        if done or req.queued_as == (prefilling, rank, req.waited):
            return  # not ready, or queued already as it is
        if req.queued < len(req.prompt) + len(req.generated) and not (req.speculative and req.waits_for_draft(self.num_draft)):  # ready()
            req.queued_as = (prefilling, rank, req.waited)
            heapq.heappush(self._queues[prefilling], (rank, req.waited, req.rid))

    def rank(self, req: _Request) -> int:
        """Which requests go first: a prompt that one full chunk finishes (0) before longer ones (1)
        (each waits for its first token, and theirs take many chunks anyway), so a new short chat
        does not wait for a round of long prompts' chunks. By what its caches held when it last
        got a row back, which changes only with ``waited``."""
        return int(req.prefilling and len(req.prompt) - 1 - req.sent > self.prefill_chunk)

    def _head(self, prefill: bool) -> _Request | None:
        """The ready request that waited longest for a prompt's chunk (or a decode step), left queued."""
        queue = self._queues[prefill]
        while queue:
            rank, waited, rid = queue[0]
            req = self._requests.get(rid)
            current = req is not None and req.queued_as == (prefill, rank, waited)
            if current and req.ready(self.num_draft):
                return req
            heapq.heappop(queue)  # stale: its request moved on, left, or waits (it is queued again when ready)
            if current:
                req.queued_as = None
        return None

    def _fill(self) -> list:
        """Drafts asked for, and micro-batches for every free slot in flight."""
        out = []
        if self.term is not None:
            # Only a speculative request that changed can newly wait for a draft; asked in the order they joined.
            for req in sorted((self._requests[rid] for rid in self._touched), key=lambda r: r.joined):
                if not req.drafting and not req.in_flight and not req.done() and req.waits_for_draft(self.num_draft):
                    req.drafting = True
                    out.append(Draft(req.rid, tuple(req.prompt + req.generated), req.draft_size(self.num_draft)))
            self._touched.clear()
        while self.term is not None and len(self._in_flight) < self.max_in_flight:
            rows = self._take()
            if not rows:
                break
            batch = next(self._batches)
            for row in rows:
                req = self._requests[row.rid]
                req.in_flight.append(batch)
                req.queued = row.offset + len(row.tokens)
                if row.verify:
                    req.draft = None
                if not row.sample or row.silent:  # else it waits for its token: not ready, nothing else changed
                    self._touch(req)
            self._in_flight[batch] = (self.term, not rows[0].sample, rows)
            out.append(Send(batch, self.term, rows))
        return out

    def _take(self) -> tuple[Row, ...]:
        decoding = len(self._decoding)
        # Prompts' chunks keep a slot free for decoding while anything decodes (if there are
        # two slots or more), so running streams wait for one chunk at a time at most.
        chunks = sum(1 for _, is_prefill, _ in self._in_flight.values() if is_prefill)
        prefill = self._head(True) if chunks < max(1, self.max_in_flight - (1 if decoding else 0)) else None
        # Prompts' chunks and decode steps take turns; either goes alone if the other has nothing.
        if prefill is not None and (self._prefill_turn or self._head(False) is None):
            self._prefill_turn = False
            chunk = min(self.prefill_chunk, self.interleaved_chunk) if decoding else self.prefill_chunk
            if self.chunk_cap is not None:
                chunk = max(1, min(chunk, self.chunk_cap))
            return (self._next_row(prefill, chunk),)
        self._prefill_turn = True
        # An even share of the decoding requests per slot: every stage gets a micro-batch.
        share = -(-decoding // self.max_in_flight)
        rows = []
        while len(rows) < max(1, min(self.max_rows, share)) and (req := self._head(False)) is not None:
            heapq.heappop(self._queues[False])  # taken: queued again (by _fill's _touch) if still ready
            req.queued_as = None
            rows.append(self._next_row(req))
        return tuple(rows)
