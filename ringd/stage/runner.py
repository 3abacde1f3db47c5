"""This node's stage of the ring: receive a micro-batch, compute, forward.

A FORWARD frame carries one micro-batch (``steps.Forward``): rows of requests,
each a prompt chunk or a fed-back token with the position of its first token,
and, past stage 0, the hidden states of those positions. The stage runs its
layers over each row on the compute thread, keeping every request's KV caches
in its ``Sessions``, then either forwards the new hidden states to the next
stage or, on the last stage, samples each row that asks (within its request's
grammar, if it has one) and answers the leader with one TOKEN frame for the
micro-batch (``steps.Tokens``). An embedding's rows are pooled there instead
(``pooling.py``): its last row is answered with the pooled vector. RELEASE frees
a request's caches here and travels on, behind the request's last row, so it
frees every stage.

A verify row (speculative decoding) carries a fed-back token and a draft
model's proposals (and, for a sampled request, the draft's distribution for
each): every stage computes all their positions in one pass, batched with the
micro-batch's other verify rows of as many positions (as decode rows are with
each other); the last stage draws every position at once
(``RequestSampler.verify``) and answers how many proposals it kept and the token
after them. Every stage, the last too, learns it from the request's next row,
which starts where the kept positions end, and cuts the rest then: in the
batched caches where the group's rows come as they were
(``Sessions.rewind_group``), else each alone (``Sessions.rewind``).

Frames are applied in arrival order on the one compute thread and their
results leave in that order. A row that does not fit (unknown request, wrong
position, a sampler's error) fails that request only: it leaves the
micro-batch and is named in its ``failed`` list, so the leader hears it with
the micro-batch's answer. A frame that does not parse, or is for another ring,
fails the micro-batch (an ERROR to the leader). The node carries on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache

from ringd.ring.plan import Plan
from ringd.base.logs import about
from ringd.base.metrics import Metrics
from ringd.stage.compute import ComputeThread
from ringd.stage.pooling import Pooling
from ringd.ring.sampling import SamplingError, SamplingParams
from ringd.stage.sampling import RequestSampler, draw_greedy
from ringd.stage.sessions import SessionError, Sessions
from ringd.stage.shard import Shard
from ringd.stage.tensorgroup import GroupError, lost_member
from ringd.stage.vision import Vision, VisionError
from ringd.stage.vlmtext import text_rope
from ringd.ring.media import Media
from ringd.ring.steps import Embedded, Failure, Forward, KvOptions, Row, Sampled, Tokens, draft_distribution, pack_ropes, parse_release, term_of
from wire.frames import Frame, FrameError, MsgType
from wire.tensors import tensor_to_buffer, wire_bits

if TYPE_CHECKING:
    from llguidance import LLTokenizer

log = logging.getLogger(__name__)

# mlx-lm's generate_step clears MLX's buffer cache every 256 tokens (and after each
# prefill chunk); a stage does the same, counting the frames it computes.
CLEAR_CACHE_EVERY_STEPS = 256
# Prompts' images held on the first stage for rows that have not opened yet (each MEDIA
# frame comes just before its request's first row, so one or two wait at a time); past
# either bound the oldest go, and their requests fail as they open, saying so.
MAX_WAITING_MEDIA = 64
MAX_WAITING_MEDIA_BYTES = 512 * 2**20

Send = Callable[[str, Frame], None]
# From the compute thread: a frame to its node at once, over its link (True), or False where
# it must go through the event loop (``Send`` there).
SendNow = Callable[[str, Frame], bool]


class BatchError(Exception):
    """A micro-batch that fails as a whole (a ring it is not for, hidden states that do not fit its rows)."""

    def __init__(self, message: str, batch: Forward):
        super().__init__(message)
        self.batch = batch


class StageRunner:
    """Runs ``shard`` as stage ``plan.index_of(node)`` of ``plan``.

    ``grammar_tokenizer``: on the last stage, llguidance's tokenizer for the model, asked
    for (on the compute thread) by the first request with a grammar; without it such a
    request fails here.
    """

    def __init__(
        self,
        node: str,
        plan: Plan,
        shard: Shard,
        compute: ComputeThread,
        send: Send,
        metrics: Metrics,
        grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
        send_now: SendNow | None = None,
        vision: Vision | None = None,
    ):
        self.node = node
        self.grammar_tokenizer = grammar_tokenizer
        self.metrics = metrics
        self.plan = plan
        self.shard = shard
        self.compute = compute
        self.send = send
        # A frame sent from the compute thread as it is computed skips the hand-off back to the
        # event loop (a wake-up of it each hop) and the loop's routing of it.
        self.send_now = send_now
        self.sessions = Sessions()
        # On the first stage of a model that sees: its vision tower, and the images of requests
        # whose first row has not come yet (MEDIA), by request, oldest first.
        self.vision = vision
        self._media: dict[int, tuple[float, Media]] = {}
        self._ropes: dict[int, np.ndarray] = {}  # the micro-batch's rows' three-axis positions, by request
        successor = plan.successor(node)
        self.next_node = successor.node if successor else None
        self.leader = plan.leader
        self._steps = 0  # frames computed, for CLEAR_CACHE_EVERY_STEPS
        self._parsed: Forward | None = None  # the micro-batch being computed, once it parsed
        self.predecessor = plan.predecessor(node)
        self._loop = asyncio.get_running_loop()
        # A group process's (groupworker.py): told, on the compute thread, that MLX's collective
        # lost a member, so the process ends saying why and its daemon's stage is broken.
        self.group_broken: Callable[[str], None] | None = None

    def handle(self, frame: Frame) -> None:
        """Called on the event loop, in arrival order, for FORWARD and RELEASE frames."""
        self.compute.submit(self.apply, frame)

    def expire_idle(self) -> None:
        self.compute.submit(self._expire)

    def close(self) -> None:
        self.compute.submit(self.sessions.clear)

    # --- compute thread -------------------------------------------------------

    def describe(self, rid: int, row: Row | None = None, **fields) -> dict:
        """``extra`` for a line about request ``rid`` on this stage (named by its session,
        or by the row that failed to open it)."""
        name = self.sessions.name_of(rid)
        if name is None and row is not None and row.open is not None:
            name = row.open.request_id
        return about(name, self.plan.term, rid=f"{rid:x}", **fields)

    def apply(self, frame: Frame) -> None:
        """On the compute thread: ``frame`` computed (or its session released) and the output sent on."""
        self._parsed = None
        try:
            if frame.type == MsgType.RELEASE:
                out = self._release(frame)
            elif frame.type == MsgType.MEDIA:
                out = self._keep_media(frame)
            else:
                started = time.perf_counter()
                out, prefill = self._forward(frame)
                self.metrics.stage_compute(prefill, time.perf_counter() - started)
                self._tidy_memory(prefill)
        except (FrameError, BatchError) as e:
            out = self._fail_batch(frame, str(e), getattr(e, "batch", None))
        except GroupError as e:
            # The tensor-parallel group broke (its stage host says so): nothing is answered, and
            # the leader replays the micro-batch's requests on its next plan.
            out = []
            if lost_member(e.__cause__):
                self._collective_lost(frame, e.__cause__)
        except Exception as e:  # MLX errors (memory, shapes) fail the micro-batch, not the node
            if lost_member(e):  # MLX's own collective lost a member: the group broke, as above
                out = []
                self._collective_lost(frame, e)
            else:
                log.exception("batch=%x: stage computation failed", frame.request_id)
                out = self._fail_batch(frame, f"{type(e).__name__}: {e}", self._parsed)
        if self.send_now is not None:
            while out and self.send_now(*out[0]):
                out = out[1:]
        if out:  # in order: once one frame takes the loop's way, the rest follow it
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _collective_lost(self, frame: Frame, e: BaseException) -> None:
        """MLX's own collective (a group process's) lost a member mid-step: the group cannot heal,
        so the process is told to end (``group_broken``) and its daemon's stage is broken."""
        log.warning("batch=%x: the group's collective broke (%s); the ring is re-planned without answering", frame.request_id, e)
        if self.group_broken is not None:
            self.group_broken(str(e))

    def _release(self, frame: Frame) -> list:
        rid = frame.request_id
        term, action = parse_release(frame.descriptor)
        # A RELEASE of an older ring must not free this ring's session of the same id.
        if term != self.plan.term:
            return []
        self._media.pop(rid, None)
        what = {"evict": "evicted", "keep": "kept for prefix reuse", "release": "released"}[action]
        log.debug("req=%x: %s on this stage", rid, what, extra=self.describe(rid))
        {"evict": self.sessions.evict, "keep": self.sessions.keep, "release": self.sessions.release}[action](rid)
        return [(self.next_node, frame)] if self.next_node else []

    def _keep_media(self, frame: Frame) -> list:
        """A request's images (MEDIA), kept for its first row; one of another ring, or at a stage
        that is not the first, is dropped (the request fails as it opens, saying its images are missing)."""
        media = Media.parse(frame)
        if media.term != self.plan.term or not self.shard.is_first:
            log.warning("req=%x: dropping the images of a request of ring %d at layers [%d, %d) of ring %d",
                        media.rid, media.term, self.shard.start, self.shard.end, self.plan.term)  # fmt: skip
            return []
        self._media.pop(media.rid, None)
        self._media[media.rid] = (time.monotonic(), media)
        held = sum(m.nbytes for _, m in self._media.values())
        while len(self._media) > MAX_WAITING_MEDIA or held > MAX_WAITING_MEDIA_BYTES:
            rid, (_, old) = next(iter(self._media.items()))
            del self._media[rid]
            held -= old.nbytes
            log.warning("req=%x: its images are dropped: more wait for their first rows than %d (%d MiB)",
                        rid, MAX_WAITING_MEDIA, MAX_WAITING_MEDIA_BYTES // 2**20)  # fmt: skip
        return []

    def _tidy_memory(self, prefill: bool) -> None:
        """Give MLX's buffer cache back after each prefill chunk and every few hundred steps,
        as mlx-lm's generate_step does: a big MoE stage must not page because freed
        activations of a long prompt sit in the cache."""
        self._steps += 1
        if prefill or self._steps % CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()

    def _fail_batch(self, frame: Frame, reason: str, batch: Forward | None) -> list:
        """The whole micro-batch fails: its rows' sessions go (if it parsed), and the leader hears it
        (ERROR). A FORWARD that did not parse frees nothing: its sessions expire if they were meant."""
        term = term_of(frame)
        log.warning("batch=%x: failed on this stage: %s", frame.request_id, reason, extra=about(None, self.plan.term, batch=f"{frame.request_id:x}", reason=reason))
        if frame.type in (MsgType.RELEASE, MsgType.MEDIA):
            # A malformed RELEASE frees nothing (the session expires if it was meant); a malformed
            # MEDIA is not kept (its request fails as it opens, its images missing).
            return []
        if batch is not None and term == self.plan.term:  # the leader ignores errors of a ring it has left
            for row in batch.rows:
                self.sessions.release(row.rid)
        return [(self.leader, Failure(frame.request_id, term, self.node, reason).frame())]

    def _forward(self, frame: Frame) -> tuple[list, bool]:
        """Run the micro-batch's rows through this stage's layers; returns what to send and
        whether it filled caches only (a prompt chunk: MLX's buffer cache is given back after)."""
        shard = self.shard
        batch = Forward.parse(frame, shard.info.vocab_size)
        if batch.term != self.plan.term:
            raise BatchError(f"a micro-batch of plan term {batch.term}, but this stage runs term {self.plan.term}", batch)
        self._parsed = batch  # what fails, if the computation does
        hidden = None
        if not shard.is_first and batch.rows:
            try:
                hidden = batch.hidden(frame.payload)
            except FrameError as e:
                raise BatchError(str(e), batch) from None
            if batch.hidden_size != shard.info.hidden_size or not mx.issubdtype(hidden.dtype, mx.floating):
                raise BatchError(f"hidden states of size {batch.hidden_size}, {hidden.dtype}; expected {shard.info.hidden_size}, floating", batch)
        failed = list(batch.failed)
        drafts = batch.draft_probs(frame.payload, shard.info.vocab_size) if batch.drafted else {}
        # Three-axis positions: those the rows brought; the first stage adds its prompts' (``_rope``).
        self._ropes = batch.ropes(frame.payload) if batch.rope_bytes else {}
        # Blocks of rows computed together: (rows, their outputs [rows, positions, H or V]).
        blocks = self._batched(batch.rows, hidden, failed)
        if blocks is None:
            blocks = self._one_by_one(batch.rows, hidden, failed)
        prefill = any(not row.sample for row in batch.rows)
        rows = tuple(replace(row, rope=True) if row.rid in self._ropes else row for block, _ in blocks for row in block)
        if not shard.is_last:
            out = Forward(batch.batch, batch.term, rows, tuple(failed))
            if not rows:
                return [(self.next_node, out.frame())], prefill
            # [1, N, H] in row order: a batched block's [B, L, H] is that already, reshaped.
            flat = [h.reshape(1, -1, h.shape[-1]) for _, h in blocks]
            h = mx.concatenate(flat, axis=1) if len(flat) > 1 else flat[0]
            bits = wire_bits(h)  # evaluated with the step: one evaluation per frame
            # A prompt chunk's caches are evaluated with it, as mlx-lm's prefill does; a decode
            # step's are part of its output's graph already.
            mx.eval(bits, self.sessions.states(row.rid for row in rows) if prefill else [])
            payload = tensor_to_buffer(bits)
            if drafts or self._ropes:  # the draft's distributions and positions go on with their rows, in the rows' order now
                payload = b"".join([payload, *(drafts[row.rid] for row in rows if row.probs), pack_ropes(rows, self._ropes)])
            return [(self.next_node, out.frame(h, payload))], prefill
        sampled, embedded = self._sample(blocks, failed, drafts)
        return [(self.leader, Tokens(batch.batch, batch.term, sampled, tuple(failed), embedded).frame())], prefill

    def _one_by_one(self, rows: tuple[Row, ...], hidden: mx.array | None, failed: list) -> list[tuple[tuple[Row], mx.array]]:
        """Each row through the layers on its own: prompt chunks, a request's first row, and
        rows whose caches cannot be batched. A block of one row each."""
        done, at = [], 0
        for row in rows:
            n = len(row.tokens)
            x = hidden[:, at : at + n] if hidden is not None else None
            at += n
            try:
                done.append(((row,), self._row(row, x)))
                self.metrics.batch_rows.observe(1)
            except (FrameError, SessionError, SamplingError, VisionError) as e:
                failed.append(self._fail_row(row, str(e)))
            except GroupError:
                raise  # the stage's, not the request's
            except Exception as e:  # MLX errors (memory, shapes) fail the request, not the node
                if lost_member(e):
                    raise GroupError(str(e)) from e  # the stage's, not the request's
                log.exception("req=%x: stage computation failed", row.rid, extra=self.describe(row.rid, row))
                failed.append(self._fail_row(row, f"{type(e).__name__}: {e}"))
        return done

    def _batched(self, rows: tuple[Row, ...], hidden: mx.array | None, failed: list) -> list[tuple[tuple[Row, ...], mx.array]] | None:
        """Decode rows of requests open here through the layers in batches, their caches merged
        (``Sessions.batched``): rows of one token together, and verify rows of as many positions
        together (a block each, in the order their first rows come); None where the rows must go
        one by one."""
        if not self.shard.batchable or len(rows) < 2 or any(
            (len(row.tokens) != 1 and not row.verify) or row.open is not None or self._pools(row) or self._sees(row) for row in rows
        ):
            return None
        starts, at = {}, 0
        for row in rows:
            starts[row.rid] = at
            at += len(row.tokens)
        by_length: dict[int, list[Row]] = {}
        for row in rows:
            by_length.setdefault(len(row.tokens), []).append(row)
        blocks = []
        for same in by_length.values():
            blocks += self._block(tuple(same), hidden, [starts[row.rid] for row in same], failed)
        return blocks

    def _block(self, rows: tuple[Row, ...], hidden: mx.array | None, starts: list[int], failed: list) -> list[tuple[tuple[Row, ...], mx.array]]:
        """Rows of L positions each (starting at ``starts`` in ``hidden``) through the layers as one
        batch: one block [B, L, H or V]; one by one where fewer than two fit or their caches do not merge."""
        L = len(rows[0].tokens)

        def alone(part: tuple[Row, ...], where: list[int]) -> list:
            x = None if hidden is None else mx.concatenate([hidden[:, i : i + L] for i in where], axis=1)
            return self._one_by_one(part, x, failed) if part else []

        self._cut_together(rows)
        fit, where = [], []
        for row, start in zip(rows, starts):  # rows that do not fit their sessions fail before anything runs
            try:
                self._at_row(self.sessions.get(row.rid), row)
            except SessionError as e:
                failed.append(self._fail_row(row, str(e)))
                continue
            fit.append(row)
            where.append(start)
        if len(fit) < 2:
            return alone(tuple(fit), where)
        cache = self.sessions.batched(tuple(row.rid for row in fit))
        if cache is None:
            return alone(tuple(fit), where)
        tokens = mx.array([row.tokens for row in fit], dtype=mx.int32)  # [B, L]
        positions = None
        if self.shard.three_axis:  # [3, B, L]: each row's own, or its index three times
            ropes = [self._rope(row, self.sessions.get(row.rid)) for row in fit]
            positions = mx.array(np.stack([r if r is not None else text_rope(row.offset, L) for r, row in zip(ropes, fit)], axis=1))
        x = None
        if hidden is not None:  # [B, L, H]: every row's, or those that fit
            if len(fit) * L == hidden.shape[1]:
                x = hidden.reshape(len(fit), L, hidden.shape[-1])
            else:
                x = mx.concatenate([hidden[:, i : i + L] for i in where], axis=0)
        h = self.shard(tokens, x, cache, positions=positions)
        self.metrics.batch_rows.observe(len(fit))
        for i, row in enumerate(fit):
            session = self.sessions.get(row.rid)
            session.offset += L
            session.tokens += row.tokens
            session.provisional = L - 1 if row.verify else 0
            if self.shard.is_last:
                session.sampler.observe(tokens[i])
        return [(tuple(fit), h)]

    def _cut_together(self, rows: tuple[Row, ...]) -> None:
        """Where ``rows`` are the requests of one group in its order and some start before their
        caches end (proposals their last verify rows left that were not kept), cut those in the
        group's batched caches at once; anything else is cut (or refused) row by row (``_at_row``)."""
        cuts = {}
        for row in rows:
            try:
                cuts[row.rid] = self.sessions.get(row.rid).offset - row.offset
            except SessionError:
                return
        if any(cuts.values()):
            self.sessions.rewind_group(cuts)

    def _pools(self, row: Row) -> bool:
        """Whether ``row`` is an embedding's on this (the last) stage: its hidden states, not logits."""
        try:
            return self.shard.is_last and self.sessions.get(row.rid).pool is not None
        except SessionError:
            return False  # it fails where it is computed, with its reason

    def _sees(self, row: Row) -> bool:
        """Whether ``row`` starts from its prompt's embeddings (a prompt with images, on the first stage)."""
        try:
            return self.sessions.get(row.rid).prompt is not None
        except SessionError:
            return False

    def _fail_row(self, row: Row, reason: str) -> tuple[int, str]:
        log.warning("req=%x: failed on this stage: %s", row.rid, reason, extra=self.describe(row.rid, row, reason=reason))
        self.sessions.release(row.rid)
        return row.rid, f"node {self.node}: {reason}"

    def _at_row(self, session, row: Row):
        """The session with its caches where ``row`` starts: cut back past the proposals its last
        row left that were not kept; a SessionError if the row does not start there."""
        if row.offset < session.offset:
            session = self.sessions.rewind(row.rid, row.offset)
        if row.offset != session.offset:
            raise SessionError(f"a row for position {row.offset}, but this stage's cache holds {session.offset} tokens")
        return session

    def _row(self, row: Row, hidden: mx.array | None) -> mx.array:
        """One row through this stage's layers (lazily): the hidden states, or on the last stage the logits."""
        shard, rid = self.shard, row.rid
        if row.open is not None:
            session = self._open(row)
        else:
            session = self.sessions.solo(rid)
        session = self._at_row(session, row)
        tokens = mx.array(row.tokens, dtype=mx.int32)[None]
        rope = self._rope(row, session)
        embeddings = None
        if session.prompt is not None:  # a prompt with images: its chunks start from its embeddings
            embeddings = session.prompt.chunk(row.offset, row.tokens, self.vision.embed)
            if session.prompt.done_after(row.offset, len(row.tokens)):
                session.prompt = None
        # The last stage gets the model's logits (computed only if sampled: MLX is lazy), or for an
        # embedding the final hidden states, pooled as they come.
        positions = None if rope is None else mx.array(rope)[:, None, :]
        h = shard(tokens, hidden, session.cache, head=session.pool is None, embeddings=embeddings, positions=positions)
        if session.pool is not None and shard.is_last:
            session.pool.add(h)
        session.offset += len(row.tokens)
        session.tokens += row.tokens
        session.provisional = len(row.tokens) - 1 if row.verify else 0
        kv = session.kv
        if kv is not None and kv.bits is not None:
            # As generate_step after every model call, so the caches match mlx-lm's.
            maybe_quantize_kv_cache(session.cache, kv.start, kv.group_size, kv.bits)
        if session.sampler is not None:
            session.sampler.observe(tokens[0])
        return h

    def _open(self, row: Row):
        shard, rid, opened = self.shard, row.rid, row.open
        params = SamplingParams.from_wire(opened.params)
        params.check_vocab(shard.info.vocab_size)
        sampler = RequestSampler(params, self.grammar_tokenizer) if shard.is_last and opened.pool is None else None
        kv = opened.kv or KvOptions()
        if opened.reuse is not None:
            stored = self.sessions.take(*opened.reuse)
            session = self.sessions.open(rid, stored.cache, sampler, stored.tokens, kv, opened.request_id)
            if sampler is not None:  # penalties see the whole history, as in a cold run
                sampler.observe(mx.array(stored.tokens, dtype=mx.int32))
        else:
            session = self.sessions.open(rid, shard.make_cache(kv.max_size), sampler, kv=kv, name=opened.request_id)
            if opened.pool is not None and shard.is_last:
                session.pool = Pooling(opened.pool)
        if opened.images and shard.is_first:
            session.prompt = self._prompt(row)
            if session.prompt.positions is not None:
                session.shift = session.prompt.shift
        log.debug(
            "req=%x: opened on layers [%d, %d)%s", rid, shard.start, shard.end,
            f" from a cached prefix of {opened.reuse[1]} positions" if opened.reuse else "",
            extra=self.describe(rid, reused=opened.reuse[1] if opened.reuse else 0),
        )  # fmt: skip
        return session

    def _rope(self, row: Row, session) -> np.ndarray | None:
        """``row``'s three-axis positions [3, n] where they are not its index three times: those the
        row brought, or on the first stage, for a prompt with images, the prompt's (its images'
        tokens placed by time, row and column) and past it each index plus the prompt's shift."""
        got = self._ropes.get(row.rid)
        if got is None and session.shift is not None:
            n = len(row.tokens)
            if session.prompt is not None:
                got = session.prompt.rope(row.offset, n)
            else:
                got = text_rope(row.offset + session.shift, n)
            self._ropes[row.rid] = got
        return got

    def _prompt(self, row: Row):
        """The input embeddings of a prompt with images (its MEDIA came before its first row)."""
        _, media = self._media.pop(row.rid, (None, None))
        if media is None:
            raise SessionError(f"its {row.open.images} images did not arrive before its first row (or waited too long)")
        if len(media.images) != row.open.images:
            raise SessionError(f"its first row says {row.open.images} images; {len(media.images)} came")
        if self.vision is None:
            raise SessionError("this stage holds no vision tower for the model's images (is mlx-vlm installed on every Mac?)")
        return self.vision.prompt(media)

    def _sample(
        self, blocks: list[tuple[tuple[Row, ...], mx.array]], failed: list, drafts: dict[int, memoryview]
    ) -> tuple[tuple[Sampled, ...], tuple[Embedded, ...]]:
        """The last stage after the micro-batch's rows (their logits): each row that samples draws its
        token, and all of it, with the caches of rows that only fill them, is evaluated at once: one
        round trip to MLX's thread per micro-batch, not one per row. Plain greedy rows of a batched
        block are drawn together (``draw_greedy``). A verify row draws every position at once
        (``RequestSampler.verify``; ``drafts``: the draft's distributions of sampled requests' rows).
        An embedding's last row gives its pooled vector."""
        sampled, draws, greedy, filled, pooled, verified = [], [], [], [], [], []
        for rows, out in blocks:
            plain = []
            for i, row in enumerate(rows):
                if not row.sample:
                    filled.append(row.rid)
                    continue
                session = self.sessions.get(row.rid)
                if session.pool is not None:
                    pooled.append((row, session, session.pool.vector()))
                    continue
                logits = out[i : i + 1] if len(rows) > 1 else out
                try:
                    if row.verify:
                        probs = draft_distribution(drafts[row.rid], len(row.tokens) - 1, self.shard.info.vocab_size) if row.probs else None
                        verified.append((row, session, session.sampler.verify(logits[0], row.tokens[1:], probs)))
                    elif len(rows) > 1 and session.sampler.plain:
                        plain.append((i, row, session))
                    else:  # as mlx-lm's generate_step: the head over the row's positions, then the last
                        draws.append((row, session, session.sampler.draw(logits[:, -1, :])))
                except (SamplingError, FrameError) as e:
                    failed.append(self._fail_row(row, str(e)))
            if plain:
                at = [i for i, _, _ in plain]
                last = out[:, -1, :] if len(at) == len(rows) else out[mx.array(at), -1, :]
                greedy.append((plain, *draw_greedy(last)))
        arrays = [a for _, _, draw in draws for a in draw.arrays] + [a for _, tokens, logprobs in greedy for a in (tokens, logprobs)]
        arrays += [vector for _, _, vector in pooled] + [a for _, _, v in verified for a in v.arrays]
        mx.eval(arrays, self.sessions.states(filled + [row.rid for row, _, _ in pooled]))
        for row, session, draw in draws:
            s = draw.result()
            if s.mask_s is not None:
                self.metrics.grammar_mask.observe(s.mask_s)
            if not row.silent:
                sampled.append(Sampled(row.rid, session.offset, s.token, s.logprob, tuple(s.top_logprobs)))
        for plain, tokens, logprobs in greedy:
            for (_, row, session), token, (logprob,) in zip(plain, tokens.tolist(), logprobs.tolist()):
                if not row.silent:
                    sampled.append(Sampled(row.rid, session.offset, token, logprob))
        for row, session, verification in verified:
            # The rejected proposals stay in the caches until the request's next row cuts them.
            kept, s = verification.result(session.sampler)
            self.metrics.draft_tokens(kept, len(row.tokens) - 1 - kept)
            sampled.append(Sampled(row.rid, row.offset + 1 + kept, s.token, s.logprob, (), kept))
        embedded = tuple(Embedded(row.rid, session.offset, np.array(vector)) for row, session, vector in pooled)
        return tuple(sampled), embedded

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, (since, _) in list(self._media.items()):
            if now - since > self.sessions.idle_timeout_s:
                del self._media[rid]
        for session in self.sessions.expire():
            rid = session.request_id
            log.info(
                "req=%x: session expired after %.0f s idle", rid, self.sessions.idle_timeout_s,
                extra=about(session.name, self.plan.term, rid=f"{rid:x}"),
            )  # fmt: skip

    # --- event loop -----------------------------------------------------------

    def _deliver(self, out: list) -> None:
        for dest, frame in out:
            self.send(dest, frame)
