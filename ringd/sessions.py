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

Only the compute thread mutates sessions (FORWARD and RELEASE of one request
are applied there in arrival order); the event loop only reads counts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from .sampling import RequestSampler

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
class Session:
    request_id: int
    cache: list[Any]
    sampler: RequestSampler | None
    offset: int = 0  # tokens already in this stage's caches
    last_used: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)  # the ids whose positions the caches hold
    kv: Any = None  # steps.KvOptions the caches follow
    name: str | None = None  # the client's request id (logs.py), for the lines about it

    @property
    def kv_bytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


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
        session = self._live.get(request_id)
        if session is None:
            raise SessionError(
                f"request {request_id:x} is not open on this stage (released, expired, or its first frame was lost)"
            )
        session.last_used = time.monotonic()
        return session

    def release(self, request_id: int) -> bool:
        return self._live.pop(request_id, None) is not None

    def keep(self, request_id: int) -> bool:
        """End a request but store its caches under its id."""
        session = self._live.pop(request_id, None)
        if session is None:
            return False
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
            del self._live[s.request_id]
        return dead

    def clear(self) -> None:
        self._live.clear()
        self._stored.clear()

    @property
    def kv_bytes(self) -> int:
        """KV bytes held: live requests and cached prefixes."""
        return sum(s.kv_bytes for s in list(self._live.values())) + sum(s.kv_bytes for s in list(self._stored.values()))
