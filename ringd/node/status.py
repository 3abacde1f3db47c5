"""What a node says about itself and the cluster: /health, /cluster/status, STATUS frames.

``local`` is this node's own status document; ``cluster`` gathers every
linked node's (over STATUS frames, each answer waited for at most
STATUS_TIMEOUT_S) into the document ``ringctl status`` prints. ``readiness``
is what /health answers: on the leader, whether its ring serves; on a
follower, whether it can serve by forwarding (``reconcile.follower_readiness``):
a follower no longer says "ok" while the cluster cannot serve.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

from ringd.cluster.links import LinkError
from ringd.cluster.members import Cluster
from ringd.cluster.reconcile import follower_readiness
from ringd.node.stagehost import StageHost
from ringd.base.metrics import Gauges, Metrics
from ringd.base.names import natural_key
from ringd.ring.statusdoc import ClusterStatus, NodeStatus
from ringd.base.tasks import Supervisor
from wire.frames import Frame, MsgType

log = logging.getLogger(__name__)

# How long /cluster/status waits for each node's answer before listing it as silent.
STATUS_TIMEOUT_S = 2.0


class Status:
    def __init__(
        self,
        node: str,
        cluster: Cluster,
        stage: StageHost,
        facts: Callable[[], dict],
        coordinator: Callable[[], object],
        kv_capacity: Callable[[int, int], int | None],
        budget: int | None,
        supervisor: Supervisor,
        metrics: Metrics,
    ):
        self.node = node
        self.budget = budget  # bytes for weights + KV cache
        self.supervisor = supervisor
        self.metrics = metrics
        self.cluster = cluster
        self.stage = stage
        self._facts = facts  # what the daemon knows of itself: addresses, model, device, budget
        self._coordinator = coordinator
        self._kv_capacity = kv_capacity  # KV bytes this node can hold beside layers [start, end)
        self._ids = itertools.count(1)
        self._waiters: dict[int, asyncio.Future] = {}

    def readiness(self) -> tuple[bool, str]:
        coordinator = self._coordinator()
        if coordinator is not None:
            return coordinator.ready, coordinator.reason
        serving, reason = self.cluster.leader_serving
        return follower_readiness(self.cluster.leader, self.cluster.leader_linked(), serving, reason, self.stage.report)

    def local(self) -> dict:
        cluster, coordinator = self.cluster, self._coordinator()
        ready, reason = self.readiness()
        plan = self.stage.plan
        facts = self._facts()
        stage = self.stage.status()
        layers = stage["layers"]
        return NodeStatus(
            node=self.node,
            role="leader" if coordinator is not None else "follower",
            leader=cluster.leader,
            election_term=cluster.election.term.to_wire(),
            pin=cluster.election.pin.node,
            ready=ready,
            reason=reason,
            term=plan.term if plan else 0,
            **facts,
            budget=self.budget,
            task_restarts=dict(self.supervisor.restarts),
            **stage,
            kv_capacity=None if layers is None else self._kv_capacity(*layers),
            prefix_reuse=coordinator.engine.prefix_note if coordinator else "",
            prefill_chunk=coordinator.engine.prefill_chunk if coordinator else None,
            queued_requests=coordinator.engine.queued if coordinator else 0,
            active_requests=coordinator.engine.active if coordinator else 0,
            peers=sorted(cluster.peers, key=natural_key),
            links={p: {"number": peer.number, "encrypted": peer.stream.encrypted} for p, peer in sorted(cluster.peers.items())},
            drained=sorted(cluster.drained, key=natural_key),
            stats=self._stats(coordinator.engine) if coordinator else None,
            layout=self._layout(coordinator),
        ).to_wire()

    @staticmethod
    def _layout(coordinator) -> dict | None:
        """The ring as its links shape it, and with tensor_parallel auto the groups chosen and why."""
        if coordinator is None or coordinator.layout is None:
            return None
        doc = coordinator.layout.to_wire()
        if coordinator.grouping is not None:
            doc["groups"] = coordinator.grouping.why
        return doc

    def _stats(self, engine) -> dict:
        sched = engine.scheduler
        return self.metrics.stats(engine.active, engine.queued, sched.in_flight, (sched.kept, sched.proposed))

    def gauges(self) -> Gauges:
        """What /metrics reports of this node, read from the same parts ``local`` reads."""
        coordinator, host = self._coordinator(), self.stage
        stage, shard = host.stage, host.shard
        engine = coordinator.engine if coordinator is not None else None
        return Gauges(
            ready=self.readiness()[0],
            leading=coordinator is not None,
            sessions=len(stage.sessions) if stage else 0,
            kv_bytes=stage.sessions.kv_bytes if stage else 0,
            kv_capacity=self._kv_capacity(shard.start, shard.end) if stage else None,
            parameter_bytes=shard.parameter_bytes if shard else 0,
            budget=self.budget,
            active_requests=engine.active if engine else 0,
            queued_requests=engine.queued if engine else 0,
            micro_batches=engine.scheduler.in_flight if engine else 0,
            linked_peers=len(self.cluster.peers),
            prefix_entries=stage.sessions.stored if stage else 0,
            leader_changes=self.cluster.leader_changes,
            task_restarts=sum(self.supervisor.restarts.values()),
            heartbeats=self.cluster.links.heartbeat_rounds,
        )

    async def cluster_status(self) -> dict:
        # The ring's members in ring order, then everyone else linked (drained,
        # joining, or outside a plan that could not be made).
        coordinator = self._coordinator()
        plan = coordinator.plan if coordinator is not None else self.stage.plan
        nodes = list(plan.nodes) if plan else []
        nodes += sorted({self.node, *self.cluster.peers} - set(nodes), key=natural_key)
        statuses = await asyncio.gather(*(self._status_of(n) for n in nodes))
        ready, reason = self.readiness()
        # Each node's document as it sent it: a newer peer's fields pass through to the dashboard.
        return {**ClusterStatus(self.node, self.cluster.leader, ready, reason, plan.to_wire() if plan else None).to_wire(), "nodes": statuses}

    async def _status_of(self, node: str) -> dict:
        if node == self.node:
            return self.local()
        sid = next(self._ids)
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[sid] = waiter
        try:
            self.cluster.send(node, Frame(MsgType.STATUS, 0, {"id": sid}))
            async with asyncio.timeout(STATUS_TIMEOUT_S):
                return await waiter
        except (LinkError, TimeoutError) as e:
            return NodeStatus(node, error=f"no answer: {e or 'timed out'}").to_wire()
        finally:
            self._waiters.pop(sid, None)

    def on_frame(self, peer: str, frame: Frame) -> None:
        d = frame.descriptor
        if frame.type == MsgType.STATUS:
            self.cluster.send(peer, Frame(MsgType.STATUS_REPLY, 0, {"id": d.get("id"), "status": self.local()}))
            return
        waiter = self._waiters.pop(d.get("id"), None) if isinstance(d.get("id"), int) else None
        status = d.get("status")
        if waiter is not None and not waiter.done():
            if isinstance(status, dict) and status.get("node") == peer:
                waiter.set_result(status)
            else:
                waiter.set_result(NodeStatus(peer, error="answered with a malformed status").to_wire())
