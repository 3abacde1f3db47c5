"""A HELLO flood on ring ports, for attacking real daemons: connections that start the handshake and stall.

It runs its own event loop in a thread. For every target port and every
source address it keeps ``per_host`` connections going: each connects from
that address, sends a HELLO for the cluster (the name is in the Bonjour advert,
so any attacker knows it), takes the listener's HELLO and PROOF and then says
nothing, holding its handshake slot until the listener gives up on it
(HANDSHAKE_TIMEOUT_S) or closes it to make room; then it connects again at
once. A connection closed without a HELLO (refused: the slots are full) is tried
again after ``REFUSED_RETRY_S``.

Source addresses are loopback ones (127.0.0.0/8 all reach 127.0.0.1), so a test
can flood as many strangers as it likes, or from a member's own address.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading

from wire.frames import DEFAULT_LIMITS, encode_frame
from wire.handshake import Handshake

# How soon a refused connection tries again: often enough that a slot a stranger
# frees is taken back at once, rarely enough not to spin two shared cores.
REFUSED_RETRY_S = 0.2


class Flood:
    def __init__(self, ports: list[int], cluster: str, sources: dict[str, int]):
        """Flood every port in ``ports`` from each address in ``sources`` with that many connections."""
        self.ports, self.cluster, self.sources = ports, cluster, sources
        self.holding: collections.Counter[tuple[int, str]] = collections.Counter()  # (port, host): connections in the handshake now
        self.refused: collections.Counter[int] = collections.Counter()  # by port, since the start
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._tasks = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def held(self, port: int, hosts) -> int:
        """Connections from ``hosts`` in the handshake with ``port`` right now."""
        return sum(self.holding[(port, host)] for host in hosts)

    def close(self) -> None:
        async def stop():
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> list[asyncio.Task]:
        return [
            asyncio.create_task(self._hold(port, host, n))
            for port in self.ports
            for host, count in self.sources.items()
            for n in range(count)
        ]

    async def _hold(self, port: int, host: str, n: int) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(host, 0))
            except OSError:
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            hello = Handshake(secret=b"not the secret", node_id=f"flood-{host}-{n}", cluster=self.cluster, initiator=True)
            for frame in hello.start():
                writer.writelines(encode_frame(frame, DEFAULT_LIMITS))
            holding = False
            try:
                with contextlib.suppress(ConnectionError):
                    while await reader.read(4096):
                        if not holding:
                            holding = True
                            self.holding[(port, host)] += 1
            finally:
                if holding:
                    self.holding[(port, host)] -= 1
                writer.close()
            if not holding:
                self.refused[port] += 1
                await asyncio.sleep(REFUSED_RETRY_S)
