"""ringd.stage.tensorgroup: a tensor-parallel group's all-reduce, in-process.

Two (or three) real TensorGroups, each on a thread of its own as a compute thread is,
pass REDUCE frames through a real event loop, encoded and decoded as a link does;
mlx-lm's own ``Model.shard`` cuts real tiny models with them. Rings of processes
against mlx-lm's own tensor parallelism are tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import asyncio
import threading

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model

from ringd.ring.steps import Partial
from ringd.stage.tensorgroup import GroupError, TensorGroup
from wire.frames import Frame, FrameDecoder, encode_frame
from wire.tensors import DTYPE_CODES

TERM = 7


class Net:
    """Groups of ``size`` members on one event loop (its own thread); frames between them go
    through the wire encoder and decoder, as over a link."""

    def __init__(self, size: int, members: tuple[str, ...] | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.members = members or tuple(f"n{i}" for i in range(size))
        self.sent: list[tuple[str, str, Frame]] = []
        self.cut: set[str] = set()  # members whose frames go nowhere (a stalled peer)
        self.groups = {m: TensorGroup(TERM, self.members, i, self._sender(m), self.loop) for i, m in enumerate(self.members)}

    def _sender(self, me: str):
        def send(node: str, frame: Frame) -> None:
            self.sent.append((me, node, frame))
            if me in self.cut:
                return
            if node not in self.groups:
                raise ConnectionError(f"no link to node {node!r}")
            wire = b"".join(bytes(b) for b in encode_frame(frame))
            [back] = FrameDecoder().feed(wire)
            self.groups[node].arrive(me, back)

        return send

    def on_loop(self, fn, *args) -> None:
        done = threading.Event()
        self.loop.call_soon_threadsafe(lambda: (fn(*args), done.set()))
        assert done.wait(10), "the event loop did not run the call"

    def run_all(self, fn) -> dict:
        """``fn(group)`` on a thread per member at once (each a compute thread): results, or the exception raised."""
        out: dict = {}

        def run(m):
            try:
                out[m] = fn(self.groups[m])
                mx.eval(out[m])  # MLX's streams are the thread's: evaluated where they were made
            except Exception as e:
                out[m] = e

        threads = [threading.Thread(target=run, args=(m,)) for m in self.members]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def net():
    nets = []

    def make(size: int = 2, **kwargs) -> Net:
        nets.append(Net(size, **kwargs))
        return nets[-1]

    yield make
    for n in nets:
        n.close()


@pytest.mark.parametrize("size", [2, 3])
def test_every_member_gets_the_same_sum_in_rank_order(net, size):
    n = net(size)
    parts = {m: mx.random.normal((3, 5), key=mx.random.key(i)).astype(mx.bfloat16) for i, m in enumerate(n.members)}
    mx.eval(parts)  # made here, used on the members' threads
    out = n.run_all(lambda g: [g.all_sum(parts[g.members[g.rank()]]) for _ in range(4)])
    expected = parts["n0"]
    for m in n.members[1:]:
        expected = expected + parts[m]
    for m in n.members:
        assert all(mx.array_equal(o, expected).item() for o in out[m]), f"{m}'s sums differ from the rank-order sum"
        assert out[m][0].dtype == mx.bfloat16 and out[m][0].shape == (3, 5)
    gathered = n.run_all(lambda g: g.all_gather(parts[g.members[g.rank()]]))
    assert all(mx.array_equal(gathered[m], mx.concatenate([parts[x] for x in n.members])).item() for m in n.members)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_mlx_lm_shard_cuts_a_model_that_answers_as_the_whole(net, tiny_model, arch):
    """mlx-lm's own ``shard()`` with a TensorGroup: both members compute the same logits, those of
    the uncut model but for the all-reduce's summation order (float32)."""
    path = tiny_model(arch=arch, layers=4, dtype="float32")
    n = net(2)
    whole, _ = load_model(path)
    tokens = mx.array([[1, 5, 9, 33, 2, 7]])
    expected = whole(tokens)
    models = {}
    for m, g in n.groups.items():
        models[m], _ = load_model(path, lazy=True)
        models[m].shard(g)
        mx.eval(models[m].parameters())

    def forward(g):
        out = models[g.members[g.rank()]](tokens)
        mx.eval(out)
        return out

    out = n.run_all(forward)
    assert mx.array_equal(out["n0"], out["n1"]).item()
    assert mx.allclose(out["n0"], expected, atol=1e-4).item()
    assert len(n.sent) == 2 * 2 * 4, "two all-reduces a layer, each member's partial to the other"
    # The ordinary collectives still go to MLX: a singleton group here sums nothing.
    assert mx.distributed.all_sum(mx.array([2.0])).item() == 2.0


