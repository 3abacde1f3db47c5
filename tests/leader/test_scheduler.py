"""The leader's schedule (``scheduler.py``) against a simulated ring, under Hypothesis.

The simulated ring has P stages, each a FIFO of what reached it (micro-batches
and releases) and a cache per request (the tokens it holds). A stage applies
its oldest item: each row must start where that request's cache ends, and no
row may come for a released request; the last stage "samples" a token that is
a hash of the request's whole sequence, so a wrong token fed back anywhere
changes every later one. Hypothesis interleaves requests joining and leaving,
stages advancing in any order (a stalled stage just does not advance), and the
ring being lost and replaced; then the ring drains.

What must hold: never more than P micro-batches in flight, and a request's rows
in flight no further than its last sampled token (a prompt's chunks and a replay's
known tokens may be in several micro-batches at once); each request's tokens arrive once and in order, equal to the
uninterrupted run's (so a replay after a lost ring yields the same tokens);
every request that did not leave gets all its tokens, even beside a stream
that never ends (none starves); every request's caches are released.

Speculative requests ask the simulated draft model for proposals (``Draft``),
answered at any later point, right (the model's own continuation) or wrong; the
last stage keeps the proposals that agree with what it samples and cuts the
rest from its cache, the other stages cut them when the request's next row
says where; a cut is allowed only into positions a verify row left provisional.

The scheduler keeps its ready requests in queues (heaps kept as requests
change); ``Oracle`` is the order it replaced (every request sorted per
micro-batch), and ``Twin`` runs both on every event of the same workloads:
their commands must be equal, so the queues decide exactly as the sort did.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ringd.leader.scheduler import Deliver, Draft, Fail, Release, Scheduler, SchedulerError, Send, _Request
from ringd.ring.steps import Row

VOCAB = 1000
HOG = 10**6  # the request id of a stream that never ends
# Stage applications after the events: far more than the longest fair schedule of what can be joined.
DRAIN_STEPS = 20_000


def model(rid: int, seq: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr((rid, seq)).encode(), digest_size=4).digest(), "little") % VOCAB


def reference(rid: int, prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(model(rid, seq))
        seq.append(out[-1])
    return out


class Oracle(Scheduler):
    """The schedule's order as it was decided before the ready queues: every request looked at,
    and the ready ones sorted by rank, then by when they last got a row, for each micro-batch."""

    def _ready(self) -> list[_Request]:
        return sorted((r for r in self._requests.values() if r.ready(self.num_draft)), key=lambda r: (self.rank(r), r.waited))

    def _fill(self) -> list:
        out = []
        if self.term is not None:
            for req in self._requests.values():
                if not req.drafting and not req.in_flight and not req.done() and req.waits_for_draft(self.num_draft):
                    req.drafting = True
                    out.append(Draft(req.rid, tuple(req.prompt + req.generated), req.draft_size(self.num_draft)))
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
            self._in_flight[batch] = (self.term, not rows[0].sample, rows)
            out.append(Send(batch, self.term, rows))
        return out

    def _take(self) -> tuple[Row, ...]:
        ready = self._ready()
        prefill = [r for r in ready if r.prefilling]
        decode = [r for r in ready if not r.prefilling]
        decoding = sum(1 for r in self._requests.values() if not r.done() and not r.prefilling)
        chunks = sum(1 for _, is_prefill, _ in self._in_flight.values() if is_prefill)
        if chunks >= max(1, self.max_in_flight - (1 if decoding else 0)):
            prefill = []
        if prefill and (self._prefill_turn or not decode):
            self._prefill_turn = False
            chunk = min(self.prefill_chunk, self.interleaved_chunk) if decoding else self.prefill_chunk
            if self.chunk_cap is not None:
                chunk = max(1, min(chunk, self.chunk_cap))
            return (self._next_row(prefill[0], chunk),)
        self._prefill_turn = True
        share = -(-decoding // self.max_in_flight)
        return tuple(self._next_row(r) for r in decode[: max(1, min(self.max_rows, share))])


class Twin:
    """A Scheduler and its Oracle given every event alike: each answer must be the same."""

    def __init__(self, **options):
        self.sched, self.oracle = Scheduler(**options), Oracle(**options)

    def __getattr__(self, name):
        mine, theirs = getattr(self.sched, name), getattr(self.oracle, name)
        if not callable(mine):
            assert mine == theirs, f"{name}: {mine!r} (queues) != {theirs!r} (sorted)"
            return mine

        def both(*args, **kwargs):
            got, want = mine(*args, **kwargs), theirs(*args, **kwargs)
            assert got == want, f"{name}{args}: the queues decided {got}, the sort {want}"
            return got

        return both

    def __contains__(self, rid: int) -> bool:
        assert (rid in self.sched) == (rid in self.oracle)
        return rid in self.sched


class Ring:
    """P stages, each applying what reaches it in arrival order."""

    def __init__(self, stages: int, sched: Scheduler):
        self.sched = sched
        self.queues: list[list] = [[] for _ in range(stages)]
        self.caches: list[dict[int, list[int]]] = [{} for _ in range(stages)]
        self.released: set[int] = set()
        self.delivered: dict[int, list[int]] = {}
        self.releases: list[int] = []
        self.failed: set[int] = set()
        self.fail_next = False  # the last stage fails the first row of the next micro-batch it applies
        self.term = 0
        self.drafts: list[Draft] = []  # asked for, not answered yet
        self.provisional: list[dict[int, int]] = [{} for _ in range(stages)]  # per stage: positions a next row may cut
        self.accepted = 0  # proposals the ring kept, in all

    def apply(self, commands: list) -> None:
        for c in commands:
            if isinstance(c, Send):
                assert c.term == self.term
                self.queues[0].append(c)
            elif isinstance(c, Release):
                self.releases.append(c.rid)
                self.queues[0].append(c)
            elif isinstance(c, Deliver):
                assert c.rid not in self.failed, "a token after the request failed"
                self.delivered.setdefault(c.rid, []).append(c.token)
            elif isinstance(c, Draft):
                assert c.k >= 1 and all(d.rid != c.rid for d in self.drafts), "a second draft asked for before the first was answered"
                self.drafts.append(c)
            elif isinstance(c, Fail):
                assert c.rid not in self.failed, "a request failed twice"
                self.failed.add(c.rid)
        self.check()

    def check(self) -> None:
        batches = [item for q in self.queues for item in q if isinstance(item, Send)]
        assert len(batches) == self.sched.in_flight <= self.sched.max_in_flight
        for b in batches:
            assert len({row.rid for row in b.rows}) == len(b.rows), "a request twice in one micro-batch"
        # A request waits for the token it samples: one row sampling aloud in flight at most,
        # and none of its rows after it.
        aloud = [row.rid for b in batches for row in b.rows if row.sample and not row.silent]
        assert len(aloud) == len(set(aloud)), "a request's next row sent before its token came back"

    def advance(self, k: int) -> None:
        """Stage k applies its oldest item."""
        item = self.queues[k].pop(0)
        last = k == len(self.queues) - 1
        cache = self.caches[k]
        if isinstance(item, Release):
            assert item.rid in cache, "a release for caches this stage does not hold"
            del cache[item.rid]
            self.released.add(item.rid)
            if not last:
                self.queues[k + 1].append(item)
            return
        sampled, failed = {}, {}
        if last and self.fail_next and item.rows:
            self.fail_next = False
            failed[item.rows[0].rid] = "a sampler's error"
        accepted = {}
        for row in item.rows:
            assert row.rid not in self.released, "a row after the request's release"
            held = cache.setdefault(row.rid, [])
            cut = len(held) - row.offset
            assert 0 <= cut <= self.provisional[k].get(row.rid, 0), f"row at {row.offset}, cache holds {len(held)}"
            del held[row.offset :]
            held.extend(row.tokens)
            self.provisional[k][row.rid] = len(row.tokens) - 1 if row.verify else 0
            if last and row.verify and row.rid not in failed:
                n = 0  # proposals that agree with what the model samples after each position
                while n < len(row.tokens) - 1 and model(row.rid, held[: row.offset + n + 1]) == row.tokens[n + 1]:
                    n += 1
                del held[row.offset + n + 1 :]
                self.provisional[k][row.rid] = 0
                sampled[row.rid], accepted[row.rid] = model(row.rid, held), n
                self.accepted += n
            elif last and row.sample and not row.silent and row.rid not in failed:
                sampled[row.rid] = model(row.rid, held)
        if last:
            self.apply(self.sched.tokens(item.batch, item.term, sampled, failed, accepted))
        else:
            self.queues[k + 1].append(item)

    def answer_draft(self, i: int, right: bool) -> None:
        """The draft model answers the i-th open ask: the model's own continuation, or tokens it never samples."""
        d = self.drafts.pop(i % len(self.drafts))
        seq, proposals = list(d.sequence), []
        for _ in range(d.k):
            t = model(d.rid, seq) if right else (model(d.rid, seq) + 1) % VOCAB
            proposals.append(t)
            seq.append(t)
        self.apply(self.sched.drafted(d.rid, len(d.sequence), tuple(proposals)))

    def drain_step(self) -> None:
        if self.drafts:
            self.answer_draft(0, right=len(self.drafts) % 2 == 0)
        else:
            self.advance(self.busy()[-1])

    def lose(self) -> None:
        self.queues = [[] for _ in self.queues]
        self.caches = [{} for _ in self.caches]
        self.provisional = [{} for _ in self.provisional]
        self.sched.ring_lost()
        self.term += 1
        self.apply(self.sched.ring_up(self.term))

    def busy(self) -> list[int]:
        return [k for k, q in enumerate(self.queues) if q]


