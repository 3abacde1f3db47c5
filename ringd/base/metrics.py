"""Prometheus metrics of one node, in a registry of its own, and the leader's live figures.

Histograms and counters are observed where things happen: the engine (time to
first token, the gaps between tokens, queue wait, request duration, replays,
evictions), each stage (compute per frame, prefill or decode; a grammar's mask
per token), the links (time to hand a frame to the transport), the API
(requests by endpoint and status, tokens in and out), the leader (plans).
Gauges are produced at
scrape time by a collector that reads the node's parts (``Gauges``, filled by
the daemon from the objects themselves, not copied from a status document by
string key), memory included: the process's resident memory everywhere, MLX's
active and peak memory (Metal's unified memory on a Mac).

``Live`` keeps what the dashboard and ``ringctl top`` show of the leader:
decode tokens per second over the last LIVE_WINDOW_S and recent times to first
token.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, fields
from typing import Callable

import mlx.core as mx
import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from wire import stream as wire_stream

# The *_created series (each metric's creation time) double the exposition for nothing
# a ringd operator asks; the process's start time is in its status.
disable_created_metrics()

# Buckets, in seconds, for what people wait on. Time to first token: a short prompt on
# a small model takes tens of milliseconds, a long one on a big MoE tens of seconds.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Between two tokens: a few ms (small model, one Mac) to a second (huge model, many hops).
INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_WAIT_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
REQUEST_DURATION_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# One frame on one stage: a decode step of a small slice is sub-millisecond, a 512-token
# prefill chunk of a large slice seconds.
STAGE_COMPUTE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Handing a frame to the transport (encode, seal, queue): microseconds, milliseconds for big prefill frames.
LINK_SEND_BUCKETS_S = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1)
# A tensor-parallel group's all-reduce, as a member waits for the others' partials: tens of
# microseconds over Thunderbolt, milliseconds over Wi-Fi or when a member computes slower.
ALL_REDUCE_BUCKETS_S = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25)
# A grammar's mask, per sampled token, as the last stage waits for it: tens of microseconds
# when computed while MLX ran the step, milliseconds for a large vocabulary or a hard grammar.
# Rows a stage computes in one pass of its layers: 1 alone, up to steps.MAX_ROWS batched.
BATCH_ROWS_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GRAMMAR_MASK_BUCKETS_S = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.1)
# Live figures: tokens per second over this window; times to first token of this many requests.
LIVE_WINDOW_S = 10.0
LIVE_TTFT_REQUESTS = 20


@dataclass
class Gauges:
    """What this node holds right now, read from its parts at scrape time."""

    ready: bool = False
    leading: bool = False
    sessions: int = 0
    kv_bytes: int = 0
    kv_capacity: int | None = None
    parameter_bytes: int = 0
    budget: int | None = None
    active_requests: int = 0
    queued_requests: int = 0
    micro_batches: int = 0
    linked_peers: int = 0
    prefix_entries: int = 0
    # Counts, kept by the parts themselves and exposed as counters.
    leader_changes: int = 0
    task_restarts: int = 0
    heartbeats: int = 0


# Gauges fields that only ever grow: exposed as counters (name_total).
_COUNTS = {"leader_changes", "task_restarts", "heartbeats"}


_GAUGE_HELP = {
    "ready": "1 when this node can serve (the leader: its ring serves; a follower: it can forward to it)",
    "leading": "1 while this node leads the cluster",
    "sessions": "Requests holding KV caches on this node's stage",
    "kv_bytes": "KV cache bytes held on this node's stage (live requests and cached prefixes)",
    "kv_capacity": "KV cache bytes this node's stage may hold: its budget less its weights",
    "parameter_bytes": "Model parameter bytes materialized on this node",
    "budget": "Bytes this node may use for weights and KV cache",
    "active_requests": "Requests generating through this node (the leader)",
    "micro_batches": "Micro-batches this leader has around the ring right now (at most one per stage unless micro_batches says otherwise)",
    "queued_requests": "Requests waiting for KV room on this node (the leader)",
    "linked_peers": "Peers with an authenticated link",
    "prefix_entries": "Finished requests whose caches this stage keeps for prefix reuse",
    "leader_changes": "Times the leader this node follows changed (elections it saw decided)",
    "task_restarts": "Restarts of this node's long-running tasks after an unexpected error",
    "heartbeats": "Rounds of this node's heartbeat loop: each pings every peer and declares dead any silent past dead_after_s",
}


class _Collector:
    """Gauges, produced when Prometheus scrapes, from the node's parts and the process."""

    def __init__(self, node: str, read: Callable[[], Gauges]):
        self.node = node
        self.read = read
        self._process = psutil.Process()

    def collect(self):
        g = self.read()
        for f in fields(Gauges):
            value = getattr(g, f.name)
            if value is None:
                continue
            if f.name in _COUNTS:
                counter = CounterMetricFamily(f"ringd_{f.name}", _GAUGE_HELP[f.name], labels=["node"])
                counter.add_metric([self.node], float(value))
                yield counter
            else:
                yield self._gauge(f"ringd_{f.name}", _GAUGE_HELP[f.name], float(value))
        yield self._gauge("ringd_process_resident_memory_bytes", "Resident memory of this node's process", float(self._process.memory_info().rss))
        yield self._gauge("ringd_mlx_active_memory_bytes", "Memory MLX holds in arrays (on a Mac: unified memory the GPU uses)", float(mx.get_active_memory()))
        yield self._gauge("ringd_mlx_peak_memory_bytes", "Most memory MLX has held in arrays since the node started", float(mx.get_peak_memory()))
        yield self._gauge("ringd_mlx_cache_memory_bytes", "Memory MLX keeps cached for reuse", float(mx.get_cache_memory()))
        events = CounterMetricFamily("ringd_ring_peer_events", "Ring-port events of misbehaving peers: failed handshakes, dropped links, connections refused, handshakes closed to make room for members", labels=["node", "kind"])
        for kind, n in sorted(wire_stream.EVENTS.items()):
            events.add_metric([self.node, kind], n)
        yield events

    def _gauge(self, name: str, help_: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help_, labels=["node"])
        g.add_metric([self.node], value)
        return g


