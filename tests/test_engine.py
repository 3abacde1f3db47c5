"""ringd.engine: the leader's requests through real stages, and each request's text.

``Engine`` over three real StageRunners in this process (tests/stagering.py):
requests that run at once, some of whose clients leave midway, get mlx-lm's
tokens, go around in micro-batches, and leave nothing behind (no request on the
leader, no session on any stage). ``_Text``: what a stop string does to the text,
with a detokenizer that spells each token as given, so a stop can straddle tokens.
The ring over real processes and TCP is exercised in test_ring and test_failover.
"""

from __future__ import annotations

import asyncio

from hypothesis import given
from hypothesis import strategies as st
from stagering import StageRing
from test_pipeline import teacher_forced_mismatches

from ringd.checkpoint import load_tokenizer, model_info
from ringd.engine import Engine, EngineError, _Text
from ringd.sampling import SamplingParams
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
        last = ring.stages[-1].node
        engine = Engine("node0", tokenizer, None, prefill_chunk_tokens=8, prefix_cache_entries=0)

        def send(node, frame):
            if frame.type in (MsgType.FORWARD, MsgType.RELEASE):
                ring.runners[node].handle(frame)
            else:
                engine.on_frame(last, frame)

        engine.send = send
        for runner in ring.runners.values():
            runner.send = send
        engine.set_plan(ring.plan)

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
        ended = got and got[-1] in tokenizer.eos_token_ids  # the model ended it: fine, the same as mlx-lm
        assert len(got) == leaves_after.get(i, 12) or ended and len(got) < leaves_after.get(i, 12), (i, got)
        bad = teacher_forced_mismatches(model, prompts[i], got)
        assert not bad, f"request {i}: " + "; ".join(bad)


def test_a_request_failing_on_a_stage_fails_alone(tiny_model):
    """A grammar the last stage cannot follow (no tokenizer there) fails that request with the
    stage's reason; the one beside it is served."""
    from ringd import grammar

    path = tiny_model(arch="llama", layers=2, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))

    async def main():
        ring = StageRing(path, [1], tokenizer)
        ring.runners[ring.stages[-1].node].grammar_tokenizer = None
        engine = Engine("node0", tokenizer, None, prefix_cache_entries=0)

        def send(node, frame):
            if frame.type in (MsgType.FORWARD, MsgType.RELEASE):
                ring.runners[node].handle(frame)
            else:
                engine.on_frame(ring.stages[-1].node, frame)

        engine.send = send
        for runner in ring.runners.values():
            runner.send = send
        engine.set_plan(ring.plan)
        prompt = tokenizer.encode("hello there", add_special_tokens=False)

        async def run(params):
            try:
                return [e.token async for e in engine.generate(prompt, params, 5)]
            except EngineError as e:
                return e

        try:
            out = await asyncio.wait_for(asyncio.gather(run(SamplingParams(grammar=grammar.json_object())), run(SamplingParams(temperature=0))), 120)
            return out, dict(engine._flights)
        finally:
            await ring.stop()

    (failed, served), flights = asyncio.run(main())
    assert not flights, "a failed request stayed on the leader"
    assert isinstance(failed, EngineError) and "grammar" in str(failed) and "node1" in str(failed), failed
    assert isinstance(served, list) and len(served) >= 1
