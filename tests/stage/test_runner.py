"""ringd.stage.runner: a stage runs a micro-batch's decode rows as one batch, and every token is still mlx-lm's.

In-process: three real StageRunners of a real tiny mlx-lm model (float32, so
batched and single arithmetic differ by rounding only) pass real frames as the
links would (tests/kit/stagering.py). A leader loop lets requests of different
prompt lengths join and leave at different steps, sends their decode rows in
micro-batches whose make-up and order change (the stages regroup their caches),
and checks each request's tokens teacher-forced: every token is the argmax of
mlx-lm's own logits on that request's sequence, unless mlx-lm's top-2 margin
there is within TOP2_TOLERANCE (batched sums may round a near tie either way).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from mlx_lm.utils import load as mlx_load
from devkit.stagering import TERM, StageRing, teacher_forced_mismatches

from ringd.ring.sampling import SamplingParams
from ringd.models.tinyarchs import ARCHS
from ringd.ring.steps import Open, Row, Tokens, release

# float32 logits of a tiny random model: batched matmuls and masked attention change the
# summation order, so two logits closer than this may swap; further apart they may not.
REQUESTS = 10


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="llama", layers=4, dtype="float32")


def rows_batched(metrics) -> int:
    """Passes of a stage's layers that computed more than one row (ringd_stage_batch_rows above 1)."""
    get = metrics.registry.get_sample_value
    labels = {"node": metrics.node}
    return int(get("ringd_stage_batch_rows_count", labels) - get("ringd_stage_batch_rows_bucket", {**labels, "le": "1.0"}))


def test_requests_joining_and_leaving_batched_decode_get_mlx_lms_tokens(model):
    rng = random.Random(16)
    # Prompt lengths from 1 (its first row opens it, a decode row) to past a prefill chunk.
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (1, 2, 5, 9, 17, 23, 31, 40, 3, 12)]
    joins = [0, 0, 1, 2, 2, 4, 5, 7, 9, 12]  # the step each request joins at
    lengths = [12, 20, 8, 15, 25, 6, 18, 10, 14, 9]  # tokens each generates, then leaves

    async def main():
        ring = StageRing(model, [1, 3])
        try:
            live: dict[int, tuple[int, int, Open | None]] = {}  # rid -> (offset, token, open)
            out = {rid: [] for rid in range(REQUESTS)}
            step = 0
            while step < 200 and (live or step <= max(joins)):
                for rid in [r for r, j in enumerate(joins) if j == step]:
                    opened = await ring.prefill(rid, prompts[rid], SamplingParams(temperature=0), chunk=16)
                    live[rid] = (len(prompts[rid]) - 1, prompts[rid][-1], opened)
                rids = list(live)
                rng.shuffle(rids)  # the make-up and order of the micro-batches changes: stages regroup
                cut = rng.randrange(0, len(rids) + 1) if step % 3 == 0 else len(rids)
                for part in (rids[:cut], rids[cut:]):
                    if not part:
                        continue
                    ring.forward([Row(rid, live[rid][0], (live[rid][1],), True, open=live[rid][2]) for rid in part])
                    answer = await ring.answer()
                    assert isinstance(answer, Tokens) and not answer.failed and len(answer.rows) == len(part), answer
                    for s in answer.rows:
                        out[s.rid].append(s.token)
                        live[s.rid] = (s.offset, s.token, None)
                        if len(out[s.rid]) == lengths[s.rid]:
                            del live[s.rid]
                            ring.send(ring.first, release(s.rid, TERM))
                step += 1
            return out, [rows_batched(ring.runners[s.node].metrics) for s in ring.stages]
        finally:
            await ring.stop()

    out, batched_passes = asyncio.run(main())
    assert all(n > 0 for n in batched_passes), f"no stage ran rows batched: {batched_passes}"
    mlx_model, _ = mlx_load(str(model))
    for rid in range(REQUESTS):
        assert len(out[rid]) == lengths[rid], rid
        bad = teacher_forced_mismatches(mlx_model, prompts[rid], out[rid])
        assert not bad, f"request {rid} (prompt of {len(prompts[rid])}):\n" + "\n".join(bad)


