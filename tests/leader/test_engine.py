"""ringd.leader.engine: the leader's requests through real stages, and each request's text.

``Engine`` over three real StageRunners in this process (tests/kit/stagering.py):
requests that run at once, some of whose clients leave midway, get mlx-lm's
tokens, go around in micro-batches, and leave nothing behind (no request on the
leader, no session on any stage). ``_Text``: what a stop string does to the text,
with a detokenizer that spells each token as given, so a stop can straddle tokens.
The ring over real processes and TCP is exercised in test_ring and test_failover.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

import mlx.core as mx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from devkit.stagering import StageRing
from devkit.stagering import teacher_forced_mismatches

from ringd.leader.engine import Engine, EngineSettings, _Text
from ringd.leader.errors import EngineError
from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.ring.sampling import SamplingParams
from wire.frames import MsgType

EOS = 0


class Spelling:
    """mlx-lm's detokenizer interface over a fixed spelling of each token id."""

    def __init__(self, pieces: dict[int, str]):
        self.pieces = pieces
        self.last_segment = ""

    def add_token(self, token: int) -> None:
        self.last_segment = self.pieces[token]

    def finalize(self) -> None:
        self.last_segment = ""


@functools.cache
def _mlx_model(path: str):
    from mlx_lm.utils import load as mlx_load

    return mlx_load(path)[0]


