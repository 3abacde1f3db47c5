"""ringd.node.stagehost: what a node does with the plans it is given: when its model's files
cannot be read, when a neighbour leaves, when a group forms, and which link its compute thread reads.

In-process: a real StageHost with a real compute thread loads a real tiny
model through ``Shard.load``; only the ring is absent (its frames are kept in
a list), since the point is what this one node does, plan after plan.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from ringd.models.source import model_info
from ringd.stage.compute import ComputeThread
from ringd.base.metrics import Metrics
from ringd.ring.plan import Plan, Stage
from ringd.cluster.reconcile import FAILED, LOADED
from ringd.node.stagehost import StageHost, StageSource

NODE = "node0"


class Node:
    """The node a stage host runs on (stagehost.StageOwner), with no ring: frames are kept or
    handed to ``send``, and the model is the one given."""

    def __init__(self, source: StageSource, send=None, departed=frozenset(), tokenizer=None):
        self.source, self.sent, self._send, self._departed, self._tokenizer = source, [], send, departed, tokenizer

    def send(self, node, frame):
        self.sent.append(frame)
        if self._send is not None:
            self._send(node, frame)

    def send_now(self, node, frame):
        return False  # every frame takes the event loop's way: ``send`` above, on the loop

    def lend(self, node, take, returned):
        return None  # no links to lend: frames come through ``on_frame``, on the loop

    def grouped(self):
        return False

    def reported(self): ...

    def departed(self, node):
        return node in self._departed

    def dial(self, host, port): ...

    def holders(self, fingerprint):
        return []

    async def resolve(self, plan):
        return self.source

    def tokenizer_of(self, info):
        return self._tokenizer


def stage_host(compute, model, info, **kw) -> StageHost:
    return StageHost(NODE, "", Node(StageSource(str(model), info), **kw), compute, Metrics(NODE))


def test_a_model_file_cut_short_after_start_fails_the_load_once_and_is_not_read_again(tiny_model, tmp_path, caplog, monkeypatch):
    """The issue: a truncated file made every plan (one each 30 s) re-read it and log a traceback."""
    from ringd.stage import shard

    model = tmp_path / "model"
    shutil.copytree(tiny_model(arch="llama", layers=2), model)
    info = model_info(str(model))  # at start the files were whole
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # then a copy over it stopped short

    loads = []
    real_load = shard.Shard.load.__func__
    monkeypatch.setattr(shard.Shard, "load", classmethod(lambda cls, *a: loads.append(a) or real_load(cls, *a)))

    async def main():
        compute = ComputeThread()
        host = stage_host(compute, model, info)
        sent = host._owner.sent
        try:
            for term in (1, 2, 3):  # the leader's fresh plans, as it retries after a failure
                plan = Plan(term, NODE, info.fingerprint, info.num_layers, (Stage(NODE, "127.0.0.1:1", 0, info.num_layers),))
                await host.load(host.take(NODE, plan.to_wire(), NODE))
                assert host.report.state == FAILED and str(weights) in host.report.error and "truncated" in host.report.error, host.report
                assert len(sent) == term  # each plan is answered, FAILED
        finally:
            await compute.stop()

    with caplog.at_level(logging.DEBUG, logger="ringd.node.stagehost"):
        asyncio.run(main())
    assert len(loads) == 1, "the broken file was read again for a later plan"
    errors = [r for r in caplog.records if r.name == "ringd.node.stagehost" and r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert str(weights) in line and "truncated" in line and "restarted" in line, line


def test_a_whole_model_loads(tiny_model):
    """The same host and plan with the file whole: LOADED (so the test above fails for its reason)."""
    model = tiny_model(arch="llama", layers=2)
    info = model_info(str(model))

    async def main():
        compute = ComputeThread()
        host = stage_host(compute, model, info)
        try:
            plan = Plan(1, NODE, info.fingerprint, info.num_layers, (Stage(NODE, "127.0.0.1:1", 0, info.num_layers),))
            await host.load(host.take(NODE, plan.to_wire(), NODE))
            assert host.report.state == LOADED, host.report
        finally:
            await compute.stop()

    asyncio.run(main())


def test_a_neighbour_that_said_leave_breaks_no_ring(tiny_model, caplog):
    """A whole ring stopped at once: the signals land a little apart, so a stage may find the
    next one gone before it stops itself. A neighbour that said LEAVE is the leader's to plan
    around; one that vanished without a word breaks the ring (``reconcile.BROKEN``)."""
    from ringd.cluster.links import LinkError
    from ringd.cluster.reconcile import BROKEN
    from wire.frames import Frame, MsgType

    model = tiny_model(arch="llama", layers=2)
    info = model_info(str(model))
    departed: set[str] = set()

    def send(node, frame):
        if node == "node1":
            raise LinkError("no link to node 'node1'")

    async def main():
        compute = ComputeThread()
        host = stage_host(compute, model, info, send=send, departed=departed)
        try:
            stages = (Stage(NODE, "127.0.0.1:1", 0, 1), Stage("node1", "127.0.0.1:2", 1, info.num_layers))
            plan = Plan(1, NODE, info.fingerprint, info.num_layers, stages)
            host.check_links({"node1": 1})  # linked with the next stage before the plan
            await host.load(host.take(NODE, plan.to_wire(), NODE))
            host.check_links({"node1": 1})
            assert host.report.state == LOADED, host.report
            departed.add("node1")
            host._pass_on("node1", Frame(MsgType.FORWARD, 7, {}))  # as the stage passes its output on
            host.check_links({})
            assert host.report.state == LOADED, host.report
            departed.clear()
            host._pass_on("node1", Frame(MsgType.FORWARD, 8, {}))
            assert host.report.state == BROKEN and "node1" in host.report.error, host.report
        finally:
            await compute.stop()

    with caplog.at_level(logging.DEBUG, logger="ringd.node.stagehost"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.name == "ringd.node.stagehost" and r.levelno >= logging.WARNING]
    assert all("req=7" not in w for w in warnings) and any("broken here" in w for w in warnings), warnings


def test_a_group_forms_whichever_member_takes_its_plan_first(tiny_model, monkeypatch):
    """Two members of one tensor-parallel group, in one process: the leader's plan reaches node0
    well before node1, so node0's offer (its first partial of the plan) arrives where node1 has
    no group yet. node1 holds it until its group forms, and both load, on the ringd engine (no
    RDMA here): without the hold, node1 waited for an offer it had dropped."""
    from ringd.node import stagehost
    from ringd.stage.groupengine import RINGD
    from wire.frames import MsgType

    monkeypatch.setattr(stagehost, "OFFERS_TIMEOUT_S", 10.0)
    model = tiny_model(arch="llama", layers=2)
    info = model_info(str(model))
    plan = Plan(3, NODE, info.fingerprint, info.num_layers, (Stage(NODE, "127.0.0.1:1", 0, 2, (("node1", "127.0.0.1:2"),)),))

    async def main():
        hosts: dict[str, StageHost] = {}
        offered: set[str] = set()

        def sender(me):
            def send(node, frame):
                if frame.type == MsgType.REDUCE:
                    offered.add(me)
                    hosts[node].on_reduce(me, frame)

            return send

        computes = [ComputeThread(), ComputeThread()]
        for name, compute in zip((NODE, "node1"), computes):
            hosts[name] = StageHost(name, "", Node(StageSource(str(model), info), send=sender(name)), compute, Metrics(name))
        hosts[NODE].check_links({"node1": 1})
        hosts["node1"].check_links({NODE: 1})
        try:
            first = asyncio.create_task(hosts[NODE].load(hosts[NODE].take(NODE, plan.to_wire(), NODE)))
            while NODE not in offered:  # node0's offer has come, before node1 took the plan
                await asyncio.sleep(0.01)
            await hosts["node1"].load(hosts["node1"].take(NODE, plan.to_wire(), NODE))
            await first
            for host in hosts.values():
                assert host.report.state == LOADED and host.engine.engine == RINGD, host.report
                assert host.shard.start == 0 and host.status()["engine"] == RINGD
        finally:
            for compute in computes:
                await compute.stop()

    asyncio.run(main())


class Lending(Node):
    """A node whose links can be lent: each lend is kept, with the reading it gave."""

    def __init__(self, source):
        super().__init__(source)
        self.lent: list[tuple[str, object, object, "Reading"]] = []
        self.group_here = False  # another instance's stage on this node is a tensor-parallel group's

    def grouped(self):
        return self.group_here

    def lend(self, node, take, returned):
        reading = Reading()
        self.lent.append((node, take, returned, reading))
        return reading


class Reading:
    def __init__(self):
        self.asked_back = False

    def ask_back(self):
        self.asked_back = True


def test_the_link_from_the_stage_before_is_read_on_the_compute_thread_for_this_plan_s_frames_only(tiny_model):
    """A loaded stage has its predecessor's link lent to the compute thread, which computes there
    the FORWARD and RELEASE frames of the stage's plan and leaves everything else (a heartbeat, a
    frame of another plan) to the event loop. A new plan asks the link back; loaded, the stage
    borrows the link from its new predecessor. No link is lent while a stage on the node is a
    tensor-parallel group's."""
    from ringd.ring.steps import Forward, release
    from wire.frames import Frame, MsgType

    model = tiny_model(arch="llama", layers=2)
    info = model_info(str(model))

    async def main():
        compute = ComputeThread()
        owner = Lending(StageSource(str(model), info))
        host = StageHost(NODE, "", owner, compute, Metrics(NODE))
        try:
            for term, before in ((1, "node8"), (2, "node9")):
                stages = (Stage(before, "127.0.0.1:1", 0, 1), Stage(NODE, "127.0.0.1:2", 1, info.num_layers))
                plan = Plan(term, "node8", info.fingerprint, info.num_layers, stages)
                taken = host.take("node8", plan.to_wire(), "node8")
                host.check_links({"node8": 1, "node9": 2})
                if term == 2:
                    assert owner.lent[-1][3].asked_back  # the last plan's link, asked back for the new one
                    owner.lent[-1][2]()  # given back (the loop calls it)
                    assert len(owner.lent) == 1  # nothing lent while the plan loads
                await host.load(taken)
                host.check_links({"node8": 1, "node9": 2})
                assert host.report.state == LOADED, host.report
                node, take, _, _ = owner.lent[-1]
                assert node == before and len(owner.lent) == term
                ran = await compute.run(lambda: [
                    take(release(5, term)),
                    take(release(5, term + 7)),
                    take(Forward(3, term + 7, ()).frame()),
                    take(Frame(MsgType.PING, 0, {})),
                ])  # fmt: skip
                assert ran == [True, False, False, False]
            owner.group_here = True  # another stage here forms a group: its collectives wait on the compute thread
            host.check_links({"node8": 1, "node9": 2})
            assert owner.lent[-1][3].asked_back
            owner.lent[-1][2]()
            host.check_links({"node8": 1, "node9": 2})
            assert len(owner.lent) == 2  # not lent again while it lasts
            owner.group_here = False
            host.check_links({"node8": 1, "node9": 2})
            assert len(owner.lent) == 3
        finally:
            await compute.stop()
        host.stop()
        assert owner.lent[-1][3].asked_back

    asyncio.run(main())