# The architectures whose stages batch decode rows (every layer's cache merges, and the
# model's code takes batched caches: Shard._batches_right): plain attention, sliding windows
# (gemma3, gpt-oss: past the window of 16 here) and linear attention (qwen3-next). gemma2
# steps rows one at a time: its soft-capped attention does not broadcast a batch's mask.
BATCHED_ARCHS = set(ARCHS) - {"gemma2"}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_decodes_batched_rows_as_mlx_lm_does(tiny_model, arch):
    path = tiny_model(arch=arch, layers=6, dtype="float32")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (3, 9, 20)]

    async def main():
        ring = StageRing(path, [3])
        try:
            live = {}
            for rid, prompt in enumerate(prompts):
                await ring.prefill(rid, prompt, SamplingParams(temperature=0))
                live[rid] = (len(prompt) - 1, prompt[-1])
            out = {rid: [] for rid in live}
            for _ in range(12):
                ring.forward([Row(rid, offset, (token,), True) for rid, (offset, token) in live.items()])
                answer = await ring.answer()
                assert isinstance(answer, Tokens) and not answer.failed, answer
                for s in answer.rows:
                    out[s.rid].append(s.token)
                    live[s.rid] = (s.offset, s.token)
            return out, [rows_batched(ring.runners[s.node].metrics) for s in ring.stages]
        finally:
            await ring.stop()

    out, batched = asyncio.run(main())
    assert all(batched) if arch in BATCHED_ARCHS else not any(batched), batched
    mlx_model, _ = mlx_load(str(path))
    for rid, prompt in enumerate(prompts):
        bad = teacher_forced_mismatches(mlx_model, prompt, out[rid])
        assert not bad, f"request {rid}:\n" + "\n".join(bad)


def test_verify_rows_keep_the_proposals_that_agree_and_every_stage_cuts_the_rest(model):
    """Speculative decoding's stage side: rows carrying a fed-back token and a draft's proposals,
    right, wrong or half right, give the tokens plain greedy decoding gives, and no stage's caches
    keep a rejected proposal (the next row, starting where the kept ones end, would fail)."""
    rng = random.Random(5)
    prompt = [rng.randrange(1, 500) for _ in range(11)]
    steps = 30

    async def main():
        ring = StageRing(model, [1, 3])
        try:
            plain = await ring.generate(prompt, SamplingParams(temperature=0), steps, rid=1)
            opened = await ring.prefill(2, prompt, SamplingParams(temperature=0))
            ring.forward([Row(2, len(prompt) - 1, (prompt[-1],), True, open=opened)])
            [first] = (await ring.answer()).rows
            out, offset, token, kept = [first.token], first.offset, first.token, []
            for turn in range(steps):
                if len(out) >= steps:
                    break
                right = plain[len(out) : len(out) + 3]
                # Right, wrong, or right then wrong: every outcome of a draft, turn by turn.
                proposals = [right, [(t + 1) % 500 for t in right], right[:1] + [(t + 1) % 500 for t in right[1:]]][turn % 3]
                if not proposals:
                    break
                ring.forward([Row(2, offset, (token, *proposals), True, verify=True)])
                answer = await ring.answer()
                assert isinstance(answer, Tokens) and not answer.failed, answer
                [s] = answer.rows
                kept.append((turn % 3, s.accepted, len(proposals)))
                out += list(proposals[: s.accepted]) + [s.token]
                offset, token = s.offset, s.token
                assert offset == len(prompt) + len(out) - 1
            ring.send(ring.first, release(2, TERM))
            # Proposals whose test needs what the row lacks are refused, not guessed at: a request
            # with penalties (its distribution would follow the proposals), a sampled one without
            # the draft's distributions.
            refused = []
            for rid, params in ((3, SamplingParams(temperature=0, repetition_penalty=1.2)), (4, SamplingParams(temperature=0.7, seed=1))):
                opened = await ring.prefill(rid, prompt, params)
                ring.forward([Row(rid, len(prompt) - 1, (prompt[-1], 5, 6), True, open=opened, verify=True)])
                refused.append(await ring.answer())
                ring.send(ring.first, release(rid, TERM))  # as the leader does after a failed row
            for _ in range(1000):  # every RELEASE applied: each stage hands it on, then applies it
                left = [len(r.sessions) for r in ring.runners.values()]
                if not any(left):
                    break
                await ring.compute.run(lambda: None)
                await asyncio.sleep(0.01)
            return plain, out[:steps], kept, refused, left, ring.metrics.registry
        finally:
            await ring.stop()

    plain, out, kept, refused, left, registry = asyncio.run(main())
    assert out == plain[: len(out)] and len(out) == steps
    assert all(n == k for kind, n, k in kept if kind == 0), kept  # right proposals are all kept
    assert all(n == 0 for kind, n, _ in kept if kind == 1), kept  # wrong ones none
    assert all(n == min(1, k) for kind, n, k in kept if kind == 2), kept
    get = registry.get_sample_value
    assert get("ringd_draft_tokens_total", {"node": "node-last", "outcome": "accepted"}) > 0
    assert get("ringd_draft_tokens_total", {"node": "node-last", "outcome": "rejected"}) > 0
    assert isinstance(refused[0], Tokens) and "without penalties or a grammar" in refused[0].failed[0][1], refused
    assert isinstance(refused[1], Tokens) and "the draft's distribution" in refused[1].failed[0][1], refused
    assert left == [0, 0, 0], left


