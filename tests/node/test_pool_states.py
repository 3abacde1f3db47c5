"""The pool's loads as a state machine: loads, unloads, requests, rings lost and leader changes
in any order (Hypothesis), against stand-in coordinators.

``Pool`` (node/pool.py) is the leader's asyncio shell around its instances; what makes a load
end, a name answer again and an idle model go is its own. The coordinators (a ring each,
node/coordinator.py) are stood in for here: each becomes ready, fails or loses its ring when the
test says, so every interleaving of those with the pool's own events can be tried. What must
hold in every one: no request waits forever (once every load under way has ended, every request
has its instance or an error that says why), no stand-in that is neither closed nor unloaded
lives outside the pool (nothing loaded without an instance), a model has one instance, and a
model asked for again after anything answers again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ringd.cluster.memberinfo import MemberInfo
from ringd.leader.errors import EngineError
from ringd.node import pool as pool_module
from ringd.node.coordinator import ServedModel
from ringd.node.pool import Pool

MODELS = ("tiny-b", "tiny-c")
NAMES = (*MODELS, "absent")  # a name the model list does not hold: a 404, never a load


class StandIn:
    """A coordinator whose ring serves, fails or breaks when the test says (``Coordinator``'s
    surface as the pool uses it)."""

    made: list["StandIn"] = []

    def __init__(self, parts, served: ServedModel, share, planned_before: bool = False):
        self.label, self.info, self.tokenizer = served.instance, served.info, served.tokenizer
        self.ready, self.reason, self.failure, self.plan = False, "loading", "", None
        self.engine = SimpleNamespace(active=0, queued=0)
        self.ended: str | None = None  # closed or unloaded, and why
        self._ticked = asyncio.Event()
        StandIn.made.append(self)

    @property
    def pending(self) -> bool:
        return self.ended is None and not self.ready and not self.failure

    def serve(self) -> None:
        self.ready, self.reason, self.failure = True, "", ""
        self._ticked.set()

    def fail(self, why: str) -> None:
        """Its plan could not be placed or loaded: as a coordinator, it says so and plans again later."""
        self.failure = self.reason = why
        self._ticked.set()

    def lose_ring(self) -> None:
        self.ready, self.reason = False, "a node left; re-planning"

    async def wait_ready(self, timeout_s: float) -> None:
        while not self.ready:
            if self.failure or self.ended is not None:
                raise EngineError(self.failure or self.reason, 503)
            self._ticked.clear()
            await self._ticked.wait()

    def close(self, reason: str) -> None:
        self.ended, self.ready, self.reason = reason, False, reason
        self._ticked.set()

    unload = close

    def changed(self) -> None: ...
    def refresh_kv(self) -> None: ...
    def on_frame(self, peer, frame) -> None: ...


class Inline(ThreadPoolExecutor):
    """The loop's executor, run in place: a model's info and tokenizer (stood in for) are ready at
    once, so a step of the test is a few turns of the loop."""

    def submit(self, fn, /, *args, **kwargs):
        done = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except Exception as e:
            done.set_exception(e)
        return done


class Supervisor:
    def __init__(self):
        self.tasks: list[asyncio.Task] = []

    def forever(self, name, loop, **_):
        return self._spawn(loop())

    def once(self, name, coro):
        return self._spawn(coro)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.append(task)
        return task


class Catalogue:
    def __init__(self, infos: dict):
        self.infos = infos

    async def lookup(self, name: str):
        info = self.infos.get(name)
        if info is None:
            return None
        return SimpleNamespace(name=name, ref=name, facts=SimpleNamespace(info=info, error=""))


@pytest.fixture(scope="module")
def infos(tiny_model):
    from ringd.models.source import model_info

    base = model_info(str(tiny_model(arch="llama", layers=2)))
    return {name: dataclasses.replace(base, fingerprint=f"fp-{name}") for name in ("base", *MODELS)}


def test_every_request_ends_and_nothing_is_loaded_without_an_instance_whatever_the_order(infos, monkeypatch):
    monkeypatch.setattr(pool_module, "Coordinator", StandIn)
    monkeypatch.setattr(pool_module, "model_info", lambda ref: infos[ref])
    monkeypatch.setattr(pool_module, "load_tokenizer", lambda info: object())
    members = {"node0": MemberInfo(budget=2**40), "node1": MemberInfo(budget=2**40)}
    cfg = SimpleNamespace(replicas=1, keep_alive=300.0, kv_reserve_tokens=256, kv_bits=None, kv_group_size=64)

    class Pools(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            StandIn.made = []
            self.loop = asyncio.new_event_loop()
            self.loop.set_default_executor(Inline())
            self.supervisor = Supervisor()
            self.cluster = SimpleNamespace(member_infos=lambda: members, info_of=lambda node: members[node])
            self.parts = SimpleNamespace(cfg=cfg, cluster=self.cluster, supervisor=self.supervisor)
            self.pool = self._new_pool(())
            self.asks: list[tuple[str, asyncio.Task]] = []  # every request, and its routing
            self.running: list = []  # requests routed to an instance and not ended
            self.now = 0.0

        def _new_pool(self, restore) -> Pool:
            async def make():
                configured = ServedModel("", "", infos["base"], object())
                pool = Pool(self.parts, configured, "base", Catalogue(infos), planned_before=True, restore=restore)
                pool.default.coordinator.serve()
                return pool

            return self.loop.run_until_complete(make())

        def settle(self) -> None:
            for _ in range(20):  # the pool's tasks and the requests' routing run to where they wait
                self.loop.run_until_complete(asyncio.sleep(0))
            for name, task in self.asks:
                if task.done() and not task.cancelled() and task.exception() is None and (name, task) not in self.running:
                    self.running.append((name, task))

        @rule(name=st.sampled_from(NAMES))
        def ask(self, name):
            pool = self.pool
            self.asks.append((name, self.loop.create_task(pool.served(name))))
            self.settle()

        @precondition(lambda self: any(c.pending for c in StandIn.made))
        @rule(k=st.integers(0, 7), ok=st.booleans())
        def a_load_ends(self, k, ok):
            pending = [c for c in StandIn.made if c.pending]
            c = pending[k % len(pending)]
            c.serve() if ok else c.fail(f"cannot place {c.label}: short of memory")
            self.settle()

        @precondition(lambda self: any((c.ready or c.failure) and c.label and c.ended is None for c in StandIn.made))
        @rule(k=st.integers(0, 7))
        def a_ring_is_lost_or_planned_again(self, k):
            """A Mac of its ring leaves (it plans again), or the Macs it lacked are back."""
            rings = [c for c in StandIn.made if (c.ready or c.failure) and c.label and c.ended is None]
            c = rings[k % len(rings)]
            c.lose_ring() if c.ready else c.serve()
            self.settle()

        @precondition(lambda self: self.running)
        @rule(k=st.integers(0, 7))
        def a_request_ends(self, k):
            name, task = self.running.pop(k % len(self.running))
            task.result().release()
            self.asks.remove((name, task))
            self.settle()

        @rule(name=st.sampled_from(MODELS))
        def unload(self, name):
            self.pool.unload_model(name, "keep_alive 0")
            self.settle()

        @rule(seconds=st.sampled_from([1.0, 400.0]))
        def time_passes(self, seconds):
            self.now += seconds
            self.pool.expire(self.now + 10**6 if seconds > 1 else 0.0)  # past every keep_alive, or not
            self.settle()

        @rule()
        def the_leader_changes(self):
            kept = self.pool.manifest()
            self.pool.close("leadership moved")
            self.settle()
            self.running = []  # their instances went with the pool
            self.asks = [(n, t) for n, t in self.asks if not t.done()]
            self.pool = self._new_pool(kept)
            self.settle()

        @invariant()
        def nothing_loaded_without_an_instance_and_one_instance_a_model(self):
            # A stand-in of an older pool was closed with it; one of this pool is held by an instance.
            held = {id(i.coordinator) for i in self.pool.instances.values()}
            orphans = [c.label for c in StandIn.made if c.ended is None and id(c) not in held]
            assert not orphans, orphans
            models = [i.model_id for i in self.pool.instances.values()]
            assert len(models) == len(set(models)), models

        def teardown(self):
            try:
                # Every load under way ends: then every request has its instance or its error.
                for _ in range(4):
                    for c in StandIn.made:
                        if c.pending:
                            c.serve()
                    self.settle()
                stuck = [name for name, task in self.asks if not task.done()]
                assert not stuck, f"requests for {stuck} never ended"
                for name, task in self.asks:
                    if task.exception() is not None:
                        assert isinstance(task.exception(), EngineError) and str(task.exception()), task.exception()
                        # An unload is Ollama's keep_alive 0: the requests it found end whole first.
                        assert "unloaded" not in str(task.exception()), task.exception()
                # And a name asked for again answers again.
                for _, task in self.running:
                    task.result().release()
                for name in NAMES:
                    again = self.loop.create_task(self.pool.served(name))
                    for _ in range(4):
                        self.settle()
                        for c in StandIn.made:
                            if c.pending:
                                c.serve()
                    self.settle()
                    assert again.done(), f"{name} asked for again never answered"
                    if name not in MODELS:
                        assert isinstance(again.exception(), EngineError) and again.exception().status == 404
                    elif again.exception() is not None:  # its ring failed: said, and planned again later
                        assert isinstance(again.exception(), EngineError) and str(again.exception()), again.exception()
                    else:  # an instance of the pool, serving or saying why not (a request there gets that 503)
                        inst = again.result()
                        assert self.pool.instances.get(inst.name) is inst and (inst.coordinator.ready or inst.coordinator.reason), inst
            finally:
                self.pool.close("the test ended")
                for task in self.supervisor.tasks:
                    task.cancel()
                self.loop.run_until_complete(asyncio.sleep(0))
                self.loop.close()

    Pools.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
    Pools.TestCase("runTest").runTest()
