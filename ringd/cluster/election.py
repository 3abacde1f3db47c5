"""Who leads: a deterministic ranking of live nodes, and terms that only grow.

Sans-I/O: no sockets, no clocks, no asyncio. The daemon tells an ``Election``
which members are live (from membership), hands it the messages peers sent, and
sends every message it returns to every peer in its view. Heartbeats carry
``announcement()`` as well, so a lost message is repeated on the next beat.
This module ignores how liveness is detected, how messages travel and what a
leader does once elected (plans, the API).

There is no majority quorum: a 2-Mac cluster must survive one Mac dying, so a
lone node may lead. A leader is unique per term because of the term itself: a
``Term`` is a ballot ``(number, node)``, ordered lexicographically, and a node
only ever claims terms that carry its own id. Two partitions may each have a
leader, but never of the same term; when they heal, the higher term wins or is
out-claimed by the node that should lead.

The ranking of a view (the live members, node -> configured priority):

    1. the pinned node, if it is live (a pin of a dead node is ignored);
    2. higher priority first;
    3. node id in natural order (node2 before node10), then plain string order,
       so that ids natural order cannot tell apart ("n1", "n01") still have one.

The rules, run after every input (a view, a message, a pin):

    - ``term`` is the highest term this node has seen or claimed; it only grows.
      Every message carries the sender's term, the leader it follows and its pin;
      the receiver keeps the larger term and the larger pin.
    - The top of the ranking of this node's view is the node that should lead.
    - If that is this node and it has not claimed ``term`` itself (in this run
      of the process), it claims ``(term.number + 1, node)`` and announces it.
      So a leader that hears a higher term from anyone, a node it outranks
      included, claims a still higher one, and the right node wins a heal.
      A leader keeps its term while it stays first, whoever else comes and goes.
    - If the top is another node, this node is not leader (a leader that is
      outranked steps down). It follows the top once ``term`` is the top's
      claim; until that claim arrives, it follows nobody (``leader`` is None).
      A follower whose leader leaves its view therefore recomputes at once.
    - A message from a node outside the view is ignored: membership decides who
      is live, and two nodes whose views disagree must not out-claim each other
      forever.
    - Whenever the view's member set, the term, the pin or the leader changes,
      this node announces its state; the caller sends it to the whole view.

Within one connected group whose members see each other, once the messages
have been delivered every node holds the same pin and the same term, that term
is the top node's own claim, and every node follows it: exactly one leader.

Pins: ``Pin(epoch, node)``, ``node=None`` meaning "auto". ``ringctl leader set
NODE`` makes ``pin.next(NODE)``, ``ringctl leader auto`` makes ``pin.next(None)``;
the higher pin replaces the lower everywhere it travels.

What the daemon must persist (``to_wire``/``from_wire`` on both): the pin,
so that a manual pin survives a restart, and the term, written before the
messages that announce it are sent. A node that restarted without its term
could claim a term it already claimed in its previous run (alone, it would
claim ``(1, node)`` again), and followers that still hold the old run's plan
for that term would take the new plan for the old one. With the term on disk a
restarted node's first claim is above every claim it ever made.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import total_ordering
from typing import Mapping

from ringd.base.names import check_name, natural_key

# Term numbers and pin epochs travel in JSON descriptors; beyond 2**53 - 1 some
# JSON readers no longer hold an integer exactly.
MAX_TERM_NUMBER = 2**53 - 1
MAX_PIN_EPOCH = 2**53 - 1
# Node ids follow config's rule for ``name``: 1-63 letters, digits, '.', '_', '-'.


class ElectionError(ValueError):
    """A malformed term, pin or message (usually from the network); the message says what."""


def _check_int(what: str, v: object, limit: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
        raise ElectionError(f"{what} must be an integer from 0 to {limit}, got {v!r}")
    return v


def _check_node(what: str, v: object) -> str:
    try:
        check_name(v)
    except ValueError:
        raise ElectionError(
            f"{what} must be a node id (1-63 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit), got {v!r}"
        ) from None
    return v


def _pair(what: str, d: object) -> tuple[object, object]:
    if not isinstance(d, (list, tuple)) or len(d) != 2:
        raise ElectionError(f"{what} must be a 2-item list, got {d!r}")
    return d[0], d[1]


@dataclass(frozen=True, order=True)
class Term:
    """A ballot: ordered by number, then node id. ``Term(0, "")`` is "no term yet"."""

    number: int
    node: str

    def __post_init__(self):
        _check_int("term number", self.number, MAX_TERM_NUMBER)
        if not (self.number == 0 and self.node == ""):
            _check_node("term node", self.node)

    def to_wire(self) -> list:
        return [self.number, self.node]

    @classmethod
    def from_wire(cls, d: object) -> "Term":
        number, node = _pair("term", d)
        return cls(number, node)


NO_TERM = Term(0, "")


@total_ordering
@dataclass(frozen=True)
class Pin:
    """A manual choice of leader (``node``) or "auto" (``node=None``), versioned by ``epoch``.

    The higher epoch wins. At equal epochs (two pins made at once in two
    partitions) a pin to a node beats auto, and the larger node id wins: an
    arbitrary rule, but the same on every node.
    """

    epoch: int = 0
    node: str | None = None

    def __post_init__(self):
        _check_int("pin epoch", self.epoch, MAX_PIN_EPOCH)
        if self.node is not None:
            _check_node("pinned node", self.node)

    def _key(self) -> tuple[int, bool, str]:
        return (self.epoch, self.node is not None, self.node or "")

    def __lt__(self, other: "Pin") -> bool:
        if not isinstance(other, Pin):
            return NotImplemented
        return self._key() < other._key()

    def next(self, node: str | None) -> "Pin":
        """The pin that replaces this one: ``leader set NODE`` is ``next(NODE)``, ``leader auto`` is ``next(None)``."""
        return Pin(self.epoch + 1, node)

    def to_wire(self) -> list:
        return [self.epoch, self.node]

    @classmethod
    def from_wire(cls, d: object) -> "Pin":
        epoch, node = _pair("pin", d)
        return cls(epoch, node)


@dataclass(frozen=True)
class Announce:
    """A node's election state: its term, the leader it follows (None: nobody yet), its pin."""

    term: Term
    leader: str | None
    pin: Pin

    def to_wire(self) -> dict:
        return {"term": self.term.to_wire(), "leader": self.leader, "pin": self.pin.to_wire()}

    @classmethod
    def from_wire(cls, d: object) -> "Announce":
        if not isinstance(d, dict) or set(d) != {"term", "leader", "pin"}:
            raise ElectionError(f"an election message is an object with keys term, leader and pin, got {d!r}")
        leader = d["leader"]
        if leader is not None:
            _check_node("leader", leader)
        return cls(Term.from_wire(d["term"]), leader, Pin.from_wire(d["pin"]))