def greedy_tokens(path, prompt: list[int], max_tokens: int, eos_ids, leave_after: int | None = None) -> list[int]:
    """mlx-lm's greedy tokens after ``prompt`` (generate_step on the same model), as a request gets
    them: up to and including its first end token, and no more than a client that stops reading
    after ``leave_after`` tokens reads."""
    from mlx_lm.generate import generate_step

    out: list[int] = []
    for token, _ in generate_step(mx.array(prompt), _mlx_model(str(path)), max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in eos_ids or len(out) == leave_after:
            break
    return out


async def until(predicate, what: str, timeout_s: float = 60) -> None:
    """Return once ``predicate()`` holds, letting the loop run; raise after a generous deadline."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s} s: {what}") from None


def parked(engine) -> int:
    """How many callers wait on the engine's next ring (its ``_settled`` event): the sign that a
    request, or a ``ring_back``, got as far as waiting. (asyncio.Event's waiters are the only trace.)"""
    return len(engine._settled._waiters)


def run(pieces: list[str], stop: list[str], max_tokens: int = 100) -> tuple[str, str | None, str | None]:
    """The text emitted, the finish reason, and the stop string named."""
    text = _Text(Spelling(dict(enumerate(pieces, start=1))), stop, {EOS}, max_tokens)
    out, finish = [], None
    for token in [*range(1, len(pieces) + 1), EOS]:
        piece, finish = text.next(token)
        out.append(piece)
        if finish is not None:
            break
    return "".join(out), finish, text.matched


def test_the_stop_that_ends_the_text_is_named_even_across_tokens():
    assert run(["The cap", "ital is Pa", "ris. More"], ["Paris", "Rome"]) == ("The capital is ", "stop", "Paris")
    assert run(["a", "b", "c"], ["x"]) == ("abc", "stop", None)  # ended by its end token: no stop named
    assert run(["ab", "cd"], ["cd"], max_tokens=2) == ("ab", "stop", "cd")
    assert run(["xbab"], ["ab", "bab"]) == ("x", "stop", "bab")  # two end at once: the longest, as the matcher strips it


def test_with_ignore_eos_an_end_token_is_spelt_as_nothing_and_a_stop_or_the_length_still_ends_it():
    def feed(tokens, stop, max_tokens):
        text = _Text(Spelling({1: "ab", 2: "c", 3: "d!"}), stop, {EOS}, max_tokens, ignore_eos=True)
        out = [text.next(t) for t in tokens]
        return "".join(piece for piece, _ in out), [finish for _, finish in out], text.matched

    assert feed([1, EOS, 2, EOS, 3], ["cd"], 10) == ("ab", [None] * 4 + ["stop"], "cd")
    assert feed([1, EOS, EOS], [], 3) == ("ab", [None, None, "length"], None)


@given(
    words=st.lists(st.sampled_from(["a", "b", "ab", "ba", "END", "E", "ND", " "]), max_size=12),
    stops=st.lists(st.sampled_from(["END", "ab", "bab", "DE"]), min_size=1, max_size=3, unique=True),
)
def test_the_text_stops_at_the_first_stop_and_names_one_that_ends_there(words, stops):
    whole = "".join(words)
    text, finish, matched = run(words, stops)
    ends = [(whole.find(s) + len(s), s) for s in stops if s in whole]
    if not ends:
        assert (text, finish, matched) == (whole, "stop", None)
        return
    end = min(e for e, _ in ends)
    assert finish == "stop" and matched is not None and whole[:end].endswith(matched)
    assert text == whole[: end - len(matched)]


def test_requests_at_once_through_real_stages_get_mlx_lms_tokens_and_leave_nothing_behind(tiny_model):
    from mlx_lm.utils import load as mlx_load

    path = tiny_model(arch="llama", layers=4, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompts = [tokenizer.encode(f"Request number {i} asks about {'rings ' * i}", add_special_tokens=False) for i in range(6)]
    leaves_after = {4: 3, 5: 1}  # these clients stop reading after so many tokens

    async def main():
        ring = StageRing(path, [1, 3], tokenizer)
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefill_chunk_tokens=8, prefix_cache_entries=0)))

        async def one(i):
            got = []
            async for event in engine.generate(prompts[i], SamplingParams(temperature=0), 12):
                got.append(event.token)
                if len(got) == leaves_after.get(i, 99):
                    break
            return got

        try:
            outs = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))), 300)
            # Every RELEASE is on its way: wait for the stages to apply them.
            for _ in range(600):
                if not any(len(r.sessions) for r in ring.runners.values()) and not engine._flights:
                    break
                await asyncio.sleep(0.05)
            left = {node: len(r.sessions) for node, r in ring.runners.items()}
            return outs, left, engine, ring.metrics
        finally:
            await ring.stop()

    outs, left, engine, _ = asyncio.run(main())
    assert left == {"node0": 0, "node1": 0, "node2": 0}, left
    assert not engine._flights and engine.active == 0 and engine.scheduler.in_flight == 0
    assert engine.metrics.registry.get_sample_value("ringd_micro_batch_rows_count", {"node": "node0"}) > 0
    model, _ = mlx_load(str(path))
    for i, got in enumerate(outs):
        want = greedy_tokens(path, prompts[i], 12, set(tokenizer.eos_token_ids), leaves_after.get(i))
        # Where they part, how close mlx-lm's top two were there (a near tie is float noise).
        assert got == want, f"request {i}: {got} != mlx-lm's {want}; " + "; ".join(teacher_forced_mismatches(model, prompts[i], got))