def test_verify_rows_of_several_requests_go_batched_and_keep_mlx_lms_tokens(model, monkeypatch):
    """Verify rows of three requests, each turn right, wrong or half right, go through every stage
    as one batch of [3, 4] positions, beside a fourth request's plain row in the same micro-batch;
    the proposals not kept are cut in the batched caches (``Sessions.rewind_group``), and every
    request's tokens are still mlx-lm's (teacher-forced, as batched decode rows are checked)."""
    from mlx_lm.generate import generate_step
    import mlx.core as mx

    from ringd.stage.sessions import Sessions

    cuts_in_groups = []
    rewind_group = Sessions.rewind_group
    monkeypatch.setattr(Sessions, "rewind_group", lambda self, cuts: cuts_in_groups.append(rewind_group(self, cuts)) or cuts_in_groups[-1])
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 9, 14, 20)]
    mlx_model, _ = mlx_load(str(model))
    reference = [[t for t, _ in generate_step(mx.array(p), mlx_model, max_tokens=48)] for p in prompts]

    async def main():
        ring = StageRing(model, [1, 3])
        try:
            live, out, kept = {}, {rid: [] for rid in range(4)}, []
            for rid, prompt in enumerate(prompts):
                opened = await ring.prefill(rid, prompt, SamplingParams(temperature=0))
                ring.forward([Row(rid, len(prompt) - 1, (prompt[-1],), True, open=opened)])
                [s] = (await ring.answer()).rows
                out[rid].append(s.token)
                live[rid] = (s.offset, s.token)
            for turn in range(9):
                rows = []
                for rid in range(4):
                    offset, token = live[rid]
                    right = reference[rid][len(out[rid]) : len(out[rid]) + 3] if rid < 3 else []
                    proposals = [right, [(t + 1) % 500 for t in right], right[:1] + [(t + 1) % 500 for t in right[1:]]][(turn + rid) % 3]
                    rows.append(Row(rid, offset, (token, *proposals), True, verify=bool(proposals)))
                ring.forward(rows)
                answer = await ring.answer()
                assert isinstance(answer, Tokens) and not answer.failed and len(answer.rows) == 4, answer
                for s in answer.rows:
                    proposals = next(r.tokens[1:] for r in rows if r.rid == s.rid)
                    out[s.rid] += list(proposals[: s.accepted]) + [s.token]
                    live[s.rid] = (s.offset, s.token)
                    if s.rid < 3:
                        kept.append(((turn + s.rid) % 3, s.accepted))
            return out, kept, [rows_batched(ring.runners[s.node].metrics) for s in ring.stages]
        finally:
            await ring.stop()

    out, kept, batched = asyncio.run(main())
    assert all(n >= 9 for n in batched), batched  # every turn's verify rows as one batch, on every stage
    assert any(cuts_in_groups) and all(cuts_in_groups), cuts_in_groups
    right = [n for kind, n in kept if kind == 0]
    assert sum(right) >= 0.9 * 3 * len(right), kept  # the reference's own tokens are kept (near ties aside)
    assert all(n == 0 for kind, n in kept if kind == 1), kept
    for rid, prompt in enumerate(prompts):
        bad = teacher_forced_mismatches(mlx_model, prompt, out[rid])
        assert not bad, f"request {rid}:\n" + "\n".join(bad)


def test_mlx_s_collective_losing_a_member_answers_nothing_so_the_leader_replays(model):
    """In a group process, MLX's own collective raises "[ring] connection to a peer was lost" when
    a member dies mid-step: the group is broken (its daemon re-plans and the leader replays), so
    the stage answers nothing; before, it failed the micro-batch's requests with that message.
    Any other MLX error still fails the request, saying why."""

    class Broken:
        def __init__(self, shard, why):
            self._shard, self._why = shard, why

        def __getattr__(self, name):
            return getattr(self._shard, name)

        def __call__(self, *args, **kwargs):
            raise RuntimeError(self._why)

    async def main():
        ring = StageRing(model, [])
        runner = ring.runners[ring.first]
        shard = runner.shard
        told = []
        runner.group_broken = told.append  # a group process ends, saying why
        try:
            answers = []
            for why in ("[ring] connection to a peer was lost", "[metal] out of memory"):
                runner.shard = Broken(shard, why)
                ring.forward([Row(len(answers) + 1, 0, (1, 2, 3), True, open=Open(SamplingParams(temperature=0).to_wire()))])
                await ring.compute.run(lambda: None)  # after the micro-batch's computation
                await asyncio.sleep(0)  # and what it handed the loop to send
                answers.append(None if ring.to_leader.empty() else await ring.answer())
            return answers, told
        finally:
            await ring.stop()

    (lost, other), told = asyncio.run(main())
    assert lost is None and told == ["[ring] connection to a peer was lost"], (lost, told)
    assert isinstance(other, Tokens) and [why for _, why in other.failed] == ["node node0: RuntimeError: [metal] out of memory"], other
