"""A stage dies while a request is in each state it can be in; every request's tokens come out as
if nothing had happened.

``Engine`` over real StageRunners in this process (tests/kit/stagering.py), so the moment of the
death is chosen exactly: when the frame that shows the request in the state named goes to
node1, node1 is gone (that frame and every later frame of the old ring are lost, as a process
killed with SIGKILL loses them), the leader suspends its requests (what the coordinator does
when a link drops), and a ring of the survivors, node0 and node2, serves the next plan term.
The states: waiting for KV room (queued), between two prompt chunks (prefilling), its first
row on its way (just admitted), feeding back tokens (decoding), checking a draft's proposals
(verifying). The multi-process version, with kill -9 and real sockets, is tests/test_failover.py.
"""

from __future__ import annotations

import asyncio

import pytest
from devkit.stagering import StageRing

from ringd.leader.admission import KvLedger, StageKv
from ringd.leader.draft import Drafter
from ringd.leader.engine import Engine, EngineSettings
from ringd.models.checkpoint import load_tokenizer
from ringd.models.source import model_info
from ringd.ring.kvcost import KV_STEP_TOKENS, KvCost
from ringd.ring.sampling import SamplingParams
from ringd.ring.steps import Forward
from wire.frames import MsgType

MAX_TOKENS = 14
# KV room for two requests of up to KV_STEP_TOKENS positions at once: a third waits in line.
ROOM = KvCost(per_token=1)
CAPACITY = 2 * KV_STEP_TOKENS
TIMEOUT_S = 300.0  # the whole scenario, on a loaded two-core machine


def ledger(ring: StageRing) -> KvLedger:
    return KvLedger([StageKv(s.node, ROOM, CAPACITY) for s in ring.stages])


def died_when(state: str, engine: Engine, target: list[int], batch: Forward) -> bool:
    """Whether ``batch``, on its way to node1, shows the request of prompt ``target`` in ``state``."""
    if state == "queued":  # the target waits for room while two others run
        return engine.queued > 0 and any(engine._flights[r.rid].generated for r in batch.rows if r.rid in engine._flights)
    for row in batch.rows:
        flight = engine._flights.get(row.rid)
        if flight is None or flight.prompt != target:
            continue
        if state == "prefilling":
            return not row.sample and row.offset > 0
        if state == "just admitted":
            return row.open is not None
        if state == "decoding":
            return row.sample and not row.verify and row.offset >= len(target) + 3
        if state == "verifying":
            return row.verify and row.offset >= len(target) + 2
    return False


@pytest.mark.parametrize("state", ["queued", "prefilling", "just admitted", "decoding", "verifying"])
def test_a_stage_that_dies_while_a_request_is_in_any_state_loses_nothing(tiny_model, state):
    path = tiny_model(arch="llama", layers=4, dtype="float32")
    tokenizer = load_tokenizer(model_info(str(path)))
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompts = [
        encode("The first request decodes for a while."),
        encode("The second one has a long prompt: " + "rings and stages and links " * 5),
        encode("The third waits for room."),
    ]
    target = prompts[{"queued": 2, "prefilling": 1}.get(state, 0)]

    async def main():
        first = StageRing(path, [1, 3], tokenizer)
        drafter = await Drafter.load(str(path), first.compute, model_info(str(path))) if state == "verifying" else None

        def engine() -> Engine:
            return Engine("node0", tokenizer, None, EngineSettings(prefill_chunk_tokens=8, prefix_cache_entries=0), drafter=drafter)

        async def serve(e: Engine) -> list[list[int]]:
            async def one(i: int) -> list[int]:
                if i:  # in this order: the first decodes when the second arrives, the third finds no room
                    await asyncio.sleep(0)
                return [ev.token async for ev in e.generate(prompts[i], SamplingParams(temperature=0), MAX_TOKENS)]

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(3))), TIMEOUT_S)

        whole = await serve(first.lead(engine(), ledger=ledger(first)))

        rings = [StageRing(path, [1, 3], tokenizer, compute=first.compute)]
        dead = asyncio.Event()
        e = engine()

        def lose(node: str, frame) -> bool:
            if dead.is_set():
                return True  # node1 is gone, and with it every frame of the old ring
            if node == "node1" and frame.type == MsgType.FORWARD and died_when(state, e, target, Forward.parse(frame, rings[0].vocab_size)):
                dead.set()
                asyncio.get_running_loop().call_soon(die)
                return True
            return False

        def die() -> None:
            e.suspend_all("node1 left the ring")
            survivors = StageRing(path, [2], tokenizer, term=2, nodes=["node0", "node2"], compute=first.compute)
            rings.append(survivors)
            survivors.lead(e, ledger=ledger(survivors))

        rings[0].lead(e, lose, ledger(rings[0]))
        again = await serve(e)
        replays = e.metrics.replays._value.get()
        await first.stop()
        return whole, again, dead.is_set(), replays

    whole, again, died, replays = asyncio.run(main())
    assert died, f"the target never reached the state {state!r}"
    assert all(len(tokens) >= 4 for tokens in whole), whole
    for i, (before, after) in enumerate(zip(whole, again)):
        assert after == before, f"request {i} after the stage died ({state}) differs from its uninterrupted run"
    assert replays >= 1