def test_ignore_eos_runs_past_the_end_token_to_max_tokens(tiny_model):
    """The tiny model's third greedy token made its end token: a request ends there, with
    ``ignore_eos`` it runs on to max_tokens with mlx-lm's greedy tokens (the end token among
    them, spelt as nothing), finishing for its length. The ring does not wait for a consumer
    that lags: its answers queue up, and each event says how many wait behind it (``queued``,
    what lets a stream join their events into one write)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_load

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompt = tokenizer.encode("hello there", add_special_tokens=False)
    model, _ = mlx_load(str(path))
    greedy = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
    assert greedy[2] not in greedy[:2], greedy  # the end token ends the request at the third
    tokenizer.eos_token_ids = {greedy[2]}

    async def main():
        ring = StageRing(path, [1], tokenizer)
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefix_cache_entries=0)))
        try:
            events = [e async for e in engine.generate(prompt, SamplingParams(temperature=0), 8)]
            outs = [([e.token for e in events], events[-1].finish_reason)]
            lagging = engine.generate(prompt, SamplingParams(temperature=0), 8, ignore_eos=True)
            events = [await anext(lagging)]
            [flight] = engine._flights.values()
            await until(lambda: flight.queue.qsize() == 7, "the ring's other seven answers to queue behind the consumer")
            events += [e async for e in lagging]
            outs.append(([e.token for e in events], events[-1].finish_reason))
            assert [e.queued for e in events[1:]] == [6, 5, 4, 3, 2, 1, 0], [e.queued for e in events]
            return outs, events[2].text
        finally:
            await ring.stop()

    outs, end_text = asyncio.run(main())
    assert outs == [(greedy[:3], "stop"), (greedy, "length")]
    assert end_text == ""  # the end token ignored adds no text


def test_a_request_failing_on_a_stage_fails_alone(tiny_model):
    """A grammar the last stage cannot follow (no tokenizer there) fails that request with the
    stage's reason; the one beside it is served."""
    from ringd.stage import grammar

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))

    async def main():
        ring = StageRing(path, [1], tokenizer)
        ring.runners[ring.stages[-1].node].grammar_tokenizer = None
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefix_cache_entries=0)))
        prompt = tokenizer.encode("hello there", add_special_tokens=False)

        async def run(params):
            try:
                return [e.token async for e in engine.generate(prompt, params, 5)]
            except EngineError as e:
                return e

        try:
            out = await asyncio.wait_for(asyncio.gather(run(SamplingParams(grammar=grammar.json_object())), run(SamplingParams(temperature=0))), 120)
            return out, dict(engine._flights), prompt
        finally:
            await ring.stop()

    (failed, served), flights, prompt = asyncio.run(main())
    assert not flights, "a failed request stayed on the leader"
    assert isinstance(failed, EngineError) and "grammar" in str(failed) and "node1" in str(failed), failed
    assert served == greedy_tokens(path, prompt, 5, set(tokenizer.eos_token_ids)), served


def test_speculative_decoding_through_real_stages_gives_the_plain_greedy_tokens(tiny_model):
    """A draft that always agrees (the model itself) and one that rarely does (another random
    model with the same vocabulary): greedy requests at once get the tokens the same engine gives
    without a draft; a sampled request beside them speculates too (speculative sampling); nothing is left behind."""
    from ringd.leader.draft import Drafter

    path = tiny_model(arch="llama", layers=4, dtype="float32")
    stranger = tiny_model(arch="llama", layers=2, dtype="float32", seed=9)
    tokenizer = load_tokenizer(model_info(str(path)))
    prompts = [tokenizer.encode(f"Question {i}: {'why rings? ' * i}", add_special_tokens=False) for i in range(4)]

    async def main():
        ring = StageRing(path, [1, 3], tokenizer)

        def engine_with(drafter):
            return ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefill_chunk_tokens=8, prefix_cache_entries=0, num_draft=3), drafter=drafter))

        async def answers(engine):
            async def one(prompt):
                return [e.token async for e in engine.generate(prompt, SamplingParams(temperature=0), 20)]

            sampled = engine.generate(prompts[0], SamplingParams(temperature=0.7, seed=3), 20)
            outs = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts), _drain(sampled)), 300)
            for _ in range(600):  # every RELEASE applied on every stage
                if not any(len(r.sessions) for r in ring.runners.values()) and not engine._flights:
                    break
                await asyncio.sleep(0.05)
            return outs[:-1]

        def proposals() -> tuple[float, float]:
            get = ring.metrics.registry.get_sample_value
            return tuple(get("ringd_draft_tokens_total", {"node": "node-last", "outcome": o}) or 0.0 for o in ("accepted", "rejected"))

        async def speculating(draft) -> tuple[list, float]:
            """The answers with ``draft`` as the draft model, and the share of its proposals kept."""
            before = proposals()
            out = await answers(engine_with(await Drafter.load(str(draft), ring.compute, model_info(str(path)))))
            kept, cut = (a - b for a, b in zip(proposals(), before))
            return out, kept / (kept + cut)

        try:
            plain = await answers(engine_with(None))
            same, same_rate = await speculating(path)
            other, other_rate = await speculating(stranger)
            left = [len(r.sessions) for r in ring.runners.values()]
            return plain, same, other, same_rate, other_rate, left
        finally:
            await ring.stop()

    plain, same, other, same_rate, other_rate, left = asyncio.run(main())
    assert same == plain and other == plain
    # The model as its own draft agrees nearly always; a stranger rarely (both verified the same way).
    assert same_rate > 0.9 and other_rate < 0.3, (same_rate, other_rate)
    assert left == [0, 0, 0], left


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_only_requests_whose_caches_can_be_cut_back_speculate(tiny_model):
    """Greedy and sampled requests without logprobs, penalties or a grammar, on caches that can drop a rejected
    proposal for the request's whole length (a sliding window cannot once it wraps; linear
    attention never)."""
    from ringd.ring.steps import KvOptions

    tokenizer = load_tokenizer(model_info(str(tiny_model(arch="llama", layers=2, dtype="float32"))))
    engine = Engine("node0", tokenizer, None, drafter=object())
    greedy = SamplingParams(temperature=0)
    assert engine._speculates(greedy, 10_000)
    assert engine._speculates(SamplingParams(temperature=0.5, top_k=5), 10)  # speculative sampling
    assert not engine._speculates(SamplingParams(temperature=0, logprobs=True), 10)
    assert not engine._speculates(SamplingParams(temperature=0, repetition_penalty=1.1), 10)
    engine.prefix_limit = 0  # linear-attention state
    assert not engine._speculates(greedy, 10)
    engine.prefix_limit = 64  # a sliding window of 64: fine while the request stays inside it
    assert engine._speculates(greedy, 63) and not engine._speculates(greedy, 64)
    engine.prefix_limit, engine.kv = None, KvOptions(max_size=32)
    assert engine._speculates(greedy, 31) and not engine._speculates(greedy, 40)
    assert not Engine("node0", tokenizer, None)._speculates(greedy, 10)  # no draft model