EVENTS = st.one_of(
    st.tuples(st.just("join"), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9), st.integers(1, 6)),
    st.tuples(st.just("leave"), st.integers(0, 30)),
    st.tuples(st.just("advance"), st.integers(0, 10)),
    st.tuples(st.just("lose")),
    st.tuples(st.just("fail")),
    st.tuples(st.just("draft"), st.integers(0, 10), st.booleans()),
    st.tuples(st.just("pace"), st.none() | st.integers(1, 4)),  # the engine's pacer sizes the chunks anew
)


@settings(max_examples=300, deadline=None)
@given(
    stages=st.integers(1, 4),
    in_flight=st.integers(1, 4),
    max_rows=st.integers(1, 4),
    chunk=st.integers(1, 4),
    interleaved=st.integers(1, 4),
    num_draft=st.integers(0, 3),
    events=st.lists(EVENTS, max_size=120),
    hog=st.booleans(),
)
def test_any_interleaving_delivers_every_token_once_in_order_as_the_uninterrupted_run(stages, in_flight, max_rows, chunk, interleaved, num_draft, events, hog):
    sched = Twin(max_in_flight=in_flight, max_rows=max_rows, prefill_chunk=chunk, interleaved_chunk=interleaved, num_draft=num_draft)
    ring = Ring(stages, sched)
    ring.apply(sched.ring_up(ring.term))
    joined: dict[int, tuple[list[int], int]] = {}
    left: set[int] = set()
    if hog:  # a stream that never ends: nobody may wait on it forever
        ring.apply(sched.join(HOG, [1, 2, 3], 10**9))
    for ev in events:
        if ev[0] == "join":
            rid = len(joined)
            joined[rid] = (ev[1], ev[2])
            ring.apply(sched.join(rid, ev[1], ev[2], draft=rid % 3 != 2))  # most requests speculate
        elif ev[0] == "draft" and ring.drafts:
            ring.answer_draft(ev[1], ev[2])
        elif ev[0] == "leave" and ev[1] in joined:
            left.add(ev[1])
            ring.apply(sched.leave(ev[1]))
        elif ev[0] == "advance" and ring.busy():
            busy = ring.busy()
            ring.advance(busy[ev[1] % len(busy)])
        elif ev[0] == "lose":
            ring.lose()
        elif ev[0] == "fail":
            ring.fail_next = True
        elif ev[0] == "pace":
            sched.sched.chunk_cap = sched.oracle.chunk_cap = ev[1]
    for _ in range(DRAIN_STEPS):  # the ring runs on: every other request must finish
        if not any(rid in sched for rid in joined):
            break
        ring.drain_step()
    waiting = [rid for rid in joined if rid in sched]
    assert not waiting, f"requests {waiting} starved beside a stream that never ends"
    if hog:
        ring.apply(sched.leave(HOG))
    for _ in range(DRAIN_STEPS):
        if not ring.busy() and not ring.drafts:
            break
        ring.drain_step()
    assert not ring.busy(), "the ring never drains"
    event("proposals accepted" if ring.accepted else "no proposal accepted")
    assert sched.in_flight == 0
    for rid, (prompt, n) in joined.items():
        got = ring.delivered.get(rid, [])
        want = reference(rid, prompt, n)
        assert got == want[: len(got)], f"request {rid}: {got} is not a prefix of {want}"
        if rid not in left and rid not in ring.failed:
            assert got == want, f"request {rid} starved: {len(got)} of {n} tokens"
        assert rid not in sched
    # Every cache a stage holds was released (or went with a lost ring).
    assert all(not cache for cache in ring.caches), ring.caches


