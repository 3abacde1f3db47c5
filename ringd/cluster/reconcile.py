"""Plan reconciliation: does every live member run the plan it should, and if not, what now?

Sans-I/O, beside ``election.py``: no sockets, no clocks (``now`` is passed in),
no asyncio, no MLX. The daemon feeds it what membership and heartbeats say and
acts on the ``Decision`` it returns; a simulated cluster feeds it the same under
Hypothesis (``tests/cluster/test_reconcile.py``).

Why it exists: a leader that only re-plans when the member list changes wedges
whenever the list comes back the same while the ring underneath did not. A
leader stalled for ten seconds (a Mac asleep) comes back to members that
followed another leader's plan meanwhile; a link dropped and re-made in a
quarter second lost the frames it carried; a plan sent into a link that broke
was never taken. The member list is the same each time, and each time the ring
cannot serve. So the leader compares what should be with what is, on every
tick, not only on change:

    - the holders (live, undrained, not api_only members) are the ones the
      current plan was made over;
    - every stage of the plan is still linked by the very link it had when the
      plan was made (a re-made link may have lost frames: the requests in flight
      must be replayed, which a new plan does);
    - every stage reports (in its heartbeats, and in LOADED) that it runs this
      plan, within PLAN_DELIVERY_BEATS heartbeats of the plan being sent.

Any mismatch means a fresh plan under a fresh term. Members outside the ring
(drained, api_only) that report another plan are sent the current one again, so
they drop the layers they no longer hold.

Terms: every plan is made under a term its leader claims for it
(``Election.next_term``), and a plan is named by that term, ``Term(number,
leader)``. Only the node a term names ever claims it, and it makes one plan per
claim, so two plans never share a name: at most one plan per term, by
construction. A follower takes a plan only from the leader its election
follows, and never one older than the plan it runs (``plan_refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ringd.cluster.election import ElectionError, Term
from ringd.ring.kvcost import KvCost, KvCostError
from ringd.ring.plan import MAX_INSTANCE_CHARS
from ringd.base.names import natural_key

# Each member's report rides its heartbeats (every heartbeat_interval_s): this many
# beats to hear that a member took a plan. A member that still reports another plan
# after them missed it (the link broke under it, or it follows someone else): a
# fresh plan fixes either.
PLAN_DELIVERY_BEATS = 10
# A stage that could not load its layers (out of memory, a file missing) is not
# asked again at once: memory may free up or a download finish, but re-planning
# in a tight loop would only repeat the failure. The same goes for a placement
# that did not fit the members' budgets while the members stay the same.
RETRY_AFTER_FAILURE_S = 30.0
# Load errors travel in heartbeats: keep them a line, not a traceback.
MAX_ERROR_CHARS = 300

# What a node says of its stage, for the plan it names.
IDLE = "idle"  # no plan taken yet
LOADING = "loading"  # loading (or about to load) the layers the plan gives it
LOADED = "loaded"  # its layers are loaded; it serves the plan
FAILED = "failed"  # it could not load them; ``error`` says why
OUTSIDE = "outside"  # the plan gives it no layers (drained, api_only)
# It loaded them, but since then a link to a neighbour in the ring dropped (or a
# frame could not be passed on): frames may be lost, so the ring needs a fresh
# plan and the requests in flight a replay. ``error`` says which link. The
# leader sees its own links drop; this is how it hears of the others.
BROKEN = "broken"
STATES = (IDLE, LOADING, LOADED, FAILED, OUTSIDE, BROKEN)


class ReportError(ValueError):
    """A malformed report (usually from the network); the message says what."""


@dataclass(frozen=True)
class Report:
    """A node's word on its stage: which plan it took, and how far it got.

    ``kv``: once loaded, what a request's caches cost on the stage (measured from
    its own caches), for the leader's admission ledger.
    """

    plan: Term | None = None
    state: str = IDLE
    error: str | None = None
    kv: KvCost | None = None
    # Which of the leader's instances the stage is of ("": the model the cluster was started with).
    instance: str = ""

    def __post_init__(self):
        if not isinstance(self.instance, str) or len(self.instance) > MAX_INSTANCE_CHARS or not self.instance.isprintable():
            raise ReportError(f"report instance must be a printable string of at most {MAX_INSTANCE_CHARS} characters")
        if self.state not in STATES:
            raise ReportError(f"report state must be one of {', '.join(STATES)}, got {self.state!r:.40}")
        if (self.plan is None) != (self.state == IDLE):
            raise ReportError("a report names a plan unless it is idle, and only then")
        if self.error is not None and (not isinstance(self.error, str) or len(self.error) > MAX_ERROR_CHARS):
            raise ReportError(f"report error must be a string of at most {MAX_ERROR_CHARS} characters")

    def runs(self, term: Term) -> bool:
        return self.plan == term and self.state != IDLE

    def to_wire(self) -> dict:
        d = {"plan": self.plan.to_wire() if self.plan else None, "state": self.state, "error": self.error}
        if self.kv is not None:
            d["kv"] = self.kv.to_wire()
        if self.instance:
            d["instance"] = self.instance
        return d

    @classmethod
    def from_wire(cls, d: object) -> "Report":
        if not isinstance(d, dict) or not {"plan", "state", "error"} <= set(d) <= {"plan", "state", "error", "kv", "instance"}:
            raise ReportError(f"a report is an object with keys plan, state, error (and kv, instance), got {d!r:.200}")
        try:
            plan = None if d["plan"] is None else Term.from_wire(d["plan"])
            kv = KvCost.from_wire(d["kv"]) if d.get("kv") is not None else None
        except (ElectionError, KvCostError) as e:
            raise ReportError(f"report: {e}") from None
        if not isinstance(d["state"], str):
            raise ReportError(f"report state must be a string, got {d['state']!r:.40}")
        return cls(plan, d["state"], d["error"], kv, d.get("instance", ""))


def failure_report(term: Term, error: str) -> Report:
    """A FAILED report, its error cut to fit a heartbeat."""
    return Report(term, FAILED, error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 3] + "...")


@dataclass(frozen=True)
class Member:
    """A live member as the leader sees it.

    ``link`` names the link to it (a new number each time a link is made; the
    leader's own entry uses 0). ``holder``: it may hold layers (not drained, not
    api_only). ``report``: its last word, None if it has said nothing yet.
    """

    link: int
    holder: bool
    report: Report | None = None


@dataclass(frozen=True)
class Decision:
    """What the leader should do now.

    ``plan_over``: make a fresh plan (under a fresh term) over these holders and
    send it to every member; then call ``Reconciler.planned`` (or
    ``placement_failed``). ``inform``: send the current plan again to these
    members (outside its ring). ``ready``: the ring serves; otherwise ``reason``
    says why not.
    """

    plan_over: tuple[str, ...] | None = None
    inform: tuple[str, ...] = ()
    ready: bool = False
    reason: str = ""
    failed: bool = False  # a stage could not load its layers (``reason`` says which and why)


@dataclass
class _Planned:
    term: Term
    stages: tuple[str, ...]  # ring order
    over: frozenset[str]  # the holders it was made over
    links: dict[str, int]  # each stage's link when the plan was made
    sent_at: float
    informed: dict[str, float] = field(default_factory=dict)  # member -> when it was last sent the plan


@dataclass(frozen=True)
class _Failure:
    over: frozenset[str]
    at: float
    reason: str


class Reconciler:
    """The leader's side. Feed it ``tick`` as often as the daemon likes; it is idempotent.

    ``heartbeat_interval_s``: how often members' reports arrive (config), which sets how
    long a plan may take to be heard of (``plan_delivery_timeout_s``)."""

    def __init__(self, node: str, heartbeat_interval_s: float):
        self.node = node
        self.plan_delivery_timeout_s = PLAN_DELIVERY_BEATS * heartbeat_interval_s
        self._plan: _Planned | None = None
        self._failure: _Failure | None = None

    @property
    def term(self) -> Term | None:
        """The term of the current plan, if any."""
        return self._plan.term if self._plan else None

    @property
    def over(self) -> tuple[str, ...] | None:
        """The holders the current plan was made over (name order), if any."""
        return tuple(sorted(self._plan.over, key=natural_key)) if self._plan else None

    def reset(self) -> None:
        """This node stopped leading: whatever it planned is someone else's business now."""
        self._plan = None
        self._failure = None

    def planned(self, now: float, term: Term, stages: tuple[str, ...], over: tuple[str, ...], members: Mapping[str, Member]) -> None:
        """The daemon made (and sent to every member) the plan ``term`` with ``stages`` in ring order."""
        if term.node != self.node:
            raise ValueError(f"{self.node} cannot make a plan under {term}, a term of another node")
        if self._plan is not None and term <= self._plan.term:
            raise ValueError(f"plan {term} is not newer than the current plan {self._plan.term}")
        self._plan = _Planned(
            term, tuple(stages), frozenset(over), {s: members[s].link for s in stages}, now, dict.fromkeys(members, now)
        )
        self._failure = None

    def placement_failed(self, now: float, over: tuple[str, ...], reason: str) -> None:
        """No plan fits ``over``: serve nothing, and don't try again until they change or time passes."""
        self._plan = None
        self._failure = _Failure(frozenset(over), now, reason)

    def tick(self, now: float, members: Mapping[str, Member], hold: str | None = None) -> Decision:
        """Compare the current plan with ``members`` (this node included).

        ``hold`` (the first plan only): a reason to wait before planning at all,
        such as nodes still being discovered.
        """
        holders = tuple(sorted((n for n, m in members.items() if m.holder), key=natural_key))
        plan = self._plan
        if plan is None:
            if hold is not None:
                return Decision(reason=hold)
            if not holders:
                return Decision(reason="no live node may hold layers (every one is drained or api_only)")
            return self._replan(now, holders, "no plan yet")
        why = self._mismatch(now, plan, members, holders)
        if why is not None:
            return self._replan(now, holders, why)
        inform = tuple(
            n
            for n, m in members.items()
            if n not in plan.stages
            and not (m.report is not None and m.report.runs(plan.term))
            and now - plan.informed.get(n, -self.plan_delivery_timeout_s) >= self.plan_delivery_timeout_s
        )
        for n in inform:
            plan.informed[n] = now
        failed = [(s, members[s].report) for s in plan.stages if members[s].report is not None and members[s].report.plan == plan.term and members[s].report.state == FAILED]
        if failed:
            node, report = failed[0]
            reason = f"node {node} could not load its layers: {report.error or 'no reason given'}"
            if now - plan.sent_at >= RETRY_AFTER_FAILURE_S:
                return Decision(plan_over=holders, inform=inform, reason=reason + "; trying a fresh plan", failed=True)
            return Decision(inform=inform, reason=reason, failed=True)
        waiting = [s for s in plan.stages if not (members[s].report is not None and members[s].report.plan == plan.term and members[s].report.state == LOADED)]
        if waiting:
            return Decision(inform=inform, reason=f"loading plan term {plan.term.number}; waiting for {', '.join(waiting)}")
        return Decision(inform=inform, ready=True)

    def _replan(self, now: float, holders: tuple[str, ...], why: str) -> Decision:
        f = self._failure
        if f is not None and f.over == frozenset(holders) and now - f.at < RETRY_AFTER_FAILURE_S:
            return Decision(reason=f.reason)
        return Decision(plan_over=holders, reason=f"re-planning: {why}")

    def _mismatch(self, now: float, plan: _Planned, members: Mapping[str, Member], holders: tuple[str, ...]) -> str | None:
        """Why the current plan cannot stand, or None."""
        for s in plan.stages:
            if s not in members:
                return f"node {s} left the ring"
            if members[s].link != plan.links[s]:
                return f"the link to {s} was re-made (frames on the old one may be lost)"
        for s in plan.stages:
            report = members[s].report
            if report is not None and report.plan == plan.term and report.state == BROKEN:
                return f"node {s} lost a link of the ring ({report.error or 'no detail'})"
        if frozenset(holders) != plan.over:
            joined = sorted(frozenset(holders) - plan.over, key=natural_key)
            left = sorted(plan.over - frozenset(holders), key=natural_key)
            parts = ([f"{', '.join(joined)} joined"] if joined else []) + ([f"{', '.join(left)} left or drained"] if left else [])
            return "; ".join(parts)
        if now - plan.sent_at >= self.plan_delivery_timeout_s:
            for s in plan.stages:
                report = members[s].report
                if report is None or report.plan != plan.term:
                    said = "nothing" if report is None or report.plan is None else f"plan {report.plan.number} of {report.plan.node}"
                    return f"node {s} does not run plan term {plan.term.number} (it reports {said})"
        return None