def test_a_request_arriving_while_a_lost_ring_is_replanned_waits_for_the_next(tiny_model):
    """Between a lost ring and the next, new requests wait as the held ones do (ring_back); when
    none ever served, or none can, they are told at once."""
    from ringd.ring.plan import Plan, Stage

    tokenizer = load_tokenizer(model_info(str(tiny_model(arch="llama", layers=2, dtype="float32"))))

    def plan(term):
        return Plan(term, "node0", "fp", 2, (Stage("node0", "127.0.0.1:1", 0, 2),))

    async def main():
        engine = Engine("node0", tokenizer, lambda node, frame: None)
        never = await engine.ring_back(60)  # no ring ever served: nothing to wait for
        engine.set_plan(plan(1))
        engine.suspend_all("node1 left")
        waiting = asyncio.ensure_future(engine.ring_back(60))
        await until(lambda: parked(engine) == 1, "ring_back to wait for the next ring")
        assert not waiting.done()
        engine.set_plan(plan(2))
        back = await asyncio.wait_for(waiting, 10)
        engine.suspend_all("node1 left")
        waiting = asyncio.ensure_future(engine.ring_back(60))
        await until(lambda: parked(engine) == 1, "ring_back to wait for the next ring")
        engine.fail_all("no ring can serve")
        none = await asyncio.wait_for(waiting, 10)
        timed_out = await engine.ring_back(0.01)  # nothing is being planned now: at once
        engine.set_plan(plan(3))
        engine.suspend_all("node1 left")
        return never, back, none, timed_out, await engine.ring_back(0.05)

    assert asyncio.run(main()) == (False, True, False, False, False)


