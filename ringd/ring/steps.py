"""The ring's per-request messages, built and parsed in one place for the leader and the stages.

A FORWARD carries one micro-batch: the leader's ``rows`` (one per request: a
prompt chunk or a fed-back token, the position of its first token, whether the
last stage samples after it) and, past stage 0, the hidden states of every row's
positions, concatenated in row order (``[1, N, H]``, N the rows' tokens in all).
The frame's request id is the micro-batch's id. A request's first row opens it
on every stage (``Open``: sampling parameters, KV options, a cached prefix to
start from, the client's request id for logs).

A stage that fails a row (an unknown request, a position its caches do not
hold, a sampler's error) drops it from the FORWARD it passes on and names it in
``failed``, so the micro-batch still comes back whole: the last stage's TOKENS
frame answers every row, with a token or with the reason it failed. A FORWARD
that cannot be parsed at all fails the whole micro-batch: an ERROR frame with
the micro-batch's id goes to the leader.

A request opened with a ``pool`` (an embedding) is pooled, not sampled: the last
stage keeps the pooling of its final hidden states (after the model's norm) over
its rows, and its last row (the one that would sample) is answered with the pooled
vector (``Embedded``), in the TOKEN frame's payload.

A sampled request's verify row (speculative sampling) carries, after the hidden
states in the payload, the draft's distribution q for each of its proposals
(``[k, V]`` float32, the row flagged ``PROBS``), for the last stage's test
min(1, p/q); every stage passes them on with the row.

RELEASE (one request's caches: free them, keep them as a cached prefix, or drop
a cached prefix) follows the request's last row around the ring.

FORWARD and TOKEN go every step, so their descriptors are a fixed binary layout
(``_FORWARD``, ``_ROW``, ...; wire.frames.RAW_TYPES), not JSON: only a request's
``Open``, once, is JSON inside it. Every field a peer sends is checked here
against a named limit, and anything malformed is a ``FrameError`` that names the
field.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ringd.base.logs import RequestIdError, check_request_id
from ringd.ring.media import MAX_IMAGES
from wire.frames import MAX_REQUEST_ID, Frame, FrameError, MsgType
from wire.tensors import CODE_DTYPES, DTYPE_CODES, tensor_from_bits

# Largest number of token positions one FORWARD may carry (all rows together). The
# leader chunks prefill far below this; it bounds what a peer can make a stage compute.
MAX_STEP_TOKENS = 8192
# Rows in one micro-batch: at least the scheduler's max_rows, and few enough that as many
# rows, each opening its request, fit a descriptor (wire.frames.MAX_DESCRIPTOR_BYTES);
# bounds the per-row work (samplers, caches looked up) one frame can ask of a stage.
MAX_ROWS = 64
# A failed row's reason, as carried back to the leader: enough for a message, bounded.
MAX_REASON_CHARS = 500
# Alternatives per sampled position (OpenAI allows at most 20; sampling.MAX_TOP_LOGPROBS).
MAX_TOP = 20
# How an embedding pools a request's final hidden states (llama.cpp's pooling types that
# give one vector: mean, its first token's (CLS), its last token's).
POOLINGS = ("mean", "cls", "last")
# Widest pooled vector a TOKEN frame may carry: past any model's hidden size (16384 for the
# largest open models), bounds what a peer's frame makes the leader read.
MAX_EMBEDDING_WIDTH = 65536

# What mlx.core.quantize supports for KV caches.
KV_BITS = (2, 3, 4, 5, 6, 8)
KV_GROUP_SIZES = (32, 64, 128)
# mlx-lm's kv_group_size when none is given.
DEFAULT_KV_GROUP_SIZE = 64
# Largest rotating KV window a request may ask for: 16 M positions, far past any context.
MAX_KV_SIZE = 2**24

# Row flags, on the wire as one integer.
SAMPLE = 1  # the last stage samples after this row
SILENT = 2  # a replayed step: sample (the key advances) but send nothing back
VERIFY = 4  # tokens[1:] are a draft's proposals: sample after each position, keep those that agree
PROBS = 8  # the payload carries the draft's distribution for each proposal (a sampled request's)
# The payload carries the row's three-axis positions ([3, n] int32, after the drafts'
# distributions): a prompt with images on a decoder that places positions by time, row and
# column (stage/vlmtext.py). The first stage sets it; every stage after reads them.
ROPE = 16
FLAGS = tuple(f | rope for f in (0, SAMPLE, SAMPLE | SILENT, SAMPLE | VERIFY, SAMPLE | VERIFY | PROBS) for rope in (0, ROPE))
# A three-axis position's largest value: past any context (a position grows by one a token
# at most), so a peer's numbers stay within what RoPE computes in float32 without loss.
MAX_ROPE_POSITION = 2**24
# A sampled proposal's distribution q travels as the DRAFT_SUPPORT tokens the draft finds likeliest
# (ids, and their probabilities) and one more probability, its tail's: the rest of q's mass
# spread evenly over the other tokens. The draft draws from that q' (``cut_draft``, then
# ``dense_draft``), and the last stage rebuilds the same q' from the same float32 values, so it
# tests each proposal against exactly the distribution it was drawn from: speculative sampling
# keeps the target's distribution exact for any such q, and the cut costs acceptances only where
# q' differs from q. The even tail keeps a flat q's acceptances (a cut that dropped it kept 0.01
# of a flat model's proposals, tools/bench) and costs little where q is peaked. Dense, q was a whole
# vocabulary per proposal at every hop: 600 KiB for a 152k vocabulary, 1.8 MB a step of 3
# proposals (the default), ~15 ms a hop on 1 GbE; cut, 2 KiB a proposal.
DRAFT_SUPPORT = 256
PROBS_DTYPE = mx.float32


def draft_support(vocab_size: int) -> int:
    """Tokens a proposal's distribution names: DRAFT_SUPPORT, or a smaller vocabulary's all."""
    return min(DRAFT_SUPPORT, vocab_size)


def draft_bytes(proposals: int, vocab_size: int) -> int:
    """Bytes of ``proposals`` draft distributions on the wire: per proposal its support's
    uint32 ids and float32 probabilities, and its tail's float32."""
    return proposals * (draft_support(vocab_size) * (4 + PROBS_DTYPE.size) + PROBS_DTYPE.size)


