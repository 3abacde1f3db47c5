"""ringd.stagehost: what a node does with the plans it is given when its model's files cannot be read.

In-process: a real StageHost with a real compute thread loads a real tiny
model through ``Shard.load``; only the ring is absent (its frames are kept in
a list), since the point is what this one node does, plan after plan.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

from ringd.checkpoint import model_info
from ringd.compute import ComputeThread
from ringd.metrics import Metrics
from ringd.placement import Plan, Stage
from ringd.reconcile import FAILED, LOADED
from ringd.stagehost import StageHost

NODE = "node0"


def test_a_model_file_cut_short_after_start_fails_the_load_once_and_is_not_read_again(tiny_model, tmp_path, caplog, monkeypatch):
    """The issue: a truncated file made every plan (one each 30 s) re-read it and log a traceback."""
    from ringd import shard

    model = tmp_path / "model"
    shutil.copytree(tiny_model(arch="llama", layers=2), model)
    info = model_info(str(model))  # at start the files were whole
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # then a copy over it stopped short

    loads = []
    real_load = shard.Shard.load.__func__
    monkeypatch.setattr(shard.Shard, "load", classmethod(lambda cls, *a: loads.append(a) or real_load(cls, *a)))
    sent = []

    async def main():
        compute = ComputeThread()
        host = StageHost(NODE, str(model), info, compute, lambda node, frame: sent.append(frame), lambda: None, Metrics(NODE))
        try:
            for term in (1, 2, 3):  # the leader's fresh plans, as it retries after a failure
                plan = Plan(term, NODE, info.fingerprint, info.num_layers, (Stage(NODE, "127.0.0.1:1", 0, info.num_layers),))
                await host.load(host.take(NODE, plan.to_wire(), NODE))
                assert host.report.state == FAILED and str(weights) in host.report.error and "truncated" in host.report.error, host.report
                assert len(sent) == term  # each plan is answered, FAILED
        finally:
            await compute.stop()

    with caplog.at_level(logging.DEBUG, logger="ringd.stagehost"):
        asyncio.run(main())
    assert len(loads) == 1, "the broken file was read again for a later plan"
    errors = [r for r in caplog.records if r.name == "ringd.stagehost" and r.levelno >= logging.WARNING]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert str(weights) in line and "truncated" in line and "restarted" in line, line


def test_a_whole_model_loads(tiny_model):
    """The same host and plan with the file whole: LOADED (so the test above fails for its reason)."""
    model = tiny_model(arch="llama", layers=2)
    info = model_info(str(model))

    async def main():
        compute = ComputeThread()
        host = StageHost(NODE, str(model), info, compute, lambda node, frame: None, lambda: None, Metrics(NODE))
        try:
            plan = Plan(1, NODE, info.fingerprint, info.num_layers, (Stage(NODE, "127.0.0.1:1", 0, info.num_layers),))
            await host.load(host.take(NODE, plan.to_wire(), NODE))
            assert host.report.state == LOADED, host.report
        finally:
            await compute.stop()

    asyncio.run(main())
