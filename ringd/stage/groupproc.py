"""A member's slice of a tensor-parallel stage, run in a process of the group's own.

MLX's RDMA backend (jaccl) is a group made once per process by ``mx.distributed.init``,
kept for the process's life, and neither re-made nor split; a ring's groups form,
re-form and dissolve as Macs come and go. So where a group runs an MLX backend
(``groupengine.PROCESS_ENGINES``), each member's daemon starts a process for it
(``groupworker.py``): the process joins MLX's group, loads the member's slice and runs
the stage (the same ``StageRunner`` the daemon runs), fed the frames the daemon
takes for the stage and handing back what the stage sends. The process lives as long
as the group: a new plan with other members, a member lost, a stall, and the daemon
kills it (a process blocked in an RDMA wait for a dead peer can only be killed) and
starts another for the next group. The daemon keeps the ring's links, the plan, the
reports and the sealing; the process holds no socket to the ring.

Between the two, over a socketpair: messages of one byte of kind and four of length
(``Kind``), a frame inside as the wire encodes it, unsealed (the pair is the process's
own), JSON for the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import os
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ringd.ring.kvcost import KvCost
from ringd.stage.groupengine import JACCL, Choice
from ringd.ring.plan import Plan
from wire.frames import DEFAULT_LIMITS, Frame, FrameDecoder, encode_frame

log = logging.getLogger(__name__)

ENVELOPE = struct.Struct("<BI")
# A message holds one frame at most (a prompt chunk's hidden states) and its envelope.
MAX_MESSAGE_BYTES = DEFAULT_LIMITS.max_payload_bytes + DEFAULT_LIMITS.max_descriptor_bytes + 1024
# Every member's process must join MLX's group before any loads: they start within a
# second of each other once the plan reaches them; this covers a slow Mac's Python and
# MLX imports (a few seconds) and jaccl's exchange of queue pairs.
JOIN_TIMEOUT_S = 60.0
# How often the process tells the daemon its sessions' counts (status, metrics), when they changed.
STATS_INTERVAL_S = 1.0


class Kind(enum.IntEnum):
    LOAD = 1  # daemon -> process: what to join and load (JSON)
    FRAME = 2  # daemon -> process: a FORWARD or RELEASE for the stage
    CLOSE = 3  # daemon -> process: drop the stage's sessions
    EXPIRE = 4  # daemon -> process: expire idle sessions
    JOINED = 10  # process -> daemon: MLX's group is formed
    LOADED = 11  # process -> daemon: the slice is loaded (JSON: what the shard measured)
    SEND = 12  # process -> daemon: a frame for a node (u16 name length, name, frame)
    STATS = 13  # process -> daemon: [sessions, kv_bytes, prefix entries]
    FAILED = 14  # process -> daemon: {"error": why, "file": the model's files are at fault}


class GroupProcessError(Exception):
    """The group's process failed or ended (says why; its own log said more)."""

    def __init__(self, message: str, file_fault: bool = False):
        super().__init__(message)
        self.file_fault = file_fault


def message(kind: Kind, payload: bytes | list = b"") -> list:
    """The buffers of one message (a frame's buffers are passed on, not joined)."""
    parts = payload if isinstance(payload, list) else [payload]
    return [ENVELOPE.pack(kind, sum(memoryview(p).nbytes for p in parts)), *parts]


def frame_message(kind: Kind, frame: Frame, dest: str | None = None) -> list:
    head = [] if dest is None else [struct.pack("<H", len(dest.encode())) + dest.encode()]
    return message(kind, head + encode_frame(frame))


async def read_message(reader: asyncio.StreamReader) -> tuple[Kind, bytes] | None:
    """The next message, or None at the end of the stream."""
    try:
        kind, n = ENVELOPE.unpack(await reader.readexactly(ENVELOPE.size))
        if n > MAX_MESSAGE_BYTES:
            raise GroupProcessError(f"a message of {n} bytes, over {MAX_MESSAGE_BYTES}")
        return Kind(kind), await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        return None
    except ValueError as e:
        raise GroupProcessError(f"a message of an unknown kind: {e}") from None


def parse_frame(payload: bytes, with_dest: bool = False) -> tuple[str | None, Frame]:
    dest = None
    if with_dest:
        (n,) = struct.unpack_from("<H", payload)
        dest, payload = payload[2 : 2 + n].decode(), memoryview(payload)[2 + n :]
    frames = FrameDecoder().feed(payload)
    if len(frames) != 1:
        raise GroupProcessError(f"a frame message held {len(frames)} frames")
    return dest, frames[0]


def jaccl_available() -> bool:
    """MLX's own check: an RDMA library and device on this Mac (never on Linux)."""
    import mlx.core as mx

    return mx.distributed.is_available("jaccl")


def free_port(host: str) -> int:
    """A port free on ``host`` now, for a group process to listen on (MLX's backends bind it);
    OSError where ``host`` is not this machine's."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def backend_env(choice: Choice, rank: int) -> tuple[dict[str, str], list[Path]]:
    """The environment MLX's backend reads in the group process of ``rank``, and the files it
    names (the caller removes them once the process has joined): jaccl's device file and its
    coordinator, or the ring backend's host file."""

    def file(content) -> Path:
        fd, name = tempfile.mkstemp(prefix="ringd-group-", suffix=".json")
        with open(fd, "w") as f:
            json.dump(content, f)
        return Path(name)

    if choice.engine == JACCL:
        devices = file([list(row) for row in choice.devices])
        return {"MLX_RANK": str(rank), "MLX_IBV_DEVICES": str(devices), "MLX_JACCL_COORDINATOR": choice.addrs[0]}, [devices]
    hosts = file([[addr] for addr in choice.addrs])
    return {"MLX_RANK": str(rank), "MLX_HOSTFILE": str(hosts)}, [hosts]


