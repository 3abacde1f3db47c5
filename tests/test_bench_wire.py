"""tools/bench-wire: its loopback part sends a FORWARD and gets the last stage's TOKEN back in
every mode (it timed out once a TOKEN's descriptor had to be bytes, and nothing ran it)."""

import asyncio

import uvloop
from devkit.toolscript import load

bench_wire = load("bench-wire")


def test_a_decode_frame_goes_out_and_its_token_comes_back_in_every_mode():
    frame = bench_wire.tensor_frame(1, 64)

    async def each_mode():
        return {mode: await asyncio.wait_for(bench_wire.round_trips(frame, mode, 3), 30) for mode in bench_wire.MODES}

    times = uvloop.run(each_mode())
    assert {mode: len(t) for mode, t in times.items()} == {mode: 3 for mode in bench_wire.MODES}