Msg = Announce  # the one election message; the alias keeps call sites stable if more appear


def rank(members: Mapping[str, int], pin: Pin) -> list[str]:
    """Live members (node -> priority), best first: the live pinned node, then priority, then natural id."""
    return sorted(members, key=lambda n: (n != pin.node, -members[n], natural_key(n), n))


class Election:
    """One node's election state. Feed it views, messages and pins; send what it returns.

    ``term`` and ``pin`` passed in are what the node persisted before it stopped.
    Nothing is decided until the first ``view()``: until then ``leader`` is None.
    """

    def __init__(self, node: str, priority: int, pin: Pin = Pin(), term: Term | None = None):
        self.node = node
        self.priority = priority
        self._pin = pin
        self._term = term if term is not None else NO_TERM
        self._claimed: Term | None = None  # the term this process claimed, if it leads or led
        self._members: dict[str, int] = {node: priority}
        self._leader: str | None = None

    @property
    def leader(self) -> str | None:
        """The node this node follows (itself when it leads); None while it waits for a claim."""
        return self._leader

    @property
    def term(self) -> Term:
        """The highest term seen or claimed; only grows. Persist it before sending what changed it."""
        return self._term

    @property
    def pin(self) -> Pin:
        return self._pin

    @property
    def is_leader(self) -> bool:
        return self._leader == self.node

    @property
    def members(self) -> dict[str, int]:
        """The current view, this node included."""
        return dict(self._members)

    def announcement(self) -> Announce:
        """This node's state, for heartbeats."""
        return Announce(self._term, self._leader, self._pin)

    def view(self, members: Mapping[str, int]) -> list[Msg]:
        """The live members (node -> priority) as membership sees them; this node is added with its own priority."""
        members = {**members, self.node: self.priority}
        before = self.announcement()
        changed = members != self._members
        self._members = members
        return self._update(before, announce=changed)

    def receive(self, sender: str, msg: Msg) -> list[Msg]:
        """A peer's announcement. Ignored unless ``sender`` is in the view."""
        if sender == self.node or sender not in self._members:
            return []
        before = self.announcement()
        self._term = max(self._term, msg.term)
        self._pin = max(self._pin, msg.pin)
        return self._update(before)

    def next_term(self) -> list[Msg]:
        """A fresh term for the leader's next plan (see ``reconcile``): every plan has a term of its own.

        Only the leader may ask. The new term is above every term seen, so
        followers take it as they take any claim of the node they follow.
        """
        if not self.is_leader:
            raise ElectionError(f"{self.node} does not lead (it follows {self._leader}); only a leader claims terms for plans")
        self._term = self._claimed = Term(self._term.number + 1, self.node)
        return [self.announcement()]

    def set_pin(self, pin: Pin) -> list[Msg]:
        """A pin from ``ringctl`` (or from disk); ignored if an equal or higher pin is already known."""
        before = self.announcement()
        self._pin = max(self._pin, pin)
        return self._update(before)

    def _update(self, before: Announce, announce: bool = False) -> list[Msg]:
        """Apply the rules; announce if asked to or if the state differs from ``before``."""
        top = rank(self._members, self._pin)[0]
        if top == self.node:
            if self._claimed != self._term:
                self._term = self._claimed = Term(self._term.number + 1, self.node)
            self._leader = self.node
        else:
            self._leader = top if self._term.node == top else None
        if announce or self.announcement() != before:
            return [self.announcement()]
        return []
