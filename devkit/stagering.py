"""StageRunners of one model in this process, frames handed over as the links would.

FORWARD and RELEASE go to the named stage's runner, TOKEN and ERROR to the
leader's queue; every frame is encoded first, as a link would, so it must fit
the wire's limits. The leader's part is the engine's: a prompt in chunks, then
each token fed back as it comes, one row per micro-batch, or several requests'
rows in one micro-batch (``decode_together``).
"""

from __future__ import annotations

import asyncio

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ringd.stage import grammar
from ringd.models.source import model_info
from ringd.stage.compute import ComputeThread
from ringd.base.metrics import Metrics
from ringd.stage.runner import StageRunner
from ringd.ring.plan import Plan, Stage
from ringd.ring.sampling import SamplingParams
from ringd.stage.shard import Shard
from ringd.ring.steps import Failure, Forward, Open, Row, Tokens, release
from wire.frames import Frame, MsgType, encode_frame

TERM = 1
ANSWER_TIMEOUT_S = 120.0  # one micro-batch's way around, on a loaded two-core machine


class StageRing:
    """``nodes``: the stages' names (node0, node1, ... by default); ``term``: the plan's; ``compute``:
    a compute thread to share with another ring (a re-planned one, with the leader's draft model)."""

    def __init__(self, model, cuts: list[int], tokenizer=None, term: int = TERM, nodes: list[str] | None = None, compute: ComputeThread | None = None):
        info = model_info(str(model))
        bounds = [0, *cuts, info.num_layers]
        names = nodes or [f"node{i}" for i in range(len(bounds) - 1)]
        self.stages = [Stage(name, f"127.0.0.1:{i + 1}", a, b) for i, (name, a, b) in enumerate(zip(names, bounds, bounds[1:]))]
        self.plan = Plan(term, names[0], info.fingerprint, info.num_layers, tuple(self.stages))
        self.shards = [Shard.load(str(model), s.start, s.end) for s in self.stages]
        self.tokenizer, self.vocab_size = tokenizer, info.vocab_size
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        self.to_leader: asyncio.Queue = asyncio.Queue()
        self.compute = compute or ComputeThread()
        self.metrics = Metrics("node-last")
        self.runners = {}
        self._batches = iter(range(1, 2**62))
        for stage, shard in zip(self.stages, self.shards):
            metrics = self.metrics if shard.is_last else Metrics(stage.node)
            source = (lambda: grammar.ll_tokenizer(tokenizer, info.vocab_size)) if shard.is_last and tokenizer is not None else None
            self.runners[stage.node] = StageRunner(stage.node, self.plan, shard, self.compute, self.send, metrics, source)

    @property
    def first(self) -> str:
        return self.stages[0].node

    def send(self, node: str, frame: Frame) -> None:
        encode_frame(frame)  # what a link would do first: the frame must fit the wire's limits
        if frame.type in (MsgType.FORWARD, MsgType.RELEASE):
            self.runners[node].handle(frame)
        else:
            self.to_leader.put_nowait(frame)

    def lead(self, engine, lose=lambda node, frame: False, ledger=None):
        """Wire ``engine`` (an ``Engine`` built with no ``send``) as this ring's leader: its FORWARD and
        RELEASE frames go to the stages, the last stage's answers to it, except the frames ``lose``
        says are lost on the way; then it gets the plan (and ``ledger``, the ring's KV room). Returns the engine."""
        last = self.stages[-1].node

        def send(node: str, frame: Frame) -> None:
            if lose(node, frame):
                return
            if frame.type in (MsgType.FORWARD, MsgType.RELEASE):
                self.runners[node].handle(frame)
            else:
                engine.on_frame(last, frame)

        engine.send = send
        for runner in self.runners.values():
            runner.send = send
        engine.set_plan(self.plan, ledger)
        return engine

    def forward(self, rows: list[Row], payload: bytes = b"") -> int:
        """``payload``: what the leader's FORWARD carries (the draft's distributions of ``probs`` rows)."""
        batch = next(self._batches)
        self.send(self.first, Forward(batch, TERM, tuple(rows)).frame(payload=payload))
        return batch

    async def answer(self) -> Tokens | Failure:
        frame = await asyncio.wait_for(self.to_leader.get(), ANSWER_TIMEOUT_S)
        return Tokens.parse(frame) if frame.type == MsgType.TOKEN else Failure.parse(frame)

    async def prefill(self, rid: int, prompt: list[int], params: SamplingParams, chunk: int = 16) -> None:
        """All but the prompt's last token, in chunks that only fill the caches (each answered, empty)."""
        opened = Open(params.to_wire())
        body = prompt[:-1]
        for start in range(0, len(body), chunk):
            self.forward([Row(rid, start, tuple(body[start : start + chunk]), False, open=opened)])
            opened = None
            answer = await self.answer()
            assert isinstance(answer, Tokens) and not answer.rows and not answer.failed, answer
        return opened  # still to send, if the prompt had one token only

    async def generate(self, prompt: list[int], params: SamplingParams, max_tokens: int, chunk: int = 16, rid: int = 7) -> list[int]:
        """One request alone, as the engine runs it: its tokens (without the end of sequence)."""
        opened = await self.prefill(rid, prompt, params, chunk)
        offset, token, out = len(prompt) - 1, prompt[-1], []
        for _ in range(max_tokens):
            self.forward([Row(rid, offset, (token,), True, open=opened)])
            opened = None
            answer = await self.answer()
            assert isinstance(answer, Tokens) and len(answer.rows) == 1, answer
            token, offset = answer.rows[0].token, offset + 1
            if token in self.eos:
                break
            out.append(token)
        self.send(self.first, release(rid, TERM))
        return out

    async def stop(self) -> None:
        await self.compute.stop()


