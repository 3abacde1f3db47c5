"""This node's stage of the ring: receive a request's frame, compute, forward.

A FORWARD frame carries one step of one request: a prompt chunk or a fed-back
token (their ids), the position of the first of them, and, past stage 0, the
hidden states of those positions. The stage runs its layers over them on the
compute thread, keeping the request's KV caches in its ``Sessions``, then
either forwards the new hidden states to the next stage or, on the last stage,
samples (within the request's grammar, if it has one) and sends the token to
the leader. RELEASE frees the request's caches
here and travels on, behind the request's last FORWARD, so it frees every stage.

Frames are applied in arrival order on the one compute thread and their
results leave in that order. A frame that does not fit (wrong term, unknown
request, wrong position, a tensor of the wrong shape) fails that request only:
an ERROR goes to the leader and the node carries on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache

from wire.frames import Frame, FrameError, MsgType
from wire.tensors import tensor_descriptor, tensor_from_buffer, tensor_to_buffer

from .compute import ComputeThread
from .logs import RequestIdError, about, check_request_id
from .metrics import Metrics
from .placement import Plan
from .sampling import RequestSampler, SamplingError, SamplingParams
from .sessions import SessionError, Sessions
from .shard import Shard

if TYPE_CHECKING:
    from llguidance import LLTokenizer

log = logging.getLogger(__name__)

# Largest number of token positions one FORWARD frame may carry. The leader
# chunks prefill far below this; it bounds what a peer can make us compute.
MAX_CHUNK_TOKENS = 8192

# mlx-lm's generate_step clears MLX's buffer cache every 256 tokens (and after each
# prefill chunk); a stage does the same, counting the frames it computes.
CLEAR_CACHE_EVERY_STEPS = 256

# What mlx.core.quantize supports for KV caches.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
# Largest rotating KV window a request may ask for: 16 M positions, far past any context.
MAX_KV_SIZE = 2**24

Send = Callable[[str, Frame], None]


@dataclass(frozen=True)
class Step:
    """A parsed FORWARD descriptor."""

    term: int
    offset: int
    tokens: list[int]
    sample: bool
    open: dict | None
    silent: bool = False  # a replayed step: sample (the key advances) but send nothing
    reuse: tuple[int, int] | None = None  # with open: (cached prefix, positions of it to keep)
    kv: KvOptions | None = None  # with open: how this request's caches are made
    request_id: str | None = None  # with open: the client's id for the request, for this stage's log

    @classmethod
    def parse(cls, d: dict, vocab_size: int) -> "Step":
        if not isinstance(d, dict):
            raise FrameError(f"FORWARD descriptor must be an object, got {type(d).__name__}")
        def get(name: str, kind: type):
            v = d.get(name)
            if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
                raise FrameError(f"FORWARD descriptor field {name!r} must be {kind.__name__}, got {v!r}")
            return v

        tokens = get("tokens", list)
        if not 1 <= len(tokens) <= MAX_CHUNK_TOKENS:
            raise FrameError(f"FORWARD carries {len(tokens)} tokens; 1 to {MAX_CHUNK_TOKENS} allowed")
        if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise FrameError(f"FORWARD tokens must be ids in [0, {vocab_size})")
        offset = get("offset", int)
        if offset < 0:
            raise FrameError(f"FORWARD offset {offset} is negative")
        open_ = d.get("open")
        if open_ is not None and not isinstance(open_, dict):
            raise FrameError("FORWARD field 'open' must be an object")
        silent = d.get("silent", False)
        if not isinstance(silent, bool):
            raise FrameError("FORWARD field 'silent' must be a boolean")
        reuse = d.get("reuse")
        if reuse is not None:
            if (
                open_ is None
                or not isinstance(reuse, list)
                or len(reuse) != 2
                or not all(type(v) is int and v >= 0 for v in reuse)
                or reuse[1] != offset
            ):
                raise FrameError(f"FORWARD field 'reuse' must be [prefix id, positions == offset] with 'open'; got {reuse!r}")
            reuse = (reuse[0], reuse[1])
        kv = KvOptions.from_wire(d.get("kv")) if open_ is not None else None
        request_id = d.get("request_id")
        if request_id is not None:
            try:
                check_request_id(request_id if isinstance(request_id, str) else "")
            except RequestIdError as e:
                raise FrameError(f"FORWARD field 'request_id': {e}") from None
            if open_ is None:
                raise FrameError("FORWARD field 'request_id' comes with 'open' only")
        return cls(get("term", int), offset, tokens, get("sample", bool), open_, silent, reuse, kv, request_id)

    def to_descriptor(self) -> dict:
        d = {"term": self.term, "offset": self.offset, "tokens": self.tokens, "sample": self.sample}
        if self.open is not None:
            d["open"] = self.open
        if self.silent:
            d["silent"] = True
        if self.reuse is not None:
            d["reuse"] = list(self.reuse)
        if self.kv is not None:
            d["kv"] = self.kv.to_wire()
        if self.request_id is not None:
            d["request_id"] = self.request_id
        return d


def parse_release(d: object) -> tuple[int, str]:
    """A RELEASE descriptor: the term of the ring it is for, and "release", "keep" or "evict".

    ``{"term": T}`` frees a request's caches; ``"keep": true`` keeps them as a
    cached prefix; ``"evict": true`` drops a cached prefix. Anything else is a FrameError.
    """
    if not isinstance(d, dict) or not {"term"} <= set(d) <= {"term", "keep", "evict"}:
        raise FrameError(f"RELEASE descriptor must be {{term, keep?, evict?}}, got {d!r:.200}")
    term, keep, evict = d["term"], d.get("keep", False), d.get("evict", False)
    if type(term) is not int or not isinstance(keep, bool) or not isinstance(evict, bool) or keep and evict:
        raise FrameError(f"RELEASE needs an integer term and at most one of keep/evict true, got {d!r:.200}")
    return term, "evict" if evict else "keep" if keep else "release"


@dataclass(frozen=True)
class KvOptions:
    """mlx-lm's KV-cache options for one request, the same on every stage.

    ``max_size``: a RotatingKVCache of that many positions (mlx-lm's
    max_kv_size); ``bits``: caches quantized once they hold more than ``start``
    positions (mlx-lm's kv_bits, kv_group_size, quantized_kv_start).
    """

    max_size: int | None = None
    bits: int | None = None
    group_size: int = 64
    start: int = 0

    def to_wire(self) -> dict:
        return {"max_size": self.max_size, "bits": self.bits, "group_size": self.group_size, "start": self.start}

    @classmethod
    def from_wire(cls, d: object) -> "KvOptions | None":
        if d is None:
            return None
        if not isinstance(d, dict) or set(d) != {"max_size", "bits", "group_size", "start"}:
            raise FrameError(f"FORWARD field 'kv' must have max_size, bits, group_size and start; got {d!r}")
        max_size, bits, group, start = d["max_size"], d["bits"], d["group_size"], d["start"]
        if max_size is not None and not (type(max_size) is int and 1 <= max_size <= MAX_KV_SIZE):
            raise FrameError(f"kv max_size must be 1..{MAX_KV_SIZE} or null; got {max_size!r}")
        if bits is not None and bits not in KV_BITS:
            raise FrameError(f"kv bits must be one of {KV_BITS} or null; got {bits!r}")
        if group not in KV_GROUP_SIZES or type(start) is not int or start < 0:
            raise FrameError(f"kv group_size must be one of {KV_GROUP_SIZES} and start >= 0; got {group!r}, {start!r}")
        return cls(max_size, bits, group, start)


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
    ):
        self.node = node
        self.grammar_tokenizer = grammar_tokenizer
        self.metrics = metrics
        self.plan = plan
        self.shard = shard
        self.compute = compute
        self.send = send
        self.sessions = Sessions()
        successor = plan.successor(node)
        self.next_node = successor.node if successor else None
        self.leader = plan.leader
        i = plan.index_of(node)
        self._steps = 0  # frames computed, for CLEAR_CACHE_EVERY_STEPS
        # The only node this stage takes FORWARD and RELEASE frames from.
        self.predecessor = plan.leader if i == 0 else plan.stages[i - 1].node
        self._loop = asyncio.get_running_loop()

    def handle(self, frame: Frame) -> None:
        """Called on the event loop, in arrival order, for FORWARD and RELEASE frames."""
        self.compute.submit(self._apply, frame)

    def expire_idle(self) -> None:
        self.compute.submit(self._expire)

    def close(self) -> None:
        self.compute.submit(self.sessions.clear)

    # --- compute thread -------------------------------------------------------

    def describe(self, rid: int, frame: Frame | None = None, **fields) -> dict:
        """``extra`` for a line about request ``rid`` on this stage (named by its session,
        or by the frame that failed to open it)."""
        name = self.sessions.name_of(rid)
        if name is None and frame is not None and isinstance(frame.descriptor, dict):
            given = frame.descriptor.get("request_id")
            try:
                name = check_request_id(given) if isinstance(given, str) else None
            except RequestIdError:
                pass
        return about(name, self.plan.term, rid=f"{rid:x}", **fields)

    def _apply(self, frame: Frame) -> None:
        rid = frame.request_id
        try:
            if frame.type == MsgType.RELEASE:
                term, action = parse_release(frame.descriptor)
                # A RELEASE of an older ring must not free this ring's session of the same id.
                if term != self.plan.term:
                    return
                what = {"evict": "evicted", "keep": "kept for prefix reuse", "release": "released"}[action]
                log.debug("req=%x: %s on this stage", rid, what, extra=self.describe(rid))
                {"evict": self.sessions.evict, "keep": self.sessions.keep, "release": self.sessions.release}[action](rid)
                out = [(self.next_node, frame)] if self.next_node else []
            else:
                started = time.perf_counter()
                out = self._forward(frame)
                self.metrics.stage_compute(frame.descriptor.get("sample") is False, time.perf_counter() - started)
                self._tidy_memory(frame)
        except (FrameError, SessionError, SamplingError) as e:
            out = self._fail(rid, frame, str(e))
        except Exception as e:  # MLX errors (memory, shapes) fail the request, not the node
            log.exception("req=%x: stage computation failed", rid, extra=self.describe(rid, frame))
            out = self._fail(rid, frame, f"{type(e).__name__}: {e}")
        if out:
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _tidy_memory(self, frame: Frame) -> None:
        """Give MLX's buffer cache back after each prefill chunk and every few hundred steps,
        as mlx-lm's generate_step does: a big MoE stage must not page because freed
        activations of a long prompt sit in the cache."""
        self._steps += 1
        if frame.descriptor.get("sample") is False or self._steps % CLEAR_CACHE_EVERY_STEPS == 0:
            mx.clear_cache()

    def _fail(self, rid: int, frame: Frame, reason: str) -> list:
        # The error names the frame's term: the leader ignores errors of a ring it has left.
        term = frame.descriptor.get("term") if isinstance(frame.descriptor, dict) else None
        log.warning("req=%x: failed on this stage: %s", rid, reason, extra=self.describe(rid, frame, reason=reason))
        if term == self.plan.term:
            self.sessions.release(rid)
        return [(self.leader, Frame(MsgType.ERROR, rid, {"node": self.node, "message": reason, "term": term}))]

    def _forward(self, frame: Frame) -> list:
        shard, rid = self.shard, frame.request_id
        step = Step.parse(frame.descriptor, shard.info.vocab_size)
        if step.term != self.plan.term:
            raise SessionError(f"frame of plan term {step.term}, but this stage runs term {self.plan.term}")
        if step.open is not None:
            params = SamplingParams.from_wire(step.open)
            params.check_vocab(shard.info.vocab_size)
            sampler = RequestSampler(params, self.grammar_tokenizer) if shard.is_last else None
            kv = step.kv or KvOptions()
            if step.reuse is not None:
                stored = self.sessions.take(*step.reuse)
                session = self.sessions.open(rid, stored.cache, sampler, stored.tokens, kv, step.request_id)
                if sampler is not None:  # penalties see the whole history, as in a cold run
                    sampler.observe(mx.array(stored.tokens, dtype=mx.int32))
            else:
                session = self.sessions.open(rid, shard.make_cache(kv.max_size), sampler, kv=kv, name=step.request_id)
            log.debug(
                "req=%x: opened on layers [%d, %d)%s", rid, shard.start, shard.end,
                f" from a cached prefix of {step.reuse[1]} positions" if step.reuse else "",
                extra=self.describe(rid, reused=step.reuse[1] if step.reuse else 0),
            )  # fmt: skip
        else:
            session = self.sessions.get(rid)
        if step.offset != session.offset:
            raise SessionError(
                f"frame for position {step.offset}, but this stage's cache holds {session.offset} tokens"
            )
        n = len(step.tokens)
        tokens = mx.array(step.tokens, dtype=mx.int32)[None]
        hidden = None
        if not shard.is_first:
            hidden = tensor_from_buffer(frame.descriptor.get("tensor") or {}, frame.payload)
            want = (1, n, shard.info.hidden_size)
            if tuple(hidden.shape) != want or not mx.issubdtype(hidden.dtype, mx.floating):
                raise FrameError(f"hidden states of shape {tuple(hidden.shape)} {hidden.dtype}; expected {want}, floating")
        # The last stage gets the model's logits (computed only if sampled: MLX is lazy).
        h = shard(tokens, hidden, session.cache)
        session.offset += n
        session.tokens += step.tokens
        kv = session.kv
        if kv is not None and kv.bits is not None:
            # As generate_step after every model call, so the caches match mlx-lm's.
            maybe_quantize_kv_cache(session.cache, kv.start, kv.group_size, kv.bits)

        if not shard.is_last:
            mx.eval(h, [c.state for c in session.cache])
            desc = step.to_descriptor()
            desc["tensor"] = tensor_descriptor(h)
            return [(self.next_node, Frame(MsgType.FORWARD, rid, desc, tensor_to_buffer(h)))]

        session.sampler.observe(mx.array(step.tokens, dtype=mx.int32))
        if not step.sample:
            mx.eval([c.state for c in session.cache])
            return []
        # As mlx-lm's generate_step: the head over the step's positions, then the last.
        s = session.sampler.sample(h[:, -1, :])
        if s.mask_s is not None:
            self.metrics.grammar_mask.observe(s.mask_s)
        if step.silent:
            return []
        desc = {"term": step.term, "offset": session.offset, "token": s.token, "logprob": s.logprob}
        if s.top_logprobs:
            desc["top"] = s.top_logprobs
        return [(self.leader, Frame(MsgType.TOKEN, rid, desc))]

    def _expire(self) -> None:
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
