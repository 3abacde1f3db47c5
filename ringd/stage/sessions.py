"""Per-request state on one stage: its KV caches, its sampler, its position.

Every stage keeps the KV cache of its own layers for every live request; only
hidden states travel. A session is opened by a request's first frame, touched
by each later frame, and dropped by RELEASE, by an error, or when nobody has
talked to it for ``idle_timeout_s`` (a leader that died mid-request never sends
its RELEASE).

A RELEASE may instead ask the stage to keep the request's caches as a cached
prefix (``keep``): they move to the store, under the request's id, with the
tokens they hold. A later request's first frame may take them (``reuse``),
trimmed to the prefix it shares; the leader decides all of this and evicts
from the store with another RELEASE (``evict``), so every stage holds the same
entries.

Decode rows of several requests in one micro-batch run as one batch through
the layers when their caches allow it (``batched``): their caches are merged
into mlx-lm's batched caches by the caches' own ``merge`` (``KVCache`` into
``BatchKVCache``: left padding, per-row offsets; a sliding window's
``RotatingKVCache`` into ``BatchRotatingKVCache``; linear attention's
``ArraysCache`` into one of batched states; ``CacheList`` layer by layer) and stay
merged, as a group, for as long as the same requests come in the same order,
which is the steady state of decoding; a request that leaves the group
(released, or stepping alone) gets its own caches back (``extract``, and the
group ``filter``s it out). Quantized caches (``kv_bits``) and the rotating cache
of ``max_kv_size`` (which keeps its first positions, as mlx-lm's does, and whose
batched twin does not) step one row at a time, which is exact, just not batched.

A group's verify rows (speculative decoding) leave positions some of its
requests did not keep; they are cut where they are, in the batched caches: each
row's rejected positions at its right end become left padding (the caches' own
``prepare(right_padding=...)`` and ``finalize``, as mlx-lm's batched prefill
right-justifies its rows), so the group stays merged.

Only the compute thread mutates sessions (FORWARD and RELEASE of one request
are applied there in arrival order); the event loop only reads counts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList, KVCache, RotatingKVCache, can_trim_prompt_cache, trim_prompt_cache

from ringd.stage.pooling import Pooling
from ringd.stage.sampling import RequestSampler

# A request silent this long is abandoned: its leader died or lost track of it.
# Decoding touches a session every token, so only a dead request is this idle.
SESSION_IDLE_TIMEOUT_S = 300.0
# Live requests per stage. Each holds KV caches; the leader admits fewer than
# this, so hitting it means a leader misbehaving, not ordinary load.
MAX_SESSIONS = 1024
# Cached prefixes per stage. The leader keeps far fewer (prefix_cache_entries);
# this only bounds what a misbehaving leader can make a stage hold.
MAX_STORED = 256


class SessionError(Exception):
    """A frame does not fit the session it names; the request fails, the node stays up."""


@dataclass
class Group:
    """Requests whose caches are merged, one batched cache per layer, rows in ``rids`` order."""

    rids: tuple[int, ...]
    cache: list[Any]

    @property
    def kv_bytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


def batchable(cache: list[Any]) -> bool:
    """Whether a request's caches may be merged with others' (see the module's docstring)."""
    return all(_mergeable(c) and not c.empty() for c in cache)


def mergeable_kind(c: Any) -> bool:
    """Whether caches of ``c``'s kind merge into a batched cache that steps as they do alone
    (``Shard`` asks it of a fresh one at load, before trying a batched step)."""
    return _mergeable(c)


def _kind(c: Any) -> tuple:
    """What two caches of one layer must share to merge."""
    if type(c) is CacheList:
        return ("CacheList", tuple(_kind(x) for x in c.caches))
    return (type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None))


def _mergeable(c: Any) -> bool:
    if type(c) is CacheList:
        return all(_mergeable(x) for x in c.caches)
    # A sliding window merges; max_kv_size's rotating cache keeps its first positions (keep),
    # which BatchRotatingKVCache does not.
    return type(c) in (KVCache, ArraysCache) or (type(c) is RotatingKVCache and c.keep == 0)