def test_micro_batches_fill_the_pipeline_and_prompts_take_turns_with_decoding():
    sched = Scheduler(max_in_flight=2, max_rows=8, prefill_chunk=4)
    out = sched.ring_up(1) + sched.join(1, [5], 10) + sched.join(2, [6], 10) + sched.join(3, [7], 10)
    # Two micro-batches in flight at most: the third request waits for a slot.
    assert [s.rows for s in out] == [(Row(1, 0, (5,), True),), (Row(2, 0, (6,), True),)]
    assert sched.join(4, list(range(20)), 2) == []  # a long prompt waits too
    out = sched.tokens(1, 1, {1: 50})
    # The prompt's turn: its first chunk alone.
    assert out == [Deliver(1, 50), Send(3, 1, (Row(4, 0, (0, 1, 2, 3), False),))]
    out = sched.tokens(2, 1, {2: 60})
    # Then decoding's: the ready requests, longest-waiting first, an even share per slot
    # (three decoding requests, two slots: two rows).
    assert out == [Deliver(2, 60), Send(4, 1, (Row(3, 0, (7,), True), Row(1, 1, (50,), True)))]


def test_a_request_that_leaves_in_flight_is_released_after_its_row_returns():
    sched = Scheduler(max_in_flight=1)
    [send] = sched.ring_up(1) + sched.join(1, [5, 6], 4)
    assert sched.leave(1) == []  # its row is in flight: the release must follow it
    assert sched.tokens(send.batch, 1, {1: 9}) == [Release(1, 1)]  # no token delivered after leaving
    assert 1 not in sched


