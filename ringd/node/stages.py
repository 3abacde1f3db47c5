"""This node's stages: one per instance of the leader's it holds layers of.

The model the cluster was started with has its stage always (``default``, the
one ``StageHost`` a node had before instances). Each other instance the leader
places gets a ``StageHost`` here when its first PLAN arrives (the plan names the
instance and the model: each node finds the model in its own model list,
``resolve``), and loses it on UNLOAD, or when the leader that placed it is no
longer the leader and the leaders' heartbeats no longer name it among the models they keep
(a new leader loads those again, and its plan finds the stage with its layers).

Frames are routed by the ring they name: a FORWARD or RELEASE carries its
plan's term, and terms are unique across the leader's plans (every plan claims
a fresh one), so the term finds the stage; a frame of no stage here goes to the
default stage, which answers it as a stage with nothing loaded does.
"""

from __future__ import annotations

import logging
from typing import Callable

from ringd.cluster.messages import MAX_INSTANCES, MessageError
from ringd.cluster.reconcile import Report
from ringd.node.stagehost import StageHost, plan_term
from ringd.ring.plan import MAX_INSTANCE_CHARS, MAX_TERM, PlacementError, Plan
from ringd.ring.steps import term_of
from wire.frames import Frame

log = logging.getLogger(__name__)


class Unload:
    """An UNLOAD frame, parsed strictly: drop ``instance``'s stage of a plan no newer than ``term``."""

    def __init__(self, instance: str, term: int, leader: str):
        self.instance, self.term, self.leader = instance, term, leader

    def to_wire(self) -> dict:
        return {"instance": self.instance, "term": self.term, "leader": self.leader}

    @classmethod
    def from_wire(cls, d: object) -> "Unload":
        if not isinstance(d, dict) or set(d) != {"instance", "term", "leader"}:
            raise MessageError(f"an UNLOAD holds exactly instance, term and leader, got {d!r:.200}")
        instance, term, leader = d["instance"], d["term"], d["leader"]
        if not isinstance(instance, str) or not 0 < len(instance) <= MAX_INSTANCE_CHARS:
            raise MessageError(f"UNLOAD instance must be a name of 1 to {MAX_INSTANCE_CHARS} characters")
        if type(term) is not int or not 0 <= term <= MAX_TERM:
            raise MessageError(f"UNLOAD term must be an integer from 0 to {MAX_TERM}")
        if not isinstance(leader, str):
            raise MessageError("UNLOAD leader must be a node name")
        return cls(instance, term, leader)


class Stages:
    def __init__(self, make: Callable[[str], StageHost]):
        """``make(instance)``: a stage host for an instance ("": the configured model's, made now;
        another's when its first plan arrives). Each resolves its model at its first load."""
        self.default = make("")
        self._make = make
        self.others: dict[str, StageHost] = {}

    def all(self) -> list[StageHost]:
        return [self.default, *self.others.values()]

    def take(self, sender: str, d: object, leader: str | None) -> tuple[StageHost, Plan] | None:
        """A PLAN frame: the host that takes it and the plan to load, or None."""
        instance = d.get("instance", "") if isinstance(d, dict) else ""
        if not isinstance(instance, str) or len(instance) > MAX_INSTANCE_CHARS:
            log.warning("ignoring a plan from %s with a malformed instance name", sender)
            return None
        host = self.default if not instance else self.others.get(instance)
        if host is None:
            if len(self.others) >= MAX_INSTANCES:
                log.warning("ignoring plan of instance %r from %s: this node holds %d instances already", instance, sender, MAX_INSTANCES)
                return None
            try:
                Plan.from_wire(d)  # a malformed plan makes no host
            except PlacementError as e:
                log.warning("ignoring a malformed plan from %s: %s", sender, e)
                return None
            host = self.others[instance] = self._make(instance)
        plan = host.take(sender, d, leader)
        return (host, plan) if plan is not None else None

    def unload(self, sender: str, d: object, leader: str | None) -> None:
        """An UNLOAD frame from the leader: the instance's stage goes, its memory with it."""
        try:
            u = Unload.from_wire(d)
        except MessageError as e:
            log.warning("ignoring a malformed UNLOAD from %s: %s", sender, e)
            return
        if sender != leader or u.leader != sender:
            log.warning("ignoring UNLOAD of %r from %s: the leader here is %s", u.instance, sender, leader)
            return
        host = self.others.get(u.instance)
        if host is None or (host.plan is not None and host.plan.term > u.term):
            return  # not held, or placed again since
        self._drop(u.instance, "the leader unloaded it")

    def leader_is(self, leader: str | None, kept: set[str] = frozenset()) -> None:
        """The election follows ``leader`` now: stages placed by another leader go, but those of
        the instances in ``kept`` (the models the leaders keep loaded, as their heartbeats say):
        the new leader loads them again, and a stage placed alike keeps its layers."""
        for instance, host in list(self.others.items()):
            if (host.plan is None or host.plan.leader != leader) and instance not in kept:
                self._drop(instance, f"its leader {host.plan.leader if host.plan else '?'} no longer leads")

    def _drop(self, instance: str, why: str) -> None:
        host = self.others.pop(instance)
        log.info("dropping the stage of instance %s: %s", instance, why)
        host.stop()
        host.forget()

    def route(self, frame: Frame) -> StageHost:
        """The stage a FORWARD or RELEASE is for, by the ring (term) it names."""
        term = term_of(frame)
        if term is not None and self.others:
            for host in self.others.values():
                if host.plan is not None and host.plan.term == term:
                    return host
        return self.default

    def reports(self) -> tuple[Report, ...]:
        """The other instances' reports, for heartbeats."""
        return tuple(h.report for h in self.others.values() if h.plan is not None)

    def check_links(self, links: dict[str, int]) -> None:
        for host in self.all():
            host.check_links(links)

    def stop(self) -> None:
        for host in self.all():
            host.stop()

    def expire_idle(self) -> None:
        for host in self.all():
            if host.stage is not None:
                host.stage.expire_idle()

    def named(self, instance: str) -> StageHost | None:
        return self.default if not instance else self.others.get(instance)

    def status(self) -> list[dict]:
        """Each other instance's stage here, for status."""
        return [{"instance": i, "term": plan_term(h.plan).number if h.plan else None, **h.status()} for i, h in self.others.items()]