@dataclass
class Session:
    request_id: int
    cache: list[Any] | None  # None while the request's caches are merged into its group's
    sampler: RequestSampler | None
    offset: int = 0  # tokens already in this stage's caches
    last_used: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # the ids whose positions the caches hold
    kv: Any = None  # steps.KvOptions the caches follow
    name: str | None = None  # the client's request id (logs.py), for the lines about it
    group: Group | None = None
    provisional: int = 0  # positions at the end a next row may cut: the proposals of a verify row
    pool: Pooling | None = None  # an embedding's, on the last stage: pooled, not sampled
    prompt: Any = None  # on the first stage, a prompt with images: its input embeddings (vision.Prompt) until its last chunk
    shift: int | None = None  # on the first stage, a three-axis prompt with images: what positions after it add (vision.Prompt.shift)

    @property
    def kv_bytes(self) -> int:
        """Its own caches' bytes (a group's are counted once, by Sessions)."""
        return sum(getattr(c, "nbytes", 0) for c in self.cache or ())

    def forget_last(self, n: int) -> None:
        """Its last ``n`` positions were cut from its caches: forget their tokens (the sampler's
        history too); nothing it holds is provisional any more."""
        self.offset -= n
        del self.tokens[self.offset :]
        self.provisional = 0
        if self.sampler is not None:
            self.sampler.rewind(n)


@dataclass
class Stored:
    """A finished request's caches, kept for a later request with the same prefix."""

    cache: list[Any]
    tokens: list[int]
    name: str | None = None  # the request id of the request that left it

    @property
    def kv_bytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