def test_a_partial_out_of_step_breaks_the_group(net):
    n = net(2)
    bad = Partial(TERM, 5, DTYPE_CODES[mx.float32], 4).frame(bytes(16))
    n.on_loop(n.groups["n0"].arrive, "n1", bad)
    assert "out of step" in n.groups["n0"].broken
    with pytest.raises(GroupError, match="out of step"):
        n.groups["n0"].all_sum(mx.ones(4))


def test_a_partial_of_another_shape_or_plan_or_sender(net):
    n = net(2)
    other_plan = Partial(TERM + 1, 0, DTYPE_CODES[mx.float32], 4).frame(bytes(16))
    n.on_loop(n.groups["n0"].arrive, "n1", other_plan)  # a plan this member has not loaded: ignored
    n.on_loop(n.groups["n0"].arrive, "stranger", Partial(TERM, 0, DTYPE_CODES[mx.float32], 4).frame(bytes(16)))
    assert n.groups["n0"].broken is None
    sizes = {"n0": mx.ones(4), "n1": mx.ones(5)}
    mx.eval(sizes)
    out = n.run_all(lambda g: g.all_sum(sizes[g.members[g.rank()]]))
    assert all(isinstance(e, GroupError) and "values" in str(e) for e in out.values()), out


def test_a_silent_member_breaks_the_group_at_the_deadline_and_names_it(net):
    n = net(3)
    n.cut.add("n2")
    for g in n.groups.values():
        g.deadline_s = 0.3
    out = n.run_all(lambda g: g.all_sum(mx.ones(2)))
    assert isinstance(out["n0"], GroupError) and "from n2 within" in str(out["n0"])


def test_abort_wakes_a_waiting_all_reduce_and_reset_starts_the_next_plan(net):
    n = net(2)
    g0, g1 = n.groups["n0"], n.groups["n1"]
    told = []
    g0.on_break = told.append
    waiting = threading.Thread(target=lambda: told.append(pytest.raises(GroupError, g0.all_sum, mx.ones(2))))
    waiting.start()
    n.on_loop(g0.abort, "the link to n1 dropped")
    waiting.join(10)
    assert not waiting.is_alive() and told[0] == "the link to n1 dropped"
    for g in (g0, g1):
        g.reset(TERM + 1)
    out = n.run_all(lambda g: g.all_sum(mx.full((2,), float(g.rank() + 1))))
    assert all(mx.array_equal(o, mx.full((2,), 3.0)).item() for o in out.values()), out


def test_alone_sends_nothing(net):
    n = net(2)
    g = n.groups["n0"]
    with g.alone():
        assert mx.array_equal(g.all_sum(mx.ones(3)), mx.ones(3)).item()
        assert g.all_gather(mx.ones(3)).shape == (6,)
    assert n.sent == []


def test_a_send_that_finds_no_link_breaks_the_group(net):
    n = net(2)
    del n.groups["n1"]
    g = n.groups["n0"]
    g.deadline_s = 10
    with pytest.raises(GroupError, match="cannot send a partial sum to n1"):
        g.all_sum(mx.ones(2))


def test_partials_of_another_plan_older_or_newer_are_ignored_and_held_nowhere(net):
    """A plan this group has left, or one it has not begun: the group stays whole and keeps
    nothing (the stage host holds a later plan's partials until its group runs that plan:
    tests/node/test_stagehost.py, a group forms whichever member takes its plan first)."""
    n = net(2)
    g0 = n.groups["n0"]
    g0.reset(TERM + 2)
    for term, seq in [(TERM + 1, 0), (TERM + 3, 0), (TERM + 9, 5)]:
        n.on_loop(g0.arrive, "n1", Partial(term, seq, DTYPE_CODES[mx.uint8], 1).frame(b"a"))
    assert g0.broken is None and not g0._inbox
    n.on_loop(g0.arrive, "n1", Partial(TERM + 2, 0, DTYPE_CODES[mx.uint8], 1).frame(b"b"))
    assert list(g0._inbox) == [(TERM + 2, 0, 1)]
    g0.reset(TERM + 3)
    assert not g0._inbox, "a new plan starts with nothing of the last"
