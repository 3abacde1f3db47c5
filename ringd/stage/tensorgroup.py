"""A tensor-parallel group's all-reduce over the ring's own links: what mlx-lm's ``shard()`` calls.

mlx-lm cuts a model for tensor parallelism with ``Model.shard(group)``: it asks the
group its ``rank()`` and ``size()`` while it slices each layer's projections (heads,
MLP columns), and each sliced layer ends with ``mx.distributed.all_sum(x, group=group)``.
MLX's own groups come only from ``mx.distributed.init``, one global group per process
for the process's life, while a ring's groups form, re-form and dissolve as Macs come
and go (and MLX's TCP ``ring`` backend took 0.4-4 ms a call on loopback here, against
~40 us for a ringd hop). So a ``TensorGroup`` stands in for MLX's group: mlx-lm's own
code cuts the layers with it, and ``mx.distributed.all_sum`` (with ``all_gather``) is
fronted by a dispatcher that hands a call naming a TensorGroup to it and any other
group to MLX unchanged.

No all-reduce runs before every member has loaded the plan (the leader sends requests
only then): what a stage tests at load (its KV cost, whether it batches) runs ``alone``,
each member on its own slice, since a member that kept its layers from the last plan
tests nothing.

One all-reduce: the member's partial is evaluated, sent to every other member as a
REDUCE frame over the link the cluster already has (authenticated, sealed), and the
others' partials are added to it in rank order, so every member ends with the same
bits. With two members the sum is the one MLX's backends compute (a + b rounds the
same either way). Members apply the same frames in the same order, so their
all-reduces pair up by number; a partial out of turn, a member silent past the
deadline, a link that drops: the group is broken (``GroupError``), the stage says so,
and the leader re-plans and replays, as for any stage that fails.

Threads: ``all_sum`` runs on the compute thread and blocks it (the partials are what
the next matrix product needs); ``arrive`` and ``abort`` run on the event loop. Bytes
become arrays on the compute thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any, Callable

import mlx.core as mx

from ringd.ring.steps import Partial
from wire.frames import Frame, FrameError
from wire.tensors import DTYPE_CODES, tensor_to_buffer, wire_bits

log = logging.getLogger(__name__)

# How long a member waits for the others' partials of one all-reduce. A member's partial
# comes as soon as it has computed its slice of the layer up to there: a prompt chunk of
# one layer on a slow Mac takes well under a second. A member that died is noticed sooner,
# by its link (``abort``); this bounds one that stalls with its link up.
DEADLINE_S = 30.0
# Partials a member may hold from the others ahead of its own all-reduce: a member can be
# one all-reduce ahead (it finished the last one with ours); more is a peer out of step.
AHEAD = 2


class GroupError(Exception):
    """The group cannot finish an all-reduce (a member is gone, stalled, or out of step): the
    stage is broken and its requests go back to the leader to replay."""


# MLX's distributed backends name themselves at the head of their errors ("[ring] connection
# to a peer was lost"): in a group process (MLX's own collective) that is a member gone mid-step.
MLX_BACKEND_ERRORS = ("[ring]", "[jaccl]")


def lost_member(e: BaseException) -> bool:
    """Whether ``e`` is MLX's own collective failing (a member of a group process's group gone):
    the group is broken, as a GroupError says, not the request."""
    return isinstance(e, RuntimeError) and str(e).startswith(MLX_BACKEND_ERRORS)


_mlx_all_sum = mx.distributed.all_sum
_mlx_all_gather = mx.distributed.all_gather


class Collective:
    """What mlx-lm's ``shard()`` and its sharded layers see in place of ``mx.distributed.Group``:
    ``rank``/``size`` to cut with, ``all_sum``/``all_gather`` the dispatcher hands calls to, and
    ``alone`` for what a stage tests on its slice at load."""

    def rank(self) -> int:
        raise NotImplementedError

    def size(self) -> int:
        raise NotImplementedError

    def all_sum(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    def all_gather(self, x: mx.array) -> mx.array:
        raise NotImplementedError

    @contextlib.contextmanager
    def alone(self):
        """Within: no all-reduce leaves this member (a sum is this member's own part, a gather
        repeats it: the shapes are what they will be), for what a stage tests at load on its slice."""
        self._alone = True
        try:
            yield
        finally:
            self._alone = False

    _alone = False


class MlxGroup(Collective):
    """An MLX group (``mx.distributed.init``: jaccl's RDMA or the TCP ring) as a ``Collective``,
    in a group process (``groupworker.py``), where MLX's own collective does the all-reduce."""

    def __init__(self, group: mx.distributed.Group):
        _front_mlx()
        self.group = group

    def rank(self) -> int:
        return self.group.rank()

    def size(self) -> int:
        return self.group.size()

    def all_sum(self, x: mx.array) -> mx.array:
        return x if self._alone else _mlx_all_sum(x, group=self.group)

    def all_gather(self, x: mx.array) -> mx.array:
        return mx.concatenate([x] * self.size(), axis=0) if self._alone else _mlx_all_gather(x, group=self.group)


def _all_sum(x, *args, group=None, **kwargs):
    if isinstance(group, Collective):
        return group.all_sum(x)
    return _mlx_all_sum(x, *args, group=group, **kwargs)


def _all_gather(x, *args, group=None, **kwargs):
    if isinstance(group, Collective):
        return group.all_gather(x)
    return _mlx_all_gather(x, *args, group=group, **kwargs)


def _front_mlx() -> None:
    """Put the dispatchers in front of MLX's collectives (once; any other group still goes to MLX)."""
    if mx.distributed.all_sum is not _all_sum:
        mx.distributed.all_sum = _all_sum
        mx.distributed.all_gather = _all_gather


class TensorGroup(Collective):
    """This member's view of one group: ``rank`` of ``members`` (node names, rank order), the
    plan ``term`` it runs, and ``send(node, frame)`` (called on ``loop``) to reach the others."""

    def __init__(self, term: int, members: tuple[str, ...], rank: int, send: Callable[[str, Frame], None], loop: asyncio.AbstractEventLoop):
        if not 0 <= rank < len(members) or len(members) < 2:
            raise ValueError(f"rank {rank} of a group of {len(members)}")
        _front_mlx()
        self.members, self._rank = members, rank
        self._ranks = {node: i for i, node in enumerate(members)}
        self._send, self._loop = send, loop
        self.deadline_s = DEADLINE_S
        self._alone = False
        self._cond = threading.Condition()
        self.term = term
        self._seq = 0  # the all-reduce under way or next, numbered from 0 in each term
        self._inbox: dict[tuple[int, int, int], tuple[Partial, Any]] = {}  # (term, seq, rank) -> (partial, payload)
        self.broken: str | None = None
        self.on_break: Callable[[str], None] | None = None  # told why, once, from whichever thread broke it
        self.timed: Callable[[float], None] | None = None  # told each all-reduce's wait, in seconds (metrics)

    # mx.distributed.Group's interface, as mlx-lm's shard() uses it
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.members)

    # --- event loop -------------------------------------------------------------------

    def arrive(self, peer: str, frame: Frame) -> None:
        """A REDUCE from ``peer``: kept for the all-reduce it is for, or the group is broken."""
        rank = self._ranks.get(peer)
        if rank is None or rank == self._rank:
            log.warning("ignoring a partial sum from %s: not a member of this group %s", peer, list(self.members))
            return
        try:
            p = Partial.parse(frame)
        except FrameError as e:
            self.abort(f"{peer} sent a malformed partial sum: {e}")
            return
        with self._cond:
            if p.term != self.term:
                # Of a plan this group has left (its all-reduces were given up), or of one it has
                # not begun: the stage host holds those until its group runs that plan
                # (stagehost.py, ``_early``), so a member that took the plan first is heard.
                log.debug("ignoring partial sum %d of plan term %d from %s: this group runs term %d", p.seq, p.term, peer, self.term)
                return
            if not self._seq <= p.seq < self._seq + AHEAD:
                self._break(f"{peer} sent partial sum {p.seq} of plan term {p.term}, out of step with this member's {self._seq} of term {self.term}")
                return
            self._inbox[(p.term, p.seq, rank)] = (p, frame.payload)
            self._cond.notify_all()

    def abort(self, why: str, level: int = logging.WARNING) -> None:
        """Give up: the all-reduce under way (and every later one until ``reset``) raises GroupError."""
        with self._cond:
            self._break(why, level)

    def _break(self, why: str, level: int = logging.WARNING) -> None:
        # What waited for an all-reduce that will not happen goes now: mlx-lm keeps a group it saw
        # (sum_gradients' cache) long after its plan, and a prompt chunk's partial is megabytes.
        self._inbox.clear()
        if self.broken is None:
            self.broken = why
            log.log(level, "tensor-parallel group %s broken: %s", list(self.members), why)
            if self.on_break is not None:
                self.on_break(why)
        self._cond.notify_all()

    # --- compute thread ---------------------------------------------------------------

    def reset(self, term: int) -> None:
        """Run plan ``term`` (on the compute thread, after the last plan's queued work): the
        sequence starts again and what the old plan left is dropped."""
        with self._cond:
            self.term, self._seq, self.broken = term, 0, None
            self._inbox.clear()

    def all_sum(self, x: mx.array) -> mx.array:
        if self._alone:
            return x
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def all_gather(self, x: mx.array) -> mx.array:
        parts = [x] * self.size() if self._alone else self._exchange(x)
        return mx.concatenate(parts, axis=0)

    def gather_bytes(self, raw: bytes, deadline_s: float) -> list[bytes]:
        """Every member's ``raw`` (all of one length), in rank order, waiting up to ``deadline_s``
        for the others: what members tell each other as a group forms (``groupengine.Offer``)."""
        parts = self._exchange(mx.array(memoryview(raw), dtype=mx.uint8), deadline_s, timed=False)
        return [bytes(memoryview(p)) for p in parts]

    def _exchange(self, x: mx.array, deadline_s: float | None = None, timed: bool = True) -> list[mx.array]:
        """Every member's ``x``, in rank order (this member's own as it is)."""
        deadline_s = self.deadline_s if deadline_s is None else deadline_s
        if self.broken is not None:
            raise GroupError(self.broken)
        bits = wire_bits(x)
        mx.eval(bits)
        with self._cond:
            term, seq = self.term, self._seq
        frame = Partial(term, seq, DTYPE_CODES[x.dtype], x.size).frame(tensor_to_buffer(bits))
        self._loop.call_soon_threadsafe(self._send_all, frame)
        wanted = [(term, seq, r) for r in range(len(self.members)) if r != self._rank]
        started = time.perf_counter()
        with self._cond:
            ok = self._cond.wait_for(lambda: self.broken is not None or all(k in self._inbox for k in wanted), deadline_s)
            if self.broken is not None:
                raise GroupError(self.broken)
            if not ok:
                late = [self.members[r] for (_, _, r) in wanted if (term, seq, r) not in self._inbox]
                self._break(f"no partial sum {seq} from {', '.join(late)} within {deadline_s:.0f} s")
                raise GroupError(self.broken)
            got = {r: self._inbox.pop((term, seq, r)) for (_, _, r) in wanted}
            self._seq += 1
        if self.timed is not None and timed:
            self.timed(time.perf_counter() - started)
        parts = []
        for r in range(len(self.members)):
            if r == self._rank:
                parts.append(x)
                continue
            p, payload = got[r]
            if p.code != DTYPE_CODES[x.dtype] or p.count != x.size:
                self.abort(f"{self.members[r]}'s partial sum {seq} is {p.count} values of dtype code {p.code}, this member's {x.size} of {DTYPE_CODES[x.dtype]}")
                raise GroupError(self.broken)
            try:
                parts.append(p.tensor(payload).reshape(x.shape))
            except FrameError as e:
                self.abort(f"{self.members[r]}'s partial sum {seq}: {e}")
                raise GroupError(self.broken) from None
        return parts

    def _send_all(self, frame: Frame) -> None:
        for node in self.members:
            if node == self.members[self._rank]:
                continue
            try:
                self._send(node, frame)
            except ConnectionError as e:
                self.abort(f"cannot send a partial sum to {node}: {e}")
                return
