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

RELEASE (one request's caches: free them, keep them as a cached prefix, or drop
a cached prefix) follows the request's last row around the ring.

Every field a peer sends is checked here against a named limit, and anything
malformed is a ``FrameError`` that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringd.logs import RequestIdError, check_request_id
from wire.frames import MAX_REQUEST_ID, Frame, FrameError, MsgType

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
FLAGS = (0, SAMPLE, SAMPLE | SILENT, SAMPLE | VERIFY)


def _int(v: object, name: str, lo: int = 0, hi: int = MAX_REQUEST_ID) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise FrameError(f"{name} must be an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _reason(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise FrameError(f"{name} must be a string, got {type(v).__name__}")
    return v[:MAX_REASON_CHARS]


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

    def to_wire(self) -> dict:
        d: dict = {"params": self.params}
        if self.kv is not None:
            d["kv"] = self.kv.to_wire()
        if self.reuse is not None:
            d["reuse"] = list(self.reuse)
        if self.request_id is not None:
            d["request_id"] = self.request_id
        return d

    @classmethod
    def from_wire(cls, d: object, offset: int) -> "Open":
        if not isinstance(d, dict) or not {"params"} <= set(d) <= {"params", "kv", "reuse", "request_id"}:
            raise FrameError(f"a row's 'open' must be {{params, kv?, reuse?, request_id?}}, got {d!r:.200}")
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
        return cls(d["params"], KvOptions.from_wire(d.get("kv")), reuse, request_id)


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

    def to_wire(self) -> list:
        row = [self.rid, self.offset, list(self.tokens), SAMPLE * self.sample | SILENT * self.silent | VERIFY * self.verify]
        if self.open is not None:
            row.append(self.open.to_wire())
        return row

    @classmethod
    def from_wire(cls, v: object, vocab_size: int) -> "Row":
        if not isinstance(v, list) or len(v) not in (4, 5):
            raise FrameError(f"a FORWARD row must be [rid, offset, tokens, flags, open?], got {v!r:.120}")
        rid = _int(v[0], "a row's request id")
        offset = _int(v[1], f"row {rid:x}'s offset")
        tokens, flags = v[2], v[3]
        if not isinstance(tokens, list) or not 1 <= len(tokens) <= MAX_STEP_TOKENS:
            raise FrameError(f"row {rid:x} must carry 1 to {MAX_STEP_TOKENS} tokens")
        if not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise FrameError(f"row {rid:x}'s tokens must be ids in [0, {vocab_size})")
        if type(flags) is not int or flags not in FLAGS:
            raise FrameError(
                f"row {rid:x}'s flags must be 0, {SAMPLE} (sample), {SAMPLE | SILENT} (sample silently) or {SAMPLE | VERIFY} (verify proposals), got {flags!r:.40}"
            )
        if flags & VERIFY and len(tokens) < 2:
            raise FrameError(f"row {rid:x} verifies proposals but carries none")
        open_ = Open.from_wire(v[4], offset) if len(v) == 5 else None
        return cls(rid, offset, tuple(tokens), bool(flags & SAMPLE), bool(flags & SILENT), open_, bool(flags & VERIFY))


def _failed_to_wire(failed: tuple[tuple[int, str], ...]) -> list:
    return [[rid, why] for rid, why in failed]


def _failed_from_wire(v: object, what: str) -> tuple[tuple[int, str], ...]:
    if not isinstance(v, list) or len(v) > MAX_ROWS:
        raise FrameError(f"{what} 'failed' must be a list of at most {MAX_ROWS} [rid, reason]")
    out = []
    for item in v:
        if not isinstance(item, list) or len(item) != 2:
            raise FrameError(f"{what} 'failed' entries must be [rid, reason], got {item!r:.80}")
        out.append((_int(item[0], "a failed row's request id"), _reason(item[1], "a failed row's reason")))
    return tuple(out)


@dataclass(frozen=True)
class Forward:
    """A micro-batch on its way around the ring (``hidden``: the frame's tensor, past stage 0)."""

    batch: int
    term: int
    rows: tuple[Row, ...]
    failed: tuple[tuple[int, str], ...] = ()  # rows an earlier stage failed: (rid, why)

    @property
    def positions(self) -> int:
        return sum(len(r.tokens) for r in self.rows)

    def frame(self, tensor: dict | None = None, payload=b"") -> Frame:
        d: dict = {"term": self.term, "rows": [r.to_wire() for r in self.rows]}
        if self.failed:
            d["failed"] = _failed_to_wire(self.failed)
        if tensor is not None:
            d["tensor"] = tensor
        return Frame(MsgType.FORWARD, self.batch, d, payload)

    @classmethod
    def parse(cls, frame: Frame, vocab_size: int) -> "Forward":
        d = frame.descriptor
        if not isinstance(d, dict) or not {"term", "rows"} <= set(d) <= {"term", "rows", "failed", "tensor"}:
            raise FrameError(f"FORWARD descriptor must be {{term, rows, failed?, tensor?}}, got {str(d):.200}")
        rows = d["rows"]
        if not isinstance(rows, list) or len(rows) > MAX_ROWS:
            raise FrameError(f"FORWARD 'rows' must be a list of at most {MAX_ROWS}")
        parsed = tuple(Row.from_wire(r, vocab_size) for r in rows)
        if sum(len(r.tokens) for r in parsed) > MAX_STEP_TOKENS:
            raise FrameError(f"FORWARD carries more than {MAX_STEP_TOKENS} tokens in all")
        if len({r.rid for r in parsed}) != len(parsed):
            raise FrameError("FORWARD has two rows of one request")
        failed = _failed_from_wire(d.get("failed", []), "FORWARD")
        if {r.rid for r in parsed} & {rid for rid, _ in failed}:
            raise FrameError("FORWARD names a request both as a row and as failed")
        return cls(frame.request_id, _int(d["term"], "FORWARD term"), parsed, failed)


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

    def to_wire(self) -> list:
        row = [self.rid, self.offset, self.token, self.logprob]
        if self.top or self.accepted:
            row.append([list(p) for p in self.top])
        if self.accepted:
            row.append(self.accepted)
        return row

    @classmethod
    def from_wire(cls, v: object) -> "Sampled":
        if not isinstance(v, list) or len(v) not in (4, 5, 6):
            raise FrameError(f"a TOKENS row must be [rid, offset, token, logprob, top?, accepted?], got {v!r:.120}")
        rid, offset, token, logprob = _int(v[0], "a sampled row's request id"), _int(v[1], "a sampled offset"), _int(v[2], "a sampled token"), v[3]
        if not isinstance(logprob, (int, float)) or isinstance(logprob, bool):
            raise FrameError(f"row {rid:x}'s logprob must be a number, got {logprob!r:.40}")
        top, accepted = (), 0
        if len(v) == 6:
            accepted = _int(v[5], f"row {rid:x}'s accepted proposals", 0, MAX_STEP_TOKENS)
        if len(v) >= 5:
            if not isinstance(v[4], list) or len(v[4]) > MAX_TOP:
                raise FrameError(f"row {rid:x}'s top must be a list of at most {MAX_TOP} [token, logprob]")
            pairs = []
            for p in v[4]:
                if not (isinstance(p, list) and len(p) == 2 and type(p[0]) is int and isinstance(p[1], (int, float)) and not isinstance(p[1], bool)):
                    raise FrameError(f"row {rid:x}'s top entries must be [token, logprob], got {p!r:.80}")
                pairs.append((p[0], float(p[1])))
            top = tuple(pairs)
        return cls(rid, offset, token, float(logprob), top, accepted)


@dataclass(frozen=True)
class Tokens:
    """The last stage's answer to a micro-batch: a token for each row that sampled aloud, and the
    rows that failed on the way (every row the leader sent is one or the other, or a silent or
    prefill row, which gets no answer)."""

    batch: int
    term: int
    rows: tuple[Sampled, ...]
    failed: tuple[tuple[int, str], ...] = ()

    def frame(self) -> Frame:
        d: dict = {"term": self.term, "rows": [r.to_wire() for r in self.rows]}
        if self.failed:
            d["failed"] = _failed_to_wire(self.failed)
        return Frame(MsgType.TOKEN, self.batch, d)

    @classmethod
    def parse(cls, frame: Frame) -> "Tokens":
        d = frame.descriptor
        if not isinstance(d, dict) or not {"term", "rows"} <= set(d) <= {"term", "rows", "failed"}:
            raise FrameError(f"TOKEN descriptor must be {{term, rows, failed?}}, got {str(d):.200}")
        if not isinstance(d["rows"], list) or len(d["rows"]) > MAX_ROWS:
            raise FrameError(f"TOKEN 'rows' must be a list of at most {MAX_ROWS}")
        return cls(
            frame.request_id,
            _int(d["term"], "TOKEN term"),
            tuple(Sampled.from_wire(r) for r in d["rows"]),
            _failed_from_wire(d.get("failed", []), "TOKEN"),
        )


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