def test_a_request_that_arrives_while_the_ring_is_re_planned_waits_for_the_next(tiny_model):
    """A request that reaches the engine after a stage was lost and before the next ring is
    planned (its HTTP handler saw the ring up, then tokenized its prompt off the loop) waits for
    that ring and gets the tokens it gets with no break; once no ring can serve, one fails at once."""
    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompt = tokenizer.encode("hello there", add_special_tokens=False)

    async def main():
        ring = StageRing(path, [1], tokenizer)
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefix_cache_entries=0)))

        async def run():
            return [e.token async for e in engine.generate(prompt, SamplingParams(temperature=0), 6)]

        try:
            alone = await asyncio.wait_for(run(), 120)
            engine.suspend_all("node1 left")
            waiting = asyncio.ensure_future(run())
            # The engine holds it once it waits for the next ring (its admission does).
            await until(lambda: parked(engine) == 1, "the request to wait for the next ring")
            held = not waiting.done()
            engine.set_plan(ring.plan)
            served = await asyncio.wait_for(waiting, 120)
            engine.fail_all("no ring can serve")
            try:
                await asyncio.wait_for(run(), 10)
                refused = None
            except EngineError as e:
                refused = e
            return alone, held, served, refused
        finally:
            await ring.stop()

    alone, held, served, refused = asyncio.run(main())
    assert held and served == alone
    assert alone == greedy_tokens(path, prompt, 6, set(tokenizer.eos_token_ids)), alone
    assert isinstance(refused, EngineError) and refused.status == 503, refused


def test_a_micro_batch_lost_on_a_live_ring_fails_its_request_and_frees_its_slot(tiny_model):
    """A stage that swallows a FORWARD (a bug, a frame lost without the link breaking): the
    watchdog fails that micro-batch's request with a 503 once the step timeout has passed, and
    the next request is served."""
    import time

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))

    async def main():
        ring = StageRing(path, [1], tokenizer)
        last = ring.stages[-1].node
        swallowed = []

        def lose(node, frame) -> bool:
            if frame.type == MsgType.FORWARD and node == last and not swallowed:
                # Lost on the way: no answer will ever come. When, on the clock watch() reads.
                swallowed.append(time.monotonic())
                return True
            return False

        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefix_cache_entries=0, step_timeout_s=30)), lose)
        # One token: its one row waits for its token, and nothing follows it on the ring.
        prompt = tokenizer.encode("hello", add_special_tokens=False)[:1]

        async def run():
            try:
                return [e.token async for e in engine.generate(prompt, SamplingParams(temperature=0), 4)]
            except EngineError as e:
                return e

        try:
            lost = asyncio.ensure_future(run())
            await until(lambda: swallowed, "the FORWARD to be swallowed")
            (at,) = swallowed
            assert engine.watch(at) == 0  # not late yet: its FORWARD has just gone
            assert engine.watch(at + engine.step_timeout_s + 1) == 1
            failed = await asyncio.wait_for(lost, 30)
            served = await asyncio.wait_for(run(), 120)
            return failed, served, engine.scheduler.in_flight
        finally:
            await ring.stop()

    failed, served, in_flight = asyncio.run(main())
    assert isinstance(failed, EngineError) and failed.status == 503 and "did not come back" in str(failed), failed
    prompt = tokenizer.encode("hello", add_special_tokens=False)[:1]
    assert served == greedy_tokens(path, prompt, 4, set(tokenizer.eos_token_ids)), served
    assert in_flight == 0


def test_one_timer_per_request_moves_its_deadline_with_each_wait_and_fails_a_silent_ring():
    """The step deadline (``_answer``): an answer already there is taken without a timer; a wait
    arms the request's one timer, which, firing while a later wait has not yet lasted
    ``step_timeout_s``, waits for that wait's deadline instead of failing it; a ring that stays
    silent for ``step_timeout_s`` fails the request with a 503."""
    from types import SimpleNamespace

    from ringd.leader.engine import _Flight

    async def main():
        engine = Engine("node0", SimpleNamespace(eos_token_ids=[EOS]), None, EngineSettings(step_timeout_s=0.2))
        flight = _Flight(1, [5], SamplingParams(temperature=0), 4, asyncio.Queue())
        flight.queue.put_nowait("a token")
        assert await engine._answer(flight) == "a token" and flight.watchdog is None
        waiting = asyncio.ensure_future(engine._answer(flight))
        await until(lambda: flight.waiting_since is not None, "the consumer to wait")
        armed = flight.watchdog
        assert armed is not None and armed.when() == flight.waiting_since + engine.step_timeout_s
        flight.queue.put_nowait("the next")
        assert await waiting == "the next" and flight.waiting_since is None
        # A later wait, begun just now: the timer of the first fires early for it, and moves.
        waiting = asyncio.ensure_future(engine._answer(flight))
        await until(lambda: flight.waiting_since is not None, "the consumer to wait again")
        assert flight.watchdog is armed  # no new timer per wait
        armed.cancel()
        engine._overdue(flight)
        assert flight.queue.empty() and flight.watchdog.when() == flight.waiting_since + engine.step_timeout_s
        with contextlib.suppress(EngineError):
            await asyncio.wait_for(waiting, 30)  # the ring says nothing: the moved deadline fails it
        return waiting.exception()

    error = asyncio.run(main())
    assert isinstance(error, EngineError) and error.status == 503 and "did not answer within" in str(error), error