def test_a_lost_ring_voids_what_was_in_flight_and_replays_silently():
    sched = Scheduler(max_in_flight=1, prefill_chunk=8)
    [send] = sched.ring_up(1) + sched.join(1, [5, 6, 7], 5)
    out = sched.tokens(send.batch, 1, {})
    [send] = [c for c in out if isinstance(c, Send)]
    assert sched.tokens(send.batch, 1, {1: 40})[0] == Deliver(1, 40)
    sched.ring_lost()
    assert sched.tokens(send.batch + 1, 1, {1: 41}) == []  # an older ring's micro-batch counts for nothing
    [replay] = sched.ring_up(2)
    assert replay.rows == (Row(1, 0, (5, 6), False),)
    [last] = [c for c in sched.tokens(replay.batch, 2, {}) if isinstance(c, Send)]
    assert last.rows == (Row(1, 2, (7,), True, silent=True),)  # 40 was delivered: sampled again, not sent
    [live] = [c for c in sched.tokens(last.batch, 2, {}) if isinstance(c, Send)]
    assert live.rows == (Row(1, 3, (40,), True),)


def test_bad_events_are_refused():
    sched = Scheduler()
    with pytest.raises(SchedulerError):
        Scheduler(max_in_flight=0)
    sched.join(1, [1], 1)
    with pytest.raises(SchedulerError):
        sched.join(1, [1], 1)
    with pytest.raises(SchedulerError):
        sched.join(2, [], 1)


def test_decoding_requests_spread_over_the_slots_and_come_back_together():
    sched = Scheduler(max_in_flight=3, max_rows=32)
    sends = sched.ring_up(1)
    for rid in range(8):
        sends += sched.join(rid, [rid + 1], 100)
    # The first three joined took the three slots alone; they come back one by one.
    assert [len(s.rows) for s in sends] == [1, 1, 1]
    again = []
    for s in sends:
        again += [c for c in sched.tokens(s.batch, 1, {r.rid: 5 for r in s.rows}) if isinstance(c, Send)]
    # Now 8 decoding over 3 slots: shares of at most 3.
    assert all(len(s.rows) <= 3 for s in again) and sum(len(s.rows) for s in again) <= 8
    # A micro-batch that comes back goes out again as it was: same rows, same order.
    first = again[0]
    [back] = [c for c in sched.tokens(first.batch, 1, {r.rid: 6 for r in first.rows}) if isinstance(c, Send)]
    assert [r.rid for r in back.rows] == [r.rid for r in first.rows]


