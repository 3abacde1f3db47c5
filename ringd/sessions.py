"""Per-request state on one stage: its KV caches, its sampler, its position.

Every stage keeps the KV cache of its own layers for every live request; only
hidden states travel. A session is opened by a request's first frame, touched
by each later frame, and dropped by RELEASE, by an error, or when nobody has
talked to it for ``idle_timeout_s`` (a leader that died mid-request never sends
its RELEASE).

Only the compute thread mutates sessions (FORWARD and RELEASE of one request
are applied there in arrival order); the event loop only reads counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .sampling import RequestSampler

# A request silent this long is abandoned: its leader died or lost track of it.
# Decoding touches a session every token, so only a dead request is this idle.
SESSION_IDLE_TIMEOUT_S = 300.0
# Live requests per stage. Each holds KV caches; the leader admits fewer than
# this, so hitting it means a leader misbehaving, not ordinary load.
MAX_SESSIONS = 1024


class SessionError(Exception):
    """A frame does not fit the session it names; the request fails, the node stays up."""


@dataclass
class Session:
    request_id: int
    cache: list[Any]
    sampler: RequestSampler | None
    offset: int = 0  # tokens already in this stage's caches
    last_used: float = field(default_factory=time.monotonic)

    @property
    def kv_bytes(self) -> int:
        return sum(getattr(c, "nbytes", 0) for c in self.cache)


class Sessions:
    def __init__(self, idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S, max_sessions: int = MAX_SESSIONS):
        self.idle_timeout_s = idle_timeout_s
        self.max_sessions = max_sessions
        self._live: dict[int, Session] = {}

    def __len__(self) -> int:
        return len(self._live)

    def open(self, request_id: int, cache: list[Any], sampler: RequestSampler | None) -> Session:
        if request_id in self._live:
            raise SessionError(f"request {request_id:x} is already open on this stage")
        if len(self._live) >= self.max_sessions:
            raise SessionError(f"this stage already holds {self.max_sessions} requests (MAX_SESSIONS)")
        session = Session(request_id, cache, sampler)
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

    def expire(self, now: float | None = None) -> list[int]:
        now = time.monotonic() if now is None else now
        dead = [rid for rid, s in self._live.items() if now - s.last_used > self.idle_timeout_s]
        for rid in dead:
            del self._live[rid]
        return dead

    def clear(self) -> None:
        self._live.clear()

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in list(self._live.values()))
