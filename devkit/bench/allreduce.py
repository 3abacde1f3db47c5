"""One all-reduce's cost in ringd, alone: two processes, each a member of a real ``TensorGroup``
on a compute thread, joined by one TCP connection whose frames are sealed as a link's are
(keyed BLAKE3, wire.seal) and carried by a uvloop event loop as a link's are; the compute threads
call ``all_sum`` of a token's hidden state back to back, with no layer computed between, so
the figure is the collective's own (each call's input is the last call's sum, halved: one evaluation a
call, as in a model, where the sum is evaluated with the next projection): wall time per call, and CPU time per call of both
processes (every thread). No handshake: both ends get their keys directly, as in bench-wire.

On loopback (``pair``) or between two network-namespace hosts joined by emulated links of a
profile (``pair(net=...)``, devkit/netns.py). Run as a module, it is one member:
``python -m devkit.bench.allreduce RANK HOST PORT HIDDEN CALLS CORE TRANSCRIPT_HEX``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

from devkit import REPO

WARM_CALLS = 50
MEMBERS = ("a", "b")


def _member(rank: int, host: str, port: int, hidden: int, calls: int, core: int | None, transcript: bytes) -> dict:
    if core is not None:
        os.sched_setaffinity(0, {core})
    import mlx.core as mx
    import uvloop

    from ringd.stage.tensorgroup import TensorGroup
    from wire.frames import DEFAULT_LIMITS, FrameDecoder, encode_frame
    from wire.seal import derive_session

    session = derive_session(b"bench-allreduce", transcript, initiator=rank == 0, encrypt=False)
    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    ready = loop.create_future()
    holder: dict = {}

    class Member(asyncio.BufferedProtocol):
        def __init__(self):
            self.decoder = FrameDecoder(DEFAULT_LIMITS, session.opener)

        def connection_made(self, transport):
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            holder["transport"] = transport
            if not ready.done():
                ready.set_result(None)

        def get_buffer(self, sizehint):
            return self.decoder.get_buffer(sizehint)

        def buffer_updated(self, nbytes):
            for frame in self.decoder.buffer_updated(nbytes):
                holder["group"].arrive(MEMBERS[1 - rank], frame)

    def send(node: str, frame) -> None:
        holder["transport"].writelines(encode_frame(frame, DEFAULT_LIMITS, session.sealer))

    group = holder["group"] = TensorGroup(1, MEMBERS, rank, send, loop)
    result: dict = {}

    def compute():
        # Each call's input is computed from the last one's sum, as a layer's next projection
        # is: the sum is evaluated with the next partial, one evaluation a call, as in a model.
        x = mx.ones((1, 1, hidden), dtype=mx.float32)
        mx.eval(x)
        for _ in range(WARM_CALLS):
            x = group.all_sum(x * 0.5)
        start, cpu = time.perf_counter(), os.times()
        for _ in range(calls):
            x = group.all_sum(x * 0.5)
        mx.eval(x)
        end = os.times()
        result.update(wall=(time.perf_counter() - start) / calls, cpu=(end.user + end.system - cpu.user - cpu.system) / calls)
        loop.call_soon_threadsafe(loop.stop)

    async def connect():
        if rank == 0:
            server = await loop.create_server(Member, host, port)
            print("listening", flush=True)
            await ready
            server.close()
        else:
            for _ in range(100):
                try:
                    await loop.create_connection(Member, host, port)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            await ready
        threading.Thread(target=compute, daemon=True).start()

    loop.create_task(connect())
    loop.run_forever()
    return result


def pair(hidden: int, calls: int, net=None, cores: tuple[int, int] | None = (0, 1), port: int = 9100) -> dict:
    """Both members' figures: wall seconds per all-reduce (rank 0's) and CPU seconds per all-reduce
    of both processes together. On loopback, or on hosts 0 and 1 of ``net`` (then unpinned)."""
    transcript = os.urandom(64).hex()
    host = "127.0.0.1" if net is None else net.hosts[0].ip
    procs = []
    for rank in (0, 1):
        core = "-" if cores is None or net is not None else str(cores[rank])
        argv = [sys.executable, "-m", "devkit.bench.allreduce", str(rank), host, str(port), str(hidden), str(calls), core, transcript]
        kwargs = dict(cwd=REPO, stdout=subprocess.PIPE, text=True)
        procs.append(subprocess.Popen(argv, **kwargs) if net is None else net.popen(rank, argv, **kwargs))
        if rank == 0:
            assert procs[0].stdout.readline().strip() == "listening", "the first member did not listen"
    out = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return {"wall": out[0]["wall"], "cpu": out[0]["cpu"] + out[1]["cpu"]}


if __name__ == "__main__":
    rank, host, port, hidden, calls, core, transcript = sys.argv[1:8]
    figures = _member(int(rank), host, int(port), int(hidden), int(calls), None if core == "-" else int(core), bytes.fromhex(transcript))
    print(json.dumps(figures), flush=True)