def pooled_reference(model, prompt: list[int], pool: str) -> mx.array:
    """mlx-lm in one process: the decoder's final hidden states (its norm applied) over the whole
    prompt at once, pooled (the mean, the first position's, the last's)."""
    h = model.model(mx.array(prompt)[None])[0].astype(mx.float32)
    return {"mean": h.mean(axis=0), "cls": h[0], "last": h[-1]}[pool]


def test_embeddings_through_real_stages_are_mlx_lms_pooled_hidden_states(tiny_model):
    """Through one stage and three, in prefill chunks, beside a request that generates: each
    embedding (every pooling) is the single process's pooled hidden states within float32
    rounding, and nothing is left behind (an embedding keeps no cached prefix)."""
    from mlx_lm.utils import load as mlx_load

    path = tiny_model(arch="llama", layers=4, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompts = [tokenizer.encode(f"Text number {i} is about {'rings ' * (3 * i)}", add_special_tokens=False) for i in range(4)]
    prompts.append(prompts[0][:1])  # one token: its only row opens and answers at once

    async def main(cuts):
        ring = StageRing(path, cuts, tokenizer)
        engine = ring.lead(Engine("node0", tokenizer, None, EngineSettings(prefill_chunk_tokens=8)))

        async def generate():
            return [e.token async for e in engine.generate(prompts[1], SamplingParams(temperature=0), 6)]

        try:
            asks = [(p, pool) for pool in ("mean", "cls", "last") for p in prompts]
            *got, beside = await asyncio.wait_for(asyncio.gather(*(engine.embed(p, pool) for p, pool in asks), engine.embed(prompts[0], "mean"), generate()), 300)
            # What is left: the generation's cached prefix on every stage; no embedding's.
            await until(lambda: not any(len(r.sessions) for r in ring.runners.values()) and not engine._flights, "every request released")
            return asks, got, beside, engine, [r.sessions.stored for r in ring.runners.values()]
        finally:
            await ring.stop()

    model, _ = mlx_load(str(path))
    for cuts in ([], [1, 3]):
        asks, got, beside, engine, stored = asyncio.run(main(cuts))
        assert len(engine.prefix.keys()) == 1 and stored == [1] * (len(cuts) + 1), stored
        for (prompt, pool), vector in zip(asks, got):
            want = np.array(pooled_reference(model, prompt, pool))
            assert vector.dtype == np.float32 and vector.shape == want.shape
            assert np.allclose(vector, want, atol=1e-4, rtol=1e-4), f"{len(cuts) + 1} stage(s), {pool}: {np.abs(vector - want).max()}"
        assert np.array_equal(got[-1], got[0])  # the same input again: the same vector
        assert beside == greedy_tokens(path, prompts[1], 6, set(tokenizer.eos_token_ids))


def test_the_next_turn_finds_the_prefix_of_an_answer_its_client_stopped_reading(tiny_model, monkeypatch):
    """An agent's next turn arrives the moment the last answer ends; one that ended early (its client
    stopped reading, as the server does at a repeated call) still has a row on the ring. The turn
    waits for it to be kept, and starts from its caches: not without the wait (LEAVING_WAIT_S 0)."""
    import ringd.leader.engine as engine_module

    HELD_S = 1.0  # within LEAVING_WAIT_S: the wait sees it come back
    assert HELD_S < engine_module.LEAVING_WAIT_S

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompt = tokenizer.encode("An agent asks about " + "rings " * 12, add_special_tokens=False)

    async def main():
        ring = StageRing(path, [1], tokenizer)
        # The answer to the row on the ring when the first request ends comes back HELD_S late: the
        # next turn, which starts at once, surely starts while it is away (not so by chance).
        before, closed = set(), []

        def hold(node, frame) -> bool:
            if frame.type == MsgType.FORWARD and node == ring.first and not closed:
                before.add(frame.request_id)
            if closed and frame.type == MsgType.TOKEN and frame.request_id in before:
                loop.call_later(HELD_S, engine.on_frame, ring.stages[-1].node, frame)
                return True
            return False

        loop = asyncio.get_running_loop()
        engine = ring.lead(Engine("node0", tokenizer, None), hold)
        try:
            answer = []
            async with contextlib.aclosing(engine.generate(prompt, SamplingParams(temperature=0), 12, ignore_eos=True)) as events:
                async for event in events:
                    answer.append(event.token)
                    if len(answer) == 3:
                        closed.append(True)
                        break  # closed as the server closes it; the next row is on the ring already
            turn = prompt + answer + tokenizer.encode(" and then?", add_special_tokens=False)
            async for event in engine.generate(turn, SamplingParams(temperature=0), 1):
                return event.cached_tokens
        finally:
            await ring.stop()

    assert asyncio.run(main()) >= len(prompt)
    monkeypatch.setattr(engine_module, "LEAVING_WAIT_S", 0)
    assert asyncio.run(main()) == 0


def test_on_a_slow_ring_a_long_prompt_s_chunks_shrink_to_the_paced_size_and_still_give_mlx_lms_tokens(tiny_model, monkeypatch):
    """A ring whose chunks come back slowly (the engine's clock made to run 0.25 s a reading) gets
    chunks sized to ``prefill_chunk_s``: the first ones full, then the pacer's, whole multiples of
    32 tokens; the answer is still mlx-lm's. With ``prefill_chunk_s`` 0 the count alone decides."""
    import time as real_time

    from mlx_lm.utils import load as mlx_load

    from ringd.leader import engine as engine_module
    from ringd.leader.pacing import CHUNK_QUANTUM, MIN_PACED_CHUNK

    class SlowClock:  # every reading a quarter second after the last: each chunk seems to take long
        now = 0.0

        @classmethod
        def monotonic(cls) -> float:
            cls.now += 0.25
            return cls.now

        def __getattr__(self, name):
            return getattr(real_time, name)

    monkeypatch.setattr(engine_module, "time", SlowClock())
    path = tiny_model(arch="llama", layers=4, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    prompt = tokenizer.encode("the ring of small computers shares one mind " * 60, add_special_tokens=False)

    def chunks_of(settings: EngineSettings) -> tuple[list[int], list[int]]:
        async def main():
            ring = StageRing(path, [2], tokenizer)
            engine = ring.lead(Engine("node0", tokenizer, None, settings))
            sizes, send_batch = [], engine._send_batch
            engine._send_batch = lambda send: (sizes.append(len(send.rows[0].tokens)) if not send.rows[0].sample else None, send_batch(send))
            try:
                got = [e.token async for e in engine.generate(prompt, SamplingParams(temperature=0), 4)]
                return sizes, got
            finally:
                await ring.stop()

        return asyncio.run(main())

    paced, got = chunks_of(EngineSettings(prefill_chunk_tokens=128, prefill_chunk_s=0.2, prefix_cache_entries=0))
    assert len(prompt) > 6 * 128 and paced[0] == 128, paced
    assert min(paced[:-1]) == MIN_PACED_CHUNK and all(n == 128 or n % CHUNK_QUANTUM == 0 for n in paced[:-1]), paced
    assert got == greedy_tokens(path, prompt, 4, set(tokenizer.eos_token_ids)), "; ".join(teacher_forced_mismatches(mlx_load(str(path))[0], prompt, got))
    counted, _ = chunks_of(EngineSettings(prefill_chunk_tokens=128, prefill_chunk_s=0, prefix_cache_entries=0))
    assert set(counted[:-1]) == {128}, counted