def cut_draft(q: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Distributions q [k, V] as they travel, lazily: each one's ``draft_support`` likeliest
    tokens [k, S] (uint32), their probabilities [k, S], and the tail [k]: the rest of the mass
    over each other token (zero when the support is the whole vocabulary)."""
    vocab = q.shape[-1]
    support = draft_support(vocab)
    if support == vocab:
        return mx.broadcast_to(mx.arange(vocab, dtype=mx.uint32), q.shape), q, mx.zeros(q.shape[:1], dtype=q.dtype)
    ids = mx.argpartition(-q, support - 1, axis=-1)[:, :support].astype(mx.uint32)
    head = mx.take_along_axis(q, ids, axis=-1)
    return ids, head, mx.maximum(1 - head.sum(axis=-1), 0) / (vocab - support)


def dense_draft(ids: mx.array, probs: mx.array, tails: mx.array, vocab_size: int) -> mx.array:
    """The distributions [k, vocab_size] a proposal is drawn from and tested against: ``probs`` at
    ``ids`` ([k, S] each), each row's tail (``tails``, [k]) everywhere else."""
    rest = mx.zeros((ids.shape[0], vocab_size), dtype=PROBS_DTYPE) + tails.astype(PROBS_DTYPE)[:, None]
    return mx.put_along_axis(rest, ids, probs.astype(PROBS_DTYPE), axis=-1)


def pack_draft(ids: np.ndarray, probs: np.ndarray, tails: np.ndarray) -> bytes:
    """A row's draft distributions as they travel: its support's token ids [k, S] (uint32), their
    probabilities [k, S] (float32), then the tails [k] (float32)."""
    return b"".join(np.ascontiguousarray(a, dtype=t).tobytes() for a, t in ((ids, "<u4"), (probs, "<f4"), (tails, "<f4")))


def _int(v: object, name: str, lo: int = 0, hi: int = MAX_REQUEST_ID) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise FrameError(f"{name} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _reason(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise FrameError(f"{name} must be a string, got {type(v).__name__}")
    return v[:MAX_REASON_CHARS]


class _Reader:
    """Reads a binary descriptor front to back; every read is checked against what is left."""

    def __init__(self, data: bytes, what: str):
        self.data, self.at, self.what = data, 0, what

    def take(self, layout: struct.Struct) -> tuple:
        if self.at + layout.size > len(self.data):
            raise FrameError(f"{self.what} descriptor ends early, at byte {self.at} of {len(self.data)}")
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def raw(self, n: int, name: str) -> bytes:
        if self.at + n > len(self.data):
            raise FrameError(f"{self.what} {name} of {n} bytes runs past the descriptor's end")
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def ints(self, n: int, name: str) -> tuple[int, ...]:
        return struct.unpack_from(f"<{n}I", self.raw(4 * n, name))

    def done(self) -> None:
        if self.at != len(self.data):
            raise FrameError(f"{self.what} descriptor has {len(self.data) - self.at} bytes past its end")


# The binary layouts (little-endian) of FORWARD and TOKEN descriptors (wire.frames.RAW_TYPES):
# a header, then each row, then each failed row, all fixed-size fields but a row's tokens,
# its Open (JSON: sampling parameters and options, once per request) and a failure's reason.
_FORWARD = struct.Struct("<QHHBI")  # term, rows, failed rows, hidden states' dtype code (0: none), hidden size
_ROW = struct.Struct("<QQIBI")  # rid, offset, tokens (then as many u32), flags, Open's bytes (then as many)
_TOKENS = struct.Struct("<QHHHI")  # term, rows, failed rows, embedded rows, the embeddings' width
_SAMPLED = struct.Struct("<QQIdHB")  # rid, offset, token, logprob, proposals accepted, top (then as many _TOP)
_TOP = struct.Struct("<Id")  # token, logprob
_FAILED = struct.Struct("<QH")  # rid, the reason's bytes (then as many, UTF-8)
_EMBEDDED = struct.Struct("<QQ")  # rid, offset (its vector: the payload's row of the same place)
_PARTIAL = struct.Struct("<QBQ")  # term, dtype code, elements (the payload holds as many, in that dtype)


def _write_failed(out: list, failed: tuple[tuple[int, str], ...]) -> None:
    for rid, why in failed:
        reason = why[:MAX_REASON_CHARS].encode()
        out += (_FAILED.pack(rid, len(reason)), reason)


def _read_failed(r: _Reader, n: int) -> tuple[tuple[int, str], ...]:
    if n > MAX_ROWS:
        raise FrameError(f"{r.what} names {n} failed rows, more than {MAX_ROWS}")
    out = []
    for _ in range(n):
        rid, size = r.take(_FAILED)
        try:
            why = r.raw(size, "failed row's reason").decode()
        except UnicodeDecodeError:
            raise FrameError(f"{r.what}: row {rid:x}'s failure reason is not UTF-8") from None
        out.append((rid, why[:MAX_REASON_CHARS]))
    return tuple(out)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")  # NaN, Infinity: what json.loads would let through


def _number(v: float, what: str) -> float:
    """A logprob from a peer: finite (a client gets it as JSON, which has no NaN or infinity)."""
    if not math.isfinite(v):
        raise FrameError(f"{what} must be a finite number, got {v!r}")
    return v


def term_of(frame: Frame) -> int | None:
    """The ring (plan term) a FORWARD, TOKEN, ERROR or RELEASE is for, without parsing the rest;
    None if it names none."""
    d = frame.descriptor
    if isinstance(d, (bytes, bytearray)):
        return struct.unpack_from("<Q", d)[0] if len(d) >= 8 else None
    term = d.get("term") if isinstance(d, dict) else None
    return term if type(term) is int else None


@dataclass(frozen=True)
class KvOptions:
    """mlx-lm's KV-cache options for one request, the same on every stage.

    ``max_size``: a RotatingKVCache of that many positions (mlx-lm's
    max_kv_size); ``bits``: caches quantized once they hold more than ``start``
    positions (mlx-lm's kv_bits, kv_group_size, quantized_kv_start).
    """

    max_size: int | None = None
    bits: int | None = None
    group_size: int = DEFAULT_KV_GROUP_SIZE
    start: int = 0

    def to_wire(self) -> dict:
        return {"max_size": self.max_size, "bits": self.bits, "group_size": self.group_size, "start": self.start}

    @classmethod
    def from_wire(cls, d: object) -> "KvOptions | None":
        if d is None:
            return None
        if not isinstance(d, dict) or set(d) != {"max_size", "bits", "group_size", "start"}:
            raise FrameError(f"FORWARD field 'kv' must have max_size, bits, group_size and start; got {d!r:.200}")
        max_size, bits, group, start = d["max_size"], d["bits"], d["group_size"], d["start"]
        if max_size is not None and not (type(max_size) is int and 1 <= max_size <= MAX_KV_SIZE):
            raise FrameError(f"kv max_size must be 1..{MAX_KV_SIZE} or null; got {max_size!r:.80}")
        if bits is not None and bits not in KV_BITS:
            raise FrameError(f"kv bits must be one of {KV_BITS} or null; got {bits!r:.80}")
        if group not in KV_GROUP_SIZES or type(start) is not int or start < 0:
            raise FrameError(f"kv group_size must be one of {KV_GROUP_SIZES} and start >= 0; got {group!r:.80}, {start!r:.80}")
        return cls(max_size, bits, group, start)


@dataclass(frozen=True)
class Open:
    """What opens a request on every stage, with its first row.

    ``params``: ``SamplingParams.to_wire()`` (the last stage parses it; the others
    check it too, so a bad one fails the request at stage 0). ``reuse``: (cached
    prefix, positions of it to keep), equal to the row's offset.
    """

    params: dict
    kv: KvOptions | None = None
    reuse: tuple[int, int] | None = None
    request_id: str | None = None
    pool: str | None = None  # an embedding: how the last stage pools (POOLINGS)
    images: int = 0  # the prompt's images, which came before in a MEDIA frame (media.py)

    def to_wire(self) -> dict:
        d: dict = {"params": self.params}
        if self.pool is not None:
            d["pool"] = self.pool
        if self.images:
            d["images"] = self.images
        if self.kv is not None:
            d["kv"] = self.kv.to_wire()
        if self.reuse is not None:
            d["reuse"] = list(self.reuse)
        if self.request_id is not None:
            d["request_id"] = self.request_id
        return d

    @classmethod
    def from_wire(cls, d: object, offset: int) -> "Open":
        if not isinstance(d, dict) or not {"params"} <= set(d) <= {"params", "kv", "reuse", "request_id", "pool", "images"}:
            raise FrameError(f"a row's 'open' must be {{params, kv?, reuse?, request_id?, pool?, images?}}, got {d!r:.200}")
        images = d.get("images", 0)
        if type(images) is not int or not 0 <= images <= MAX_IMAGES:
            raise FrameError(f"open 'images' must be an integer in [0, {MAX_IMAGES}], got {images!r:.40}")
        pool = d.get("pool")
        if pool is not None and pool not in POOLINGS:
            raise FrameError(f"open 'pool' must be one of {POOLINGS}, got {pool!r:.40}")
        if not isinstance(d["params"], dict):
            raise FrameError("a row's open 'params' must be an object")
        reuse = d.get("reuse")
        if reuse is not None:
            if (
                not isinstance(reuse, list)
                or len(reuse) != 2
                or not all(type(v) is int and 0 <= v <= MAX_REQUEST_ID for v in reuse)
                or reuse[1] != offset
            ):
                raise FrameError(f"open 'reuse' must be [prefix id, positions == the row's offset {offset}], got {reuse!r:.80}")
            reuse = (reuse[0], reuse[1])
        request_id = d.get("request_id")
        if request_id is not None:
            try:
                check_request_id(request_id if isinstance(request_id, str) else "")
            except RequestIdError as e:
                raise FrameError(f"open 'request_id': {e}") from None
        if pool is not None and reuse is not None:
            raise FrameError("an embedding ('pool') pools every position of its input: it cannot start from a cached prefix ('reuse')")
        return cls(d["params"], KvOptions.from_wire(d.get("kv")), reuse, request_id, pool, images)


@dataclass(frozen=True)
class Row:
    """One request's step in a micro-batch."""

    rid: int
    offset: int  # the position of tokens[0]: what the stage's caches must hold already
    tokens: tuple[int, ...]
    sample: bool
    silent: bool = False
    open: Open | None = None
    verify: bool = False
    probs: bool = False  # the frame's payload carries the draft's distribution for each proposal
    rope: bool = False  # the frame's payload carries its positions' three numbers (ROPE)

    @property
    def flags(self) -> int:
        return SAMPLE * self.sample | SILENT * self.silent | VERIFY * self.verify | PROBS * self.probs | ROPE * self.rope

    def write(self, out: list) -> None:
        opened = json.dumps(self.open.to_wire(), separators=(",", ":"), allow_nan=False).encode() if self.open is not None else b""
        out += (_ROW.pack(self.rid, self.offset, len(self.tokens), self.flags, len(opened)), struct.pack(f"<{len(self.tokens)}I", *self.tokens), opened)

    @classmethod
    def read(cls, r: _Reader, vocab_size: int) -> "Row":
        rid, offset, n, flags, opened = r.take(_ROW)
        if not 1 <= n <= MAX_STEP_TOKENS:
            raise FrameError(f"row {rid:x} must carry 1 to {MAX_STEP_TOKENS} tokens, not {n}")
        tokens = r.ints(n, f"row {rid:x}'s tokens")
        if max(tokens) >= vocab_size:
            raise FrameError(f"row {rid:x}'s tokens must be ids in [0, {vocab_size})")
        if flags not in FLAGS:
            raise FrameError(
                f"row {rid:x}'s flags must be 0, {SAMPLE} (sample), {SAMPLE | SILENT} (sample silently), {SAMPLE | VERIFY} (verify proposals) "
                f"or {SAMPLE | VERIFY | PROBS} (verify proposals drawn from the distributions in the payload), each with {ROPE} "
                f"(three-axis positions in the payload) or without, got {flags}"
            )
        if flags & VERIFY and n < 2:
            raise FrameError(f"row {rid:x} verifies proposals but carries none")
        open_ = None
        if opened:
            try:
                d = json.loads(r.raw(opened, f"row {rid:x}'s open"), parse_constant=_no_constant)
            except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, NaN, too deep
                raise FrameError(f"row {rid:x}'s open is not JSON: {e}") from None
            open_ = Open.from_wire(d, offset)
        return cls(rid, offset, tokens, bool(flags & SAMPLE), bool(flags & SILENT), open_, bool(flags & VERIFY), bool(flags & PROBS), bool(flags & ROPE))


@dataclass(frozen=True)
class Forward:
    """A micro-batch on its way around the ring. Past stage 0 the frame's payload is the hidden
    states of its rows' positions, ``[1, positions, hidden_size]`` of dtype ``dtype``."""

    batch: int
    term: int
    rows: tuple[Row, ...]
    failed: tuple[tuple[int, str], ...] = ()  # rows an earlier stage failed: (rid, why)
    dtype_code: int = 0  # the hidden states' dtype (wire.tensors.DTYPE_CODES; 0: the frame carries none)
    hidden_size: int = 0

    @property
    def positions(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    @property
    def drafted(self) -> int:
        """Draft distributions the payload carries after the hidden states: one per proposal of each ``probs`` row."""
        return sum(len(r.tokens) - 1 for r in self.rows if r.probs)

    @property
    def hidden_bytes(self) -> int:
        return self.positions * self.hidden_size * CODE_DTYPES[self.dtype_code].size if self.dtype_code else 0

    @property
    def rope_bytes(self) -> int:
        """Bytes of the three-axis positions the payload carries last: [3, n] int32 for each ROPE row."""
        return 3 * 4 * sum(len(r.tokens) for r in self.rows if r.rope)

    def frame(self, hidden: mx.array | None = None, payload=b"") -> Frame:
        """The FORWARD frame; ``hidden``: the hidden states whose bytes ``payload`` holds."""
        code, size = (DTYPE_CODES[hidden.dtype], hidden.shape[-1]) if hidden is not None else (0, 0)
        out: list = [_FORWARD.pack(self.term, len(self.rows), len(self.failed), code, size)]
        for row in self.rows:
            row.write(out)
        _write_failed(out, self.failed)
        return Frame(MsgType.FORWARD, self.batch, b"".join(out), payload)

    def handed(self, payload=b"") -> "Handed":
        """The FORWARD frame of a leader's tokens for its own stage 0, in this process: the frame
        (byte for byte the one a link would carry, ``payload`` the drafts' distributions) with
        this micro-batch, which ``parse`` then returns as it is rather than reading back the rows
        this process just wrote."""
        assert not self.dtype_code, "only the leader's tokens are handed over: hidden states travel as bytes"
        frame = self.frame(payload=payload)
        return Handed(frame.type, frame.request_id, frame.descriptor, frame.payload, forward=self)

    @classmethod
    def parse(cls, frame: Frame, vocab_size: int) -> "Forward":
        if isinstance(frame, Handed) and frame.forward is not None:
            return frame.forward  # built by this process's leader, not read from a peer
        d = frame.descriptor
        if not isinstance(d, (bytes, bytearray)):
            raise FrameError("a FORWARD descriptor must be binary")
        r = _Reader(d, "FORWARD")
        term, rows, failed, code, size = r.take(_FORWARD)
        if rows > MAX_ROWS:
            raise FrameError(f"FORWARD carries {rows} rows, more than {MAX_ROWS}")
        parsed = tuple(Row.read(r, vocab_size) for _ in range(rows))
        if sum(len(row.tokens) for row in parsed) > MAX_STEP_TOKENS:
            raise FrameError(f"FORWARD carries more than {MAX_STEP_TOKENS} tokens in all")
        if len({row.rid for row in parsed}) != len(parsed):
            raise FrameError("FORWARD has two rows of one request")
        failures = _read_failed(r, failed)
        r.done()
        if {row.rid for row in parsed} & {rid for rid, _ in failures}:
            raise FrameError("FORWARD names a request both as a row and as failed")
        if code and code not in CODE_DTYPES:
            raise FrameError(f"FORWARD hidden states' dtype code {code} is not one of {sorted(CODE_DTYPES)}")
        forward = cls(frame.request_id, term, parsed, failures, code, size)
        probs, ropes = draft_bytes(forward.drafted, vocab_size), forward.rope_bytes
        if not code and len(frame.payload) != probs + ropes:
            raise FrameError(
                "FORWARD has a payload but declares no hidden states" if not probs + ropes
                else f"FORWARD's payload must be its {forward.drafted} draft distributions of {draft_support(vocab_size)} "
                f"token ids and probabilities ({probs} bytes) and three-axis positions ({ropes} bytes), not {len(frame.payload)}"
            )  # fmt: skip
        if code and len(frame.payload) != forward.hidden_bytes + probs + ropes:
            raise FrameError(
                f"FORWARD's payload must be its hidden states [1, {forward.positions}, {size}] ({forward.hidden_bytes} bytes), "
                f"{forward.drafted} draft distributions ({probs} bytes) and three-axis positions ({ropes} bytes), not {len(frame.payload)} bytes"
            )
        return forward

    def hidden(self, payload) -> mx.array:
        """The hidden states the frame's ``payload`` holds, checked against the rows' positions."""
        if not self.dtype_code:
            raise FrameError("FORWARD carries no hidden states")
        return tensor_from_bits(self.dtype_code, (1, self.positions, self.hidden_size), memoryview(payload)[: self.hidden_bytes])

    def draft_probs(self, payload, vocab_size: int) -> dict[int, memoryview]:
        """Each ``probs`` row's draft distributions, as the payload's bytes after the hidden states
        (``pack_draft``'s, k its proposals), by request."""
        out, at, view = {}, self.hidden_bytes, memoryview(payload)
        for row in self.rows:
            if row.probs:
                n = draft_bytes(len(row.tokens) - 1, vocab_size)
                out[row.rid] = view[at : at + n]
                at += n
        return out


    def ropes(self, payload) -> dict[int, np.ndarray]:
        """Each ROPE row's three-axis positions [3, n] (int32), the payload's last bytes, by request;
        a FrameError for a negative one or one past MAX_ROPE_POSITION."""
        view, out = memoryview(payload), {}
        at = len(view) - self.rope_bytes
        for row in self.rows:
            if row.rope:
                n = len(row.tokens)
                rope = np.frombuffer(view[at : at + 12 * n], dtype="<i4").reshape(3, n)
                if n and not (0 <= rope.min() and rope.max() <= MAX_ROPE_POSITION):
                    raise FrameError(f"row {row.rid:x}'s three-axis positions must be in [0, {MAX_ROPE_POSITION}]")
                out[row.rid] = rope
                at += 12 * n
        return out


def pack_ropes(rows: tuple[Row, ...], ropes: dict[int, np.ndarray]) -> bytes:
    """The ROPE rows' three-axis positions as the payload ends with them, in the rows' order."""
    return b"".join(np.ascontiguousarray(ropes[row.rid], dtype="<i4").tobytes() for row in rows if row.rope)


def draft_distribution(raw, proposals: int, vocab_size: int) -> mx.array:
    """A row's draft distributions [proposals, vocab_size] from their bytes (``pack_draft``'s),
    checked: ids in the vocabulary, probabilities finite and not negative; else a FrameError."""
    support = draft_support(vocab_size)
    n = proposals * support
    ids = np.frombuffer(raw, dtype="<u4", count=n)
    probs = np.frombuffer(raw, dtype="<f4", offset=4 * n, count=n + proposals)  # the tails after the support's
    if n and ids.max() >= vocab_size:
        raise FrameError(f"a row's draft distributions name token ids past the vocabulary ({vocab_size})")
    if not (np.isfinite(probs).all() and (probs >= 0).all()):
        raise FrameError("a row's draft distributions must be finite and not negative")
    shape = (proposals, support)
    return dense_draft(mx.array(ids).reshape(shape), mx.array(probs[:n]).reshape(shape), mx.array(probs[n:]), vocab_size)


@dataclass(frozen=True)
class Handed(Frame):
    """A FORWARD the leader hands its own stage 0 (``Forward.handed``): the frame as a link
    would carry it, and the micro-batch it was packed from."""

    forward: Forward | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Sampled:
    """A row's answer from the last stage: the token sampled after it (offset: the position it takes).
    For a verify row, ``accepted``: how many of its proposals agreed (they precede the token)."""

    rid: int
    offset: int
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    accepted: int = 0

    def write(self, out: list) -> None:
        out.append(_SAMPLED.pack(self.rid, self.offset, self.token, self.logprob, self.accepted, len(self.top)))
        out += (_TOP.pack(token, logprob) for token, logprob in self.top)

    @classmethod
    def read(cls, r: _Reader) -> "Sampled":
        rid, offset, token, logprob, accepted, top = r.take(_SAMPLED)
        if accepted > MAX_STEP_TOKENS:
            raise FrameError(f"row {rid:x}'s accepted proposals must be at most {MAX_STEP_TOKENS}, got {accepted}")
        if top > MAX_TOP:
            raise FrameError(f"row {rid:x}'s top must be at most {MAX_TOP} [token, logprob]")
        pairs = []
        for _ in range(top):
            t, lp = r.take(_TOP)
            pairs.append((t, _number(lp, f"row {rid:x}'s top logprob")))
        return cls(rid, offset, token, _number(logprob, f"row {rid:x}'s logprob"), tuple(pairs), accepted)


@dataclass(frozen=True)
class Embedded:
    """A pooling row's answer from the last stage: its request's pooled final hidden states
    (``vector``, float32, not normalized), after position ``offset`` - 1."""

    rid: int
    offset: int
    vector: np.ndarray


@dataclass(frozen=True)
class Tokens:
    """The last stage's answer to a micro-batch: a token for each row that sampled aloud, a vector
    for each that pooled, and the rows that failed on the way (every row the leader sent is one
    or the other, or a silent or prefill row, which gets no answer). The vectors are the payload,
    ``[embedded, width]`` float32, in the order of ``embedded``."""

    batch: int
    term: int
    rows: tuple[Sampled, ...]
    failed: tuple[tuple[int, str], ...] = ()
    embedded: tuple[Embedded, ...] = ()

    def frame(self) -> Frame:
        width = len(self.embedded[0].vector) if self.embedded else 0
        out: list = [_TOKENS.pack(self.term, len(self.rows), len(self.failed), len(self.embedded), width)]
        for row in self.rows:
            row.write(out)
        _write_failed(out, self.failed)
        payload = b""
        if self.embedded:
            out += [_EMBEDDED.pack(e.rid, e.offset) for e in self.embedded]
            payload = np.stack([np.asarray(e.vector, dtype="<f4") for e in self.embedded]).tobytes()
        return Frame(MsgType.TOKEN, self.batch, b"".join(out), payload)

    @classmethod
    def parse(cls, frame: Frame) -> "Tokens":
        d = frame.descriptor
        if not isinstance(d, (bytes, bytearray)):
            raise FrameError("a TOKEN descriptor must be binary")
        r = _Reader(d, "TOKEN")
        term, rows, failed, embedded, width = r.take(_TOKENS)
        if rows + embedded > MAX_ROWS:
            raise FrameError(f"TOKEN carries {rows} rows and {embedded} embeddings, more than {MAX_ROWS}")
        sampled = tuple(Sampled.read(r) for _ in range(rows))
        failures = _read_failed(r, failed)
        where = [r.take(_EMBEDDED) for _ in range(embedded)]
        r.done()
        if embedded and not 1 <= width <= MAX_EMBEDDING_WIDTH:
            raise FrameError(f"TOKEN embeddings must be 1 to {MAX_EMBEDDING_WIDTH} wide, not {width}")
        if len(frame.payload) != 4 * embedded * width:
            raise FrameError(f"a TOKEN payload must be its {embedded} embedding(s) of {width} float32, not {len(frame.payload)} bytes")
        vectors = np.frombuffer(frame.payload, dtype="<f4").reshape(embedded, width) if embedded else None
        if vectors is not None and not np.isfinite(vectors).all():
            raise FrameError("TOKEN embeddings must be finite numbers")
        return cls(frame.request_id, term, sampled, failures, tuple(Embedded(rid, offset, vectors[i]) for i, (rid, offset) in enumerate(where)))


@dataclass(frozen=True)
class Failure:
    """A whole micro-batch failed at ``node`` (ERROR, its id as the frame's): every row of it fails.
    ``status`` 503 says the ring (not the request) is at fault: a retry elsewhere may succeed."""

    batch: int
    term: int | None
    node: str
    message: str
    status: int = 500

    def frame(self) -> Frame:
        return Frame(MsgType.ERROR, self.batch, {"term": self.term, "node": self.node, "message": self.message, "status": self.status})

    @classmethod
    def parse(cls, frame: Frame) -> "Failure":
        d = frame.descriptor
        if not isinstance(d, dict) or set(d) != {"term", "node", "message", "status"}:
            raise FrameError(f"ERROR descriptor must be {{term, node, message, status}}, got {str(d):.200}")
        term = None if d["term"] is None else _int(d["term"], "ERROR term")
        if d["status"] not in (500, 503):
            raise FrameError(f"ERROR status must be 500 or 503, got {d['status']!r:.40}")
        return cls(frame.request_id, term, _reason(d["node"], "ERROR node")[:64], _reason(d["message"], "ERROR message"), d["status"])


@dataclass(frozen=True)
class Partial:
    """One member's share of one all-reduce of a tensor-parallel group (REDUCE, its number in the
    group's sequence of all-reduces as the frame's id): the members' partials, summed in rank
    order, are the layer's output on every member. The payload is the flat tensor's bytes."""

    term: int
    seq: int
    code: int  # dtype (wire.tensors.DTYPE_CODES)
    count: int  # elements

    def frame(self, payload) -> Frame:
        return Frame(MsgType.REDUCE, self.seq, _PARTIAL.pack(self.term, self.code, self.count), payload)

    @classmethod
    def parse(cls, frame: Frame) -> "Partial":
        d = frame.descriptor
        if not isinstance(d, (bytes, bytearray)) or len(d) != _PARTIAL.size:
            raise FrameError(f"REDUCE descriptor must be {_PARTIAL.size} bytes")
        term, code, count = _PARTIAL.unpack(d)
        return cls(term, frame.request_id, code, count)

    def tensor(self, payload) -> mx.array:
        """The partial as a flat array: dtype and length checked against the payload first."""
        return tensor_from_bits(self.code, (self.count,), payload)


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


def release(rid: int, term: int, action: str = "release") -> Frame:
    """RELEASE of request ``rid``'s caches on ring ``term``: "release", "keep" (as a cached prefix) or "evict"."""
    d: dict = {"term": term}
    if action != "release":
        d[action] = True
    return Frame(MsgType.RELEASE, rid, d)