class Sessions:
    def __init__(self, idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S, max_sessions: int = MAX_SESSIONS):
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self._live: dict[int, Session] = {}
        self._stored: OrderedDict[int, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def open(
        self,
        request_id: int,
        cache: list[Any],
        sampler: RequestSampler | None,
        tokens: list[int] | None = None,
        kv: Any = None,
        name: str | None = None,
    ) -> Session:
        """A new session; ``tokens`` are the positions ``cache`` already holds (a reused prefix)."""
        if request_id in self._live:
            raise SessionError(f"request {request_id:x} is already open on this stage")
        if len(self._live) >= self.max_sessions:
            raise SessionError(f"this stage already holds {self.max_sessions} requests (MAX_SESSIONS)")
        tokens = list(tokens or [])
        session = Session(request_id, cache, sampler, offset=len(tokens), tokens=tokens, kv=kv, name=name)
        self._live[request_id] = session
        return session

    def get(self, request_id: int) -> Session:
        """The live session; its caches may be merged into a group's (``solo`` gives them back)."""
        session = self._live.get(request_id)
        if session is None:
            raise SessionError(
                f"request {request_id:x} is not open on this stage (released, expired, or its first frame was lost)"
            )
        session.last_used = time.monotonic()
        return session

    def solo(self, request_id: int) -> Session:
        """The live session, with caches of its own (out of its group, if it was in one)."""
        session = self.get(request_id)
        self._leave_group(session, extract=True)
        return session

    def rewind(self, request_id: int, offset: int) -> Session:
        """Cut the live session's caches back to ``offset`` positions: only into what its last row
        left provisional (a draft's proposals the last stage did not keep), and only where the
        caches can be trimmed."""
        session = self.get(request_id)
        cut = session.offset - offset
        if not 0 < cut <= session.provisional:
            raise SessionError(f"a row for position {offset}, but this stage's cache holds {session.offset} tokens")
        self._leave_group(session, extract=True)
        if not can_trim_prompt_cache(session.cache):
            raise SessionError("a draft's proposals cannot be cut from this stage's caches (a rotating window that wrapped, or a recurrent state)")
        trim_prompt_cache(session.cache, cut)
        session.forget_last(cut)
        return session

    def rewind_group(self, cuts: dict[int, int]) -> bool:
        """Cut positions that verify rows left provisional from these live sessions, in their
        group's batched caches: ``cuts`` maps each request of one group, in its order, to the
        positions to cut (0 for none). False (nothing cut) where they are not one whole group
        of plain attention caches; then ``rewind`` cuts each alone."""
        sessions = [self._live.get(rid) for rid in cuts]
        if any(s is None for s in sessions):
            return False
        group = sessions[0].group
        if group is None or group.rids != tuple(cuts) or not all(type(c) is BatchKVCache for c in group.cache):
            return False
        if not all(0 <= n <= s.provisional for s, n in zip(sessions, cuts.values())):
            return False
        padding = list(cuts.values())
        for c in group.cache:
            c.prepare(right_padding=padding)
            c.finalize()
        for session, n in zip(sessions, padding):
            session.forget_last(n)
            session.last_used = time.monotonic()
        return True

    def batched(self, request_ids: tuple[int, ...]) -> list[Any] | None:
        """Batched caches for these live requests' rows, in this order; None if they cannot be
        merged (then their rows step one at a time). The same requests in the same order as last
        time reuse the group as it is; any other set regroups them."""
        sessions = [self.get(rid) for rid in request_ids]
        group = sessions[0].group
        if group is not None and group.rids == tuple(request_ids):
            return group.cache
        for session in sessions:
            self._leave_group(session, extract=True)
        # A quantized KV cache (kv_bits) is quantized between steps as mlx-lm's generate_step
        # does it, one request at a time: such requests step alone.
        if not all(batchable(s.cache) and (s.kv is None or s.kv.bits is None) for s in sessions):
            return None
        if len({tuple(map(_kind, s.cache)) for s in sessions}) > 1:
            return None  # layers of other kinds (another request's options): never merged together
        layers = len(sessions[0].cache)
        group = Group(tuple(request_ids), [type(sessions[0].cache[i]).merge([s.cache[i] for s in sessions]) for i in range(layers)])
        for session in sessions:
            session.cache, session.group = None, group
        return group.cache

    def states(self, request_ids) -> list:
        """The cache states of these live requests (a group's once), and their poolings, for ``mx.eval``."""
        seen, out = set(), []
        for rid in request_ids:
            session = self._live.get(rid)
            if session is None:
                continue
            cache = session.group.cache if session.group is not None else session.cache
            if id(cache) not in seen:
                seen.add(id(cache))
                out += [c.state for c in cache]
            if session.pool is not None:
                out += session.pool.arrays()
        return out

    def _leave_group(self, session: Session, extract: bool) -> None:
        """Take ``session`` out of its group: with its caches (``extract``) or without (it ends).
        A group left with one request gives it its caches back too."""
        group = session.group
        if group is None:
            return
        i = group.rids.index(session.request_id)
        if extract:
            session.cache = [c.extract(i) for c in group.cache]
        session.group = None
        rest = [j for j in range(len(group.rids)) if j != i]
        if len(rest) == 1:
            last = self._live.get(group.rids[rest[0]])
            if last is not None and last.group is group:
                last.cache, last.group = [c.extract(rest[0]) for c in group.cache], None
            group.rids, group.cache = (), []
            return
        for c in group.cache:
            c.filter(rest)
        group.rids = tuple(group.rids[j] for j in rest)

    def release(self, request_id: int) -> bool:
        session = self._live.pop(request_id, None)
        if session is None:
            return False
        self._leave_group(session, extract=False)
        return True

    def keep(self, request_id: int) -> bool:
        """End a request but store its caches under its id."""
        session = self._live.get(request_id)
        if session is None:
            return False
        self._leave_group(session, extract=True)
        del self._live[request_id]
        self._stored[request_id] = Stored(session.cache, session.tokens, session.name)
        while len(self._stored) > MAX_STORED:
            self._stored.popitem(last=False)
        return True

    def evict(self, key: int) -> bool:
        return self._stored.pop(key, None) is not None

    def take(self, key: int, keep: int) -> Stored:
        """Remove stored entry ``key``, trimmed to its first ``keep`` positions."""
        stored = self._stored.pop(key, None)
        if stored is None:
            raise SessionError(f"cached prefix {key:x} is not on this stage (evicted, or this stage was restarted)")
        if not 0 < keep <= len(stored.tokens):
            raise SessionError(f"cannot reuse {keep} positions of a cached prefix of {len(stored.tokens)}")
        excess = len(stored.tokens) - keep
        if excess and not can_trim_prompt_cache(stored.cache):
            raise SessionError("the cached prefix cannot be trimmed (a rotating KV cache that has wrapped)")
        trim_prompt_cache(stored.cache, excess)
        return Stored(stored.cache, stored.tokens[:keep], stored.name)

    @property
    def stored(self) -> int:
        return len(self._stored)

    def name_of(self, request_id: int) -> str | None:
        """The client's id of a live request or stored prefix here, if it gave one."""
        entry = self._live.get(request_id) or self._stored.get(request_id)
        return entry.name if entry is not None else None

    def expire(self, now: float | None = None) -> list[Session]:
        """Drop and return the sessions idle for longer than ``idle_timeout_s``."""
        now = time.monotonic() if now is None else now
        dead = [s for s in self._live.values() if now - s.last_used > self.idle_timeout_s]
        for s in dead:
            self.release(s.request_id)
        return dead

    def clear(self) -> None:
        self._live.clear()
        self._stored.clear()

    @property
    def kv_bytes(self) -> int:
        """KV bytes held: live requests and cached prefixes."""
        live = list(self._live.values())
        groups = {id(s.group): s.group for s in live if s.group is not None}
        return sum(s.kv_bytes for s in live) + sum(g.kv_bytes for g in groups.values()) + sum(s.kv_bytes for s in list(self._stored.values()))
