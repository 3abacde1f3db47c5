"""Prometheus metrics of one node, in a registry of its own.

Counters are bumped where things happen; gauges are read from the daemon's
state when ``/metrics`` is scraped (``refresh``), so nothing polls.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge


class Metrics:
    def __init__(self, node: str, state: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self._state = state
        labels = {"node": node}
        r = self.registry
        self.prompt_tokens = Counter("ringd_prompt_tokens", "Prompt tokens admitted by this node's API", registry=r)
        self.completion_tokens = Counter("ringd_completion_tokens", "Tokens generated for this node's API", registry=r)
        self._ready = Gauge("ringd_ring_ready", "1 when this node's ring serves requests", ["node"], registry=r).labels(**labels)
        self._sessions = Gauge("ringd_stage_sessions", "Requests holding KV caches on this stage", ["node"], registry=r).labels(**labels)
        self._kv = Gauge("ringd_stage_kv_bytes", "KV cache bytes held on this stage", ["node"], registry=r).labels(**labels)
        self._params = Gauge("ringd_stage_parameter_bytes", "Model parameter bytes materialized on this node", ["node"], registry=r).labels(**labels)
        self._active = Gauge("ringd_active_requests", "Requests generating through this leader", ["node"], registry=r).labels(**labels)
        self._peers = Gauge("ringd_linked_peers", "Peers with an authenticated link", ["node"], registry=r).labels(**labels)

    def refresh(self) -> None:
        s = self._state()
        self._ready.set(1 if s.get("ready") else 0)
        self._sessions.set(s.get("sessions", 0))
        self._kv.set(s.get("kv_bytes", 0))
        self._params.set(s.get("parameter_bytes", 0))
        self._active.set(s.get("active_requests", 0))
        self._peers.set(len(s.get("peers", [])))