class Live:
    """The leader's live figures: decode tokens/s over a window, recent times to first token.

    The engine writes and the status reads, both on the event loop.
    """

    def __init__(self):
        self._tokens: collections.deque[float] = collections.deque()  # when each token left, within the window
        self._ttft: collections.deque[float] = collections.deque(maxlen=LIVE_TTFT_REQUESTS)
        self.requests_total = 0
        self.tokens_out_total = 0

    def _forget_before(self, t: float) -> None:
        while self._tokens and self._tokens[0] < t:
            self._tokens.popleft()

    def token(self, now: float) -> None:
        # Pruned as tokens come, not only when read: a leader nobody watches keeps
        # the window's tokens, not every token since it started.
        self._forget_before(now - LIVE_WINDOW_S)
        self._tokens.append(now)
        self.tokens_out_total += 1

    def first_token(self, seconds: float) -> None:
        self._ttft.append(seconds)
        self.requests_total += 1

    def tokens_per_s(self, now: float) -> float:
        self._forget_before(now - LIVE_WINDOW_S)
        if len(self._tokens) < 2:
            return 0.0
        span = max(now - self._tokens[0], 1e-3)
        return round(len(self._tokens) / span, 2)

    def ttft_s(self) -> float | None:
        return round(statistics.median(self._ttft), 4) if self._ttft else None