@dataclasses.dataclass
class RemoteShard:
    """What the daemon knows of a slice its group process holds: what ``Shard`` tells status and the leader."""

    start: int
    end: int
    parameter_bytes: int
    kv_cost: KvCost


@dataclasses.dataclass
class SessionCounts:
    """A group process's sessions, as it last said (what ``Sessions`` tells status and metrics)."""

    count: int = 0
    kv_bytes: int = 0
    stored: int = 0

    def __len__(self) -> int:
        return self.count


class GroupProcess:
    """This member's group process, from the daemon's side.

    ``on_send(node, frame)``: what the stage sends (called on the loop). ``on_exit(why)``: the
    process ended or failed after it loaded (once); the stage is broken.
    """

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, plan: Plan, node: str):
        self._proc, self._reader, self._writer = proc, reader, writer
        self.plan, self.node = plan, node
        self.predecessor = plan.predecessor(node)
        successor = plan.successor(node)
        self.next_node = successor.node if successor else None
        self.sessions = SessionCounts()
        self.shard: RemoteShard | None = None
        self.on_send: Callable[[str, Frame], None] = lambda node, frame: None
        self.on_exit: Callable[[str], None] = lambda why: None
        self._started: asyncio.Queue[tuple[Kind, bytes] | None] = asyncio.Queue()
        self._ended: str | None = None
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"group-process-{proc.pid}")

    @classmethod
    async def start(cls, plan: Plan, node: str, spec: dict[str, Any], env: dict[str, str]) -> "GroupProcess":
        """Start the process and hand it ``spec`` (what ``groupworker`` joins and loads)."""
        ours, theirs = socket.socketpair()
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "ringd.stage.groupworker", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        gp = cls(proc, reader, writer, plan, node)
        gp._write(message(Kind.LOAD, json.dumps(spec).encode()))
        return gp

    @property
    def pid(self) -> int:
        return self._proc.pid

    async def loaded(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> RemoteShard:
        """Wait for the process to join MLX's group (within ``join_timeout_s``) and load its slice."""
        try:
            async with asyncio.timeout(join_timeout_s):
                await self._expect(Kind.JOINED)
        except TimeoutError:
            self.kill()
            raise GroupProcessError(f"the group's members did not all join MLX's group within {join_timeout_s:.0f} s") from None
        d = json.loads(await self._expect(Kind.LOADED))
        self.shard = RemoteShard(d["start"], d["end"], d["parameter_bytes"], KvCost.from_wire(d["kv_cost"]))
        return self.shard

    async def _expect(self, kind: Kind) -> bytes:
        got = await self._started.get()
        if got is None:
            raise GroupProcessError(self._ended or "the group process ended")
        k, payload = got
        if k == Kind.FAILED:
            d = json.loads(payload)
            raise GroupProcessError(d["error"], d.get("file", False))
        if k != kind:
            raise GroupProcessError(f"the group process said {k.name} where {kind.name} was due")
        return payload

    # --- what stagehost asks of a stage -------------------------------------------------

    def handle(self, frame: Frame) -> None:
        self._write(frame_message(Kind.FRAME, frame))

    def close(self) -> None:
        self._write(message(Kind.CLOSE))

    def expire_idle(self) -> None:
        self._write(message(Kind.EXPIRE))

    def kill(self) -> None:
        """End the process now (a member blocked in MLX's collective waits for nothing else)."""
        if self._proc.returncode is None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass

    async def stop(self) -> None:
        """Kill the process and wait for it (its memory is free when this returns)."""
        self.kill()
        await self._proc.wait()
        self._writer.close()

    # --- the process's side of the pair --------------------------------------------------

    def _write(self, buffers: list) -> None:
        if self._ended is None and not self._writer.is_closing():
            self._writer.writelines(buffers)

    async def _read(self) -> None:
        why = "the group process ended (its log says why)"
        try:
            while (got := await read_message(self._reader)) is not None:
                kind, payload = got
                if kind == Kind.SEND:
                    dest, frame = parse_frame(payload, with_dest=True)
                    self.on_send(dest, frame)
                elif kind == Kind.STATS:
                    self.sessions = SessionCounts(*json.loads(payload))
                elif kind == Kind.FAILED and self.shard is not None:
                    why = json.loads(payload)["error"]
                    break
                else:
                    self._started.put_nowait(got)
        except ConnectionError:
            pass  # it ended: its exit status says more
        except (GroupProcessError, ValueError, UnicodeDecodeError) as e:
            why = f"the group process's messages broke: {e}"
        except Exception as e:  # whatever it was, the stage must hear of it
            log.exception("reading the group process %d", self._proc.pid)
            why = f"{type(e).__name__}: {e}"
        self.kill()
        code = await self._proc.wait()
        self._ended = f"{why} (its exit status {code})" if code else why
        self._started.put_nowait(None)
        self.on_exit(self._ended)
