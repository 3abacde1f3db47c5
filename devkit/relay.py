"""A TCP relay that knows no cluster secret, for putting between two real daemons.

It runs its own event loop in a thread. Each connection a node makes to it is
passed to the target node frame by frame (ring headers travel in the clear, so
a relay can find frame boundaries; from the third frame on, HELLO and PROOF
being the first two, each carries a MAC trailer), and each connection gets the
next of ``modes``, which decides what the relay does to it:

    "pass"      pass everything through: a relay is then just a proxy
    "hijack"    pass HELLO and PROOF, then drop the dialer and hold the target's
                connection, sending nothing (it cannot forge the INFO)
    "inject"    after the handshake, slip a frame of its own toward the target
    "replay"    after the handshake, send the target a frame it already had
    "flip"      after the handshake, flip one byte of a frame toward the dialer

After the last mode, every further connection gets "pass".
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from wire.frames import HEADER, HEADER_BYTES, MAGIC, PROTOCOL_VERSION, MsgType
from wire.seal import MAC_BYTES

# Sealed frames each way before the relay acts: INFO and a few heartbeats, so it
# acts on a link the daemons already admitted and use.
TAMPER_AFTER_FRAMES = 6


class Relay:
    def __init__(self, target_port: int, modes: list[str]):
        self.target_port = target_port
        self.modes = list(modes)
        self.used: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(10)

    async def _listen(self) -> int:
        self.server = await asyncio.start_server(self._on_dialer, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def close(self) -> None:
        async def stop():
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _on_dialer(self, dialer_r, dialer_w):
        try:
            target_r, target_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # the target is not up yet: this connection uses no mode
            dialer_w.close()
            return
        mode = self.modes.pop(0) if self.modes else "pass"
        self.used.append(mode)
        cut = asyncio.Event()
        up = asyncio.ensure_future(self._pump(dialer_r, target_w, "up", mode, cut, dialer_w))
        down = asyncio.ensure_future(self._pump(target_r, dialer_w, "down", mode, cut, dialer_w))
        await asyncio.gather(up, down, return_exceptions=True)
        if mode == "hijack":
            await asyncio.sleep(30)  # hold the target's side open, silent
        for w in (dialer_w, target_w):
            w.close()

    async def _pump(self, reader, writer, direction, mode, cut, dialer_w):
        seen: list[bytes] = []
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while not cut.is_set():
                head = await reader.readexactly(HEADER_BYTES)
                descriptor_len, payload_len = HEADER.unpack(head)[5:]
                trailer = MAC_BYTES if len(seen) >= 2 else 0
                frame = head + await reader.readexactly(descriptor_len + payload_len + trailer)
                seen.append(frame)
                if cut.is_set():
                    return
                if mode == "hijack" and len(seen) > 2:
                    cut.set()  # the dialer's INFO is not passed on; the dialer is dropped
                    dialer_w.close()
                    return
                if len(seen) == TAMPER_AFTER_FRAMES:
                    if mode == "inject" and direction == "up":
                        ping = HEADER.pack(MAGIC, PROTOCOL_VERSION, MsgType.PING, 0, 0, 0, 0)
                        frame = ping + bytes(MAC_BYTES) + frame
                    elif mode == "replay" and direction == "up":
                        frame = frame + seen[-2]
                    elif mode == "flip" and direction == "down":
                        middle = len(frame) // 2
                        frame = frame[:middle] + bytes([frame[middle] ^ 0x01]) + frame[middle + 1 :]
                writer.write(frame)
                await writer.drain()
        if not cut.is_set():
            writer.close()