# --- references: mlx-lm in one process, and stages chained in it ---

TOP2_TOLERANCE = 1e-3


def teacher_forced_mismatches(mlx_model, prompt: list[int], generated: list[int]) -> list[str]:
    """Positions where ``generated`` is not mlx-lm's argmax on the same sequence, margins beyond tolerance."""
    logits = mlx_model(mx.array(prompt + generated)[None])[0].astype(mx.float32)
    bad = []
    for i, token in enumerate(generated):
        row = logits[len(prompt) - 1 + i]
        top2 = mx.topk(row, 2).tolist()
        best = int(mx.argmax(row).item())
        if token != best and abs(top2[1] - top2[0]) > TOP2_TOLERANCE and row[token].item() < max(top2) - TOP2_TOLERANCE:
            bad.append(f"position {i}: got {token}, mlx-lm's argmax {best} (margin {abs(top2[1] - top2[0]):.5f})")
    return bad


def reference(model):
    cache = make_prompt_cache(model)

    def step(tokens, sample):
        out = model(mx.array(tokens)[None], cache=cache)
        if not sample:
            mx.eval([c.state for c in cache])
            return None
        out = out[:, -1, :]
        mx.eval(out)
        return out

    return step


# Greedy tokens ``greedy`` decodes: enough for a wrong mapping to show (checked to vary by callers).
GREEDY_TOKENS = 24


def greedy(
    step, prompt: list[int], until: frozenset[int] = frozenset(), chunk: int | None = None, tokens: int = GREEDY_TOKENS
) -> tuple[list[int], list[mx.array]]:
    """As mlx-lm's generate_step, on ``reference``'s or ``ring``'s step: the prompt but its last token
    as one chunk (or in chunks of ``chunk``), then token by token (``tokens`` of them, or up to one of ``until``)."""
    if chunk is None:
        step(prompt[:-1], sample=False)
    else:
        for i in range(0, len(prompt) - 1, chunk):
            step(prompt[i : i + chunk], sample=False)
    y, out_tokens, logits = prompt[-1], [], []
    for _ in range(tokens):
        out = step([y], sample=True)
        logits.append(out)
        y = mx.argmax(out, axis=-1).item()
        out_tokens.append(y)
        if y in until:
            break
    return out_tokens, logits


def ring(stages: list[Shard]):
    caches = [s.make_cache() for s in stages]

    def step(tokens, sample):
        ids = mx.array(tokens, dtype=mx.int32)[None]
        h = None
        for stage, cache in zip(stages, caches):
            h = stage(ids, h, cache)
            if not stage.is_last:  # what the ring sends on: evaluated, as bytes would be
                mx.eval(h, [c.state for c in cache])
        if not sample:
            mx.eval([c.state for cache in caches for c in cache])
            return None
        out = h[:, -1, :]
        mx.eval(out)
        return out

    return step