class Metrics:
    """Every metric of one node; the parts observe what they see here."""

    def __init__(self, node: str, read: Callable[[], Gauges] = Gauges):
        self.node = node
        r = self.registry = CollectorRegistry()
        n = ["node"]
        self.ttft = Histogram("ringd_time_to_first_token_seconds", "From a request's arrival at the leader's engine to its first token", n, registry=r, buckets=TTFT_BUCKETS_S).labels(node)
        self.inter_token = Histogram("ringd_inter_token_latency_seconds", "Between two tokens of one request, at the leader", n, registry=r, buckets=INTER_TOKEN_BUCKETS_S).labels(node)
        self.queue_wait = Histogram("ringd_queue_wait_seconds", "How long a request waited for KV room before entering the ring", n, registry=r, buckets=QUEUE_WAIT_BUCKETS_S).labels(node)
        self.request_duration = Histogram("ringd_request_duration_seconds", "From a request's arrival at the engine to its end, however it ended", n, registry=r, buckets=REQUEST_DURATION_BUCKETS_S).labels(node)
        self._stage_compute = Histogram("ringd_stage_compute_seconds", "Compute of one frame on this node's stage", ["node", "phase"], registry=r, buckets=STAGE_COMPUTE_BUCKETS_S)
        self.stage_prefill = self._stage_compute.labels(node, "prefill")
        self.stage_decode = self._stage_compute.labels(node, "decode")
        self.grammar_mask = Histogram(
            "ringd_grammar_mask_seconds", "Waiting for and applying a grammar's mask, per token sampled on this node's stage",
            n, registry=r, buckets=GRAMMAR_MASK_BUCKETS_S,
        ).labels(node)  # fmt: skip
        self.micro_batch_rows = Histogram(
            "ringd_micro_batch_rows", "Rows (requests' steps) in each micro-batch this leader sends around the ring",
            n, registry=r, buckets=BATCH_ROWS_BUCKETS,
        ).labels(node)  # fmt: skip
        self.batch_rows = Histogram(
            "ringd_stage_batch_rows", "Rows this node's stage computes in one pass of its layers: 1 for a row alone, more when decode rows are batched",
            n, registry=r, buckets=BATCH_ROWS_BUCKETS,
        ).labels(node)  # fmt: skip
        self.all_reduce = Histogram(
            "ringd_all_reduce_seconds", "One all-reduce of this node's tensor-parallel group: from sending its partial sum to holding every member's",
            n, registry=r, buckets=ALL_REDUCE_BUCKETS_S,
        ).labels(node)  # fmt: skip
        self.link_send = Histogram("ringd_link_send_seconds", "Handing one frame to a link's transport: encoding, sealing, queueing", n, registry=r, buckets=LINK_SEND_BUCKETS_S).labels(node)
        self._requests = Counter("ringd_requests", "HTTP requests answered by this node, by endpoint and status", ["node", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ringd_prompt_tokens", "Prompt tokens admitted by this node's API", n, registry=r).labels(node)
        self.completion_tokens = Counter("ringd_completion_tokens", "Tokens generated for this node's API", n, registry=r).labels(node)
        self.resumed_tokens = Counter(
            "ringd_resumed_tokens", "Tokens of streams carried over from a leader that went away, replayed through this leader's ring (a decode step each)",
            n, registry=r,
        ).labels(node)  # fmt: skip
        self.replays = Counter("ringd_replays", "Requests replayed on a new ring (a stage died, a link broke, a stream was carried over)", n, registry=r).labels(node)
        self._evictions = Counter("ringd_evictions", "Cached prefixes evicted from the ring's stages, by why", ["node", "why"], registry=r)
        self._draft = Counter(
            "ringd_draft_tokens", "A draft model's proposals verified on this node's stage (the ring's last), by outcome: accepted or rejected",
            ["node", "outcome"], registry=r,
        )  # fmt: skip
        self.plans = Counter("ringd_plan_changes", "Plans this node made as leader", n, registry=r).labels(node)
        self.files_served = Counter("ringd_files_served_bytes", "Bytes of the model's files this node sent to peers fetching their layers", n, registry=r).labels(node)
        self._files_fetched = Counter(
            "ringd_files_fetched_bytes", "Bytes of the model's files this node fetched from peers, by outcome (verified, or refused: a chunk that did not match the manifest)",
            ["node", "outcome"], registry=r,
        )  # fmt: skip
        self._gauges = _Collector(node, read)
        r.register(self._gauges)
        self.live = Live()

    def read_gauges_from(self, read: Callable[[], Gauges]) -> None:
        """Where /metrics reads the node's gauges: its status, once the node is built (a model
        fetched from peers is counted here before)."""
        self._gauges.read = read

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(self.node, endpoint, str(status)).inc()

    def eviction(self, why: str) -> None:
        self._evictions.labels(self.node, why).inc()

    def draft_tokens(self, accepted: int, rejected: int) -> None:
        """One verify row's proposals: how many the last stage kept, how many it cut."""
        self._draft.labels(self.node, "accepted").inc(accepted)
        self._draft.labels(self.node, "rejected").inc(rejected)

    def files_fetched(self, verified: bool, nbytes: int) -> None:
        self._files_fetched.labels(self.node, "verified" if verified else "refused").inc(nbytes)

    def stage_compute(self, prefill: bool, seconds: float) -> None:
        (self.stage_prefill if prefill else self.stage_decode).observe(seconds)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.live.first_token(seconds)

    def token(self, gap_s: float | None) -> None:
        """A token streamed; ``gap_s`` since the request's previous one (None for its first)."""
        if gap_s is not None:
            self.inter_token.observe(gap_s)
        self.live.token(time.monotonic())

    def stats(self, active: int, queued: int, micro_batches: int = 0, drafts: tuple[int, int] = (0, 0)) -> dict:
        """The leader's live figures, for /cluster/status, the dashboard and `ringctl top`.
        ``drafts``: a draft model's proposals the ring kept, of those it verified (speculative decoding)."""
        live = self.live
        kept, proposed = drafts
        return {
            "tokens_per_s": live.tokens_per_s(time.monotonic()),
            "ttft_s": live.ttft_s(),
            "active_requests": active,
            "queued_requests": queued,
            "requests_total": live.requests_total,
            "tokens_out_total": live.tokens_out_total,
            "micro_batches": micro_batches,
            "draft_acceptance": round(kept / proposed, 4) if proposed else None,
        }
