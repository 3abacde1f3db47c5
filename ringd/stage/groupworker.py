"""``python -m ringd.stage.groupworker FD``: a group process (``groupproc.py``).

It joins MLX's group for the backend its daemon chose (``mx.distributed.init``: jaccl,
or MLX's TCP ring), loads this member's slice of the stage's layers with mlx-lm's own
``shard()`` over that group, and runs the stage: frames from the daemon go to a
``StageRunner`` as they would in the daemon, and what the stage sends goes back to
the daemon to pass on. MLX's collective does the all-reduces, inside the forward
pass, with no Python between the members.

The process ends when its daemon closes the pair or kills it; it never outlives the
group (a new group is a new process: MLX's group cannot be re-made in one).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from ringd.stage.groupproc import STATS_INTERVAL_S, GroupProcessError, Kind, frame_message, message, parse_frame, read_message

log = logging.getLogger("ringd.groupworker")

ORPHAN_CHECK_S = 1.0  # how often the process looks for its daemon


def join(backend: str):
    """MLX's group for ``backend`` (its settings are in this process's environment, set by
    the daemon: rank, and the ring's hostfile or jaccl's devices and coordinator)."""
    import mlx.core as mx

    from ringd.stage.tensorgroup import MlxGroup

    group = mx.distributed.init(strict=True, backend=backend)
    # One all-reduce before loading: every member is up and the backend's sockets or queue
    # pairs carry data (a member that cannot join fails here, not at its first token).
    mx.eval(mx.distributed.all_sum(mx.ones(1), group=group))
    return MlxGroup(group)


async def serve(sock: socket.socket) -> None:
    from ringd.base.metrics import Metrics
    from ringd.models.checkpoint import load_tokenizer
    from ringd.models.source import model_info
    from ringd.models.errors import ModelError, ModelFileError
    from ringd.ring.plan import Plan
    from ringd.stage.compute import ComputeThread
    from ringd.stage.runner import StageRunner
    from ringd.stage.shard import Shard

    reader, writer = await asyncio.open_unix_connection(sock=sock)
    first = await read_message(reader)
    if first is None or first[0] != Kind.LOAD:
        raise GroupProcessError("the daemon sent no LOAD first")
    spec = json.loads(first[1])
    node, plan = spec["node"], Plan.from_wire(spec["plan"])
    compute = ComputeThread(f"ringd-group-{node}")

    def fail(error: str, file_fault: bool = False) -> None:
        writer.writelines(message(Kind.FAILED, json.dumps({"error": error, "file": file_fault}).encode()))

    try:
        group = await compute.run(join, spec["backend"])
        writer.writelines(message(Kind.JOINED))
        shard = await compute.run(Shard.load, spec["model"], spec["start"], spec["end"], None, group)
    except ModelError as e:
        fail(str(e), isinstance(e, ModelFileError))
        await writer.drain()
        return
    except Exception as e:  # the daemon reports it to the leader; this process ends
        log.exception("the group process could not join or load")
        fail(f"{type(e).__name__}: {e}")
        await writer.drain()
        return
    loaded = {"start": shard.start, "end": shard.end, "parameter_bytes": shard.parameter_bytes, "kv_cost": shard.kv_cost.to_wire()}
    writer.writelines(message(Kind.LOADED, json.dumps(loaded).encode()))
    log.info("joined MLX's %s group as rank %d of %d; layers [%d, %d)", spec["backend"], group.rank(), group.size(), shard.start, shard.end)

    def send(dest: str, frame) -> None:
        if not writer.is_closing():
            writer.writelines(frame_message(Kind.SEND, frame, dest))

    def grammar():
        from ringd.stage import grammar

        return grammar.ll_tokenizer(load_tokenizer(model_info(spec["model"])), shard.info.vocab_size)

    runner = StageRunner(node, plan, shard, compute, send, Metrics(node), grammar)
    loop = asyncio.get_running_loop()
    # MLX's group cannot heal: the process ends, saying why, and its daemon's stage is broken.
    runner.group_broken = lambda why: loop.call_soon_threadsafe(fail, f"MLX's collective lost a member: {why}")

    async def report() -> None:
        last = None
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            now = await compute.run(lambda: [len(runner.sessions), runner.sessions.kv_bytes, runner.sessions.stored])
            if now != last:
                writer.writelines(message(Kind.STATS, json.dumps(now).encode()))
                last = now

    reporting = asyncio.create_task(report())
    try:
        while (got := await read_message(reader)) is not None:
            kind, payload = got
            if kind == Kind.FRAME:
                runner.handle(parse_frame(payload)[1])
            elif kind == Kind.CLOSE:
                runner.close()
            elif kind == Kind.EXPIRE:
                runner.expire_idle()
            else:
                raise GroupProcessError(f"the daemon sent {kind.name} to a loaded stage")
    finally:
        reporting.cancel()


def _orphaned(parent: int) -> None:
    """End the process once its daemon is gone, even while MLX blocks in a join or a collective
    (the pair's end-of-stream is read only between frames)."""
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


def main() -> None:
    from ringd.base import logs

    # A Ctrl-C at the daemon's terminal reaches its whole process group: the daemon decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_orphaned, args=(os.getppid(),), daemon=True, name="orphaned").start()
    fd = int(sys.argv[1])
    logs.setup(os.environ.get("RINGD_GROUP_NODE", "group"), os.environ.get("RINGD_LOG_LEVEL", "info"))
    sock = socket.socket(fileno=fd)
    try:
        asyncio.run(serve(sock))
    except Exception:
        log.exception("the group process failed")
        os._exit(1)
    # Straight out: MLX threads and the group's sockets need no orderly teardown (see
    # compute.py: a thread that ran MLX and ends while the interpreter finalizes aborts).
    os._exit(0)


if __name__ == "__main__":
    main()