def test_failed_rows_and_micro_batches_fail_their_requests_only():
    sched = Scheduler(max_in_flight=2)
    sends = sched.ring_up(1) + sched.join(1, [5], 9) + sched.join(2, [6], 9)
    a, b = sends
    out = sched.tokens(a.batch, 1, {}, {1: "node2: a sampler's error"})
    assert Fail(1, "node2: a sampler's error") in out and Release(1, 1) in out and 1 not in sched
    out = sched.failed(b.batch, 1, "node1: out of memory")
    assert Fail(2, "node1: out of memory") in out and 2 not in sched
    [c] = sched.join(3, [7], 9)
    assert sched.tokens(c.batch, 1, {}) == [Fail(3, f"micro-batch {c.batch} came back without its token"), Release(3, 1)]


def test_a_cached_prefix_starts_the_first_ring_where_it_ends_and_a_replay_from_zero():
    sched = Scheduler(max_in_flight=1, prefill_chunk=8)
    [send] = sched.ring_up(1) + sched.join(1, [1, 2, 3, 4, 5], 3, cached=3)
    assert send.rows == (Row(1, 3, (4,), False),)
    sched.ring_lost()
    [send] = sched.ring_up(2)
    assert send.rows == (Row(1, 0, (1, 2, 3, 4), False),)
    with pytest.raises(SchedulerError):
        sched.join(2, [1, 2], 3, cached=2)


def test_a_carried_over_stream_replays_what_was_delivered_silently_and_stops_at_its_end():
    sched = Scheduler(max_in_flight=1, prefill_chunk=8, stops=frozenset({0}))
    [send] = sched.ring_up(1) + sched.join(1, [1, 2], 5, generated=[7, 8])
    [send] = [c for c in sched.tokens(send.batch, 1, {}) if isinstance(c, Send)]
    assert send.rows == (Row(1, 1, (2,), True, silent=True),)
    [send] = [c for c in sched.tokens(send.batch, 1, {}) if isinstance(c, Send)]
    assert send.rows == (Row(1, 2, (7,), True, silent=True),)
    [send] = [c for c in sched.tokens(send.batch, 1, {}) if isinstance(c, Send)]
    assert send.rows == (Row(1, 3, (8,), True),)
    # An end of sequence ends it: delivered, then released, with no row after it.
    assert sched.tokens(send.batch, 1, {1: 0}) == [Deliver(1, 0), Release(1, 4)]


def test_a_request_with_stops_of_its_own_runs_past_the_schedules():
    """``ignore_eos``: the engine joins a request with no stop tokens; it runs to max_tokens."""
    sched = Scheduler(max_in_flight=1, stops=frozenset({0}))
    [send] = sched.ring_up(1) + sched.join(1, [1], 3, stops=frozenset())
    delivered = []
    for token in (0, 0, 0):
        out = sched.tokens(send.batch, 1, {1: token})
        delivered += [c for c in out if isinstance(c, Deliver)]
        send = next((c for c in out if isinstance(c, Send)), None)
    assert delivered == [Deliver(1, 0)] * 3 and send is None and 1 not in sched


def test_a_prompts_chunks_go_around_together_leaving_decoding_a_slot():
    sched = Scheduler(max_in_flight=3, prefill_chunk=4)
    out = sched.ring_up(1) + sched.join(1, list(range(13)), 5)
    # Alone, a prompt's chunks fill every slot: each stage computes one at once.
    assert [s.rows for s in out] == [(Row(1, 0, (0, 1, 2, 3), False),), (Row(1, 4, (4, 5, 6, 7), False),), (Row(1, 8, (8, 9, 10, 11), False),)]
    first, *_ = out
    # Back in order; the prompt's last token follows at once, sampling its first token.
    assert sched.tokens(first.batch, 1, {}) == [Send(4, 1, (Row(1, 12, (12,), True),))]
    # Beside a decoding request, chunks leave it a slot.
    sched = Scheduler(max_in_flight=3, prefill_chunk=2)
    out = sched.ring_up(1) + sched.join(1, [7], 50) + sched.join(2, list(range(20)), 5)
    chunks = [s for s in out if not s.rows[0].sample]
    assert len(out) == 3 and len(chunks) == 2
    [decode] = [s for s in out if s.rows[0].sample]
    again = sched.tokens(decode.batch, 1, {1: 3})
    assert [s.rows for s in again if isinstance(s, Send)] == [(Row(1, 1, (3,), True),)]