def plan_refusal(plan: Term, sender: str, leader: str | None, current: Term | None) -> str | None:
    """Why a follower must not take the plan ``plan`` that came from ``sender``; None to take it.

    ``leader``: the node this follower's election follows. ``current``: the plan
    it runs. The same plan again (a resend) is taken: the answer is re-sent.
    """
    if plan.node != sender:
        return f"plan term {plan.number} names {plan.node} as its leader but came from {sender}"
    if leader != sender:
        return f"the leader here is {leader or 'not yet elected'}, not {sender}"
    # Only an older plan of the same leader is stale (it came on a link that lost a
    # tie-break and was still draining). Another leader's plan, even of a higher
    # term, was made by a leader this node no longer follows.
    if current is not None and current.node == plan.node and plan < current:
        return f"plan term {plan.number} of {plan.node} is older than the plan this node runs ({current.number})"
    return None


def follower_readiness(leader: str | None, leader_linked: bool, serving: Term | None, leader_reason: str, mine: Report) -> tuple[bool, str]:
    """Whether a follower's API can serve (by forwarding), and if not why: for its /health.

    ``serving``: the plan the leader says it serves (its heartbeat), None if it
    does not; ``mine``: this node's own report.
    """
    if leader is None:
        return False, "no leader is elected right now (an election is under way)"
    if not leader_linked:
        return False, f"no link to the leader {leader}"
    if serving is None:
        return False, f"the leader {leader} does not serve: {leader_reason or 'no reason given'}"
    if mine.plan == serving and mine.state not in (LOADED, OUTSIDE):
        doing = {LOADING: "still loading its layers", FAILED: "could not load its layers", BROKEN: "lost a link of the ring"}
        return False, f"this node {doing.get(mine.state, mine.state)} in plan term {serving.number}"
    if mine.plan != serving:
        return False, f"this node has not taken plan term {serving.number} yet"
    return True, ""