def test_a_short_prompt_goes_in_the_next_free_slot_ahead_of_a_round_of_long_prompts():
    """Three long prompts prefill (each many chunks); a short one joins: its chunk takes the next
    slot that frees, before the long prompts' next chunks, and its first token follows at once.
    (Longest-waiting first alone would have it wait for a chunk of each long prompt.)"""
    sched = Scheduler(max_in_flight=2, prefill_chunk=4)
    out = sched.ring_up(1)
    for rid in (1, 2, 3):
        out += sched.join(rid, list(range(40)), 5)
    assert [s.rows[0].rid for s in out] == [1, 1]  # the first long prompt fills both slots
    assert sched.tokens(out[0].batch, 1, {})[0].rows[0].rid == 2  # the others take turns, longest-waiting first
    assert sched.join(9, [5, 6, 7], 4) == []  # no slot free
    [short] = sched.tokens(out[1].batch, 1, {})
    assert short.rows == (Row(9, 0, (5, 6), False),)
    [first_token] = [s for s in sched.tokens(short.batch, 1, {}) if s.rows[0].rid == 9]
    assert first_token.rows == (Row(9, 2, (7,), True),)


def test_beside_running_streams_a_prompt_goes_in_smaller_chunks():
    # Alone, a prompt goes in full chunks (prefill at full speed).
    sched = Scheduler(max_in_flight=2, prefill_chunk=8, interleaved_chunk=2)
    [first, _] = sched.ring_up(1) + sched.join(1, list(range(30)), 5)
    assert first.rows == (Row(1, 0, tuple(range(8)), False),)
    # Beside a decoding stream, in interleaved chunks: the stream waits for a small one at a time.
    sched = Scheduler(max_in_flight=2, prefill_chunk=8, interleaved_chunk=2)
    out = sched.ring_up(1) + sched.join(1, [7], 50) + sched.join(2, list(range(30)), 5)
    assert [s.rows for s in out] == [(Row(1, 0, (7,), True),), (Row(2, 0, (0, 1), False),)]
    with pytest.raises(SchedulerError):
        Scheduler(interleaved_chunk=0)


def test_a_speculative_step_verifies_the_drafts_proposals_and_delivers_what_agrees():
    sched = Scheduler(max_in_flight=1, prefill_chunk=8, num_draft=3)
    [send] = sched.ring_up(1) + sched.join(1, [5, 6], 10, draft=True)
    [last] = [c for c in sched.tokens(send.batch, 1, {}) if isinstance(c, Send)]
    assert last.rows == (Row(1, 1, (6,), True),)  # the first token comes from the prompt alone
    out = sched.tokens(last.batch, 1, {1: 40})
    # Then the draft model is asked, and nothing goes until it answers.
    assert out == [Deliver(1, 40), Draft(1, (5, 6, 40), 3)]
    # An answer for another length counts for nothing: the draft is asked again.
    assert sched.drafted(1, 2, (1, 2, 3)) == [Draft(1, (5, 6, 40), 3)]
    [verify] = sched.drafted(1, 3, (41, 42, 43))
    assert verify.rows == (Row(1, 2, (40, 41, 42, 43), True, verify=True),)
    # Two proposals kept, and the token after them: three tokens for one trip around the ring.
    out = sched.tokens(verify.batch, 1, {1: 50}, accepted={1: 2})
    assert out == [Deliver(1, 41, drafted=True), Deliver(1, 42, drafted=True), Deliver(1, 50), Draft(1, (5, 6, 40, 41, 42, 50), 3)]
    # The next row starts where the kept positions end: stages cut the rejected proposal there.
    [verify] = sched.drafted(1, 6, (60, 61, 62))
    assert verify.rows[0].offset == 5
    # Near max_tokens the draft proposes fewer, so no answer can overshoot it.
    out = sched.tokens(verify.batch, 1, {1: 63}, accepted={1: 3})
    assert out[-1] == Draft(1, (5, 6, 40, 41, 42, 50, 60, 61, 62, 63), 1)
    assert (sched.proposed, sched.kept) == (6, 5)  # what the dashboard's acceptance is made of
    # Accepting more proposals than the row had fails the request.
    [verify] = sched.drafted(1, 10, (70,))
    out = sched.tokens(verify.batch, 1, {1: 71}, accepted={1: 2})
    assert isinstance(out[0], Fail) and 1 not in sched
