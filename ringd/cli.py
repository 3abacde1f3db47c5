"""``ringd serve | local | demo | convert``: the daemon's command line.

``serve`` runs one daemon until SIGINT/SIGTERM. ``local`` runs a ring of
daemon processes on this machine (``local.py``). ``demo`` is ``local`` with
three nodes and a small real model fetched once into a cache folder (``demo.py``).
``convert`` writes a GGUF file as an mlx-lm checkpoint directory (``gguf.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn

from ringd import config as config_mod
from ringd import logs
from ringd.names import DEFAULT_HTTP_PORT

# How often a `ringd local` node checks that its launcher is still alive.
PARENT_CHECK_S = 1.0


def cache_dir() -> Path:
    return Path(os.environ.get("RINGD_CACHE", Path.home() / ".cache" / "ringd"))


async def _serve(cfg: config_mod.Config, ring_sock: socket.socket | None = None, http_sock: socket.socket | None = None) -> int:
    from ringd.daemon import Node, build
    from ringd.models.errors import ModelError

    loop = asyncio.get_running_loop()
    # `kill -USR1 <pid>` writes every thread's stack to the log: how an operator
    # sees what a daemon that stopped answering is stuck on.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.get("RINGD_EXIT_WITH_PARENT")
    if parent:
        # Started by `ringd local`: don't outlive the launcher if it is killed.
        async def watch_parent():
            while os.getppid() == int(parent):
                await asyncio.sleep(PARENT_CHECK_S)
            stop.set()

        watcher = loop.create_task(watch_parent())

    async def up() -> Node:
        node = await build(cfg, ring_sock, http_sock)
        try:
            await node.start()
        except BaseException:
            await node.stop()
            raise
        return node

    # Raced with a signal: a start that waits (for a peer holding the model) still stops on one.
    starting = asyncio.ensure_future(up())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        logging.getLogger("ringd").info("stopping before the node was up")
        return 0
    stopped.cancel()
    try:
        node = starting.result()
    except (config_mod.ConfigError, ModelError, OSError) as e:
        logging.getLogger("ringd").error("ringd serve: %s", e)
        return 1
    await stop.wait()
    logging.getLogger("ringd").info("stopping")
    await node.stop()
    if parent:
        watcher.cancel()
    return 0


def _convert(model: str, out_dir: Path) -> int:
    from ringd.models.errors import ModelError
    from ringd.models.gguf import GgufFile
    from ringd.models.source import gguf_source

    try:
        file, _ = gguf_source(model)
        if file is None:
            raise ModelError(f"{model}: not a GGUF file; convert takes a .gguf file, OWNER/REPO:QUANT or ollama:NAME")
        if out_dir.exists() and any(out_dir.iterdir()):
            raise ModelError(f"{out_dir} exists and is not empty; name a new directory")
        g = GgufFile.open(file)
        total = sum(t.mlx_bytes for t in g.tensors.values())
        done = 0

        def tensor_done(t) -> None:
            nonlocal done
            done += t.mlx_bytes
            print(f"\rringd convert: {done / 2**20:,.0f} of {total / 2**20:,.0f} MiB", end="", flush=True)

        g.convert(out_dir, tensor_done)
    except (ModelError, OSError) as e:
        print(f"ringd convert: {e}", file=sys.stderr)
        return 1
    print(f"\nringd convert: wrote {out_dir} ({g.config['model_type']}, {g.config['num_hidden_layers']} layers); "
          f"mlx_lm.load({str(out_dir)!r}) reads it")  # fmt: skip
    return 0


def _run(coro) -> int:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # uvloop is a dependency; this only guards odd platforms
        return asyncio.run(coro)


def _exit_stopped(code: int) -> NoReturn:
    """End the process of a daemon that has stopped (``Node.stop`` ran: peers told, streams
    ended, the compute thread idle), without the interpreter's finalization.

    Every thread that ran MLX holds thread-local MLX state whose destructor takes the GIL as
    the thread ends. A thread that ends while the interpreter finalizes (the compute thread
    just stopped, an executor thread that built a GGUF model's layout, shut down a moment
    earlier) is ended by ``pthread_exit`` inside that destructor, through a ``noexcept``
    frame: the process aborts (SIGABRT, "terminate called without an active exception"),
    one clean stop in a few dozen here. Nothing is left for finalization to do: the logs
    are flushed here and the daemon owns no temporary files.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringd", description="Run one LLM across several machines in a ring.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run one daemon")
    config_mod.add_flags(serve)
    # Not config: a process's plumbing, handed down by whoever started it.
    for which in ("ring", "http"):
        serve.add_argument(
            f"--{which}-fd", type=int, metavar="FD",
            help=f"listen on this inherited socket instead of binding {which}_port (ringd local; socket activation)",
        )  # fmt: skip

    local = sub.add_parser("local", help="run a ring of N daemon processes on this machine")
    local.add_argument("--nodes", type=int, required=True, help="number of daemon processes")
    local.add_argument("--model", required=True, help="an mlx-lm model directory, a Hugging Face repo id, a .gguf file, OWNER/REPO:QUANT (a Hub GGUF repository's quant) or ollama:NAME[:TAG]")
    local.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help=f"the API's port (0: a free one); default {DEFAULT_HTTP_PORT}")
    local.add_argument("--host", default="127.0.0.1", help="the API's address; default 127.0.0.1")
    local.add_argument("--split", help="layers per node, e.g. 10,9,9 (default: even, low stages take the extra)")
    local.add_argument("--model-id", help="model name the API serves")
    local.add_argument("--draft-model", help="a small model with the same tokenizer, for speculative decoding")
    local.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    local.add_argument("--tls", default="off", choices=["off", "auto"], help="auto: https, with certificates from the run's cluster CA (its file is printed)")
    local.add_argument("--replicas", type=int, default=1, help="instances of the model, each a ring over its share of the nodes (e.g. 4 nodes, 2 replicas: two rings of two)")
    local.add_argument("--models-dir", help="a folder of models the nodes load on demand when a request names one (its subdirectory or .gguf file, by its name there)")

    from ringd import demo as demo_mod

    demo = sub.add_parser("demo", help=f"`local` with {demo_mod.NODES} nodes serving {demo_mod.MODEL_ID}, fetched once")
    demo.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help=f"the API's port (0: a free one); default {DEFAULT_HTTP_PORT}")
    demo.add_argument("--nodes", type=int, default=demo_mod.NODES, help=f"number of nodes; default {demo_mod.NODES}")
    demo.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    demo.add_argument("--tls", default="off", choices=["off", "auto"], help="auto: https, with certificates from the run's cluster CA (its file is printed)")

    convert = sub.add_parser("convert", help="write a GGUF file (or ollama:NAME) as an mlx-lm checkpoint directory")
    convert.add_argument("model", help="a .gguf file, OWNER/REPO:QUANT (a Hub GGUF repository's quant), or ollama:NAME[:TAG]")
    convert.add_argument("out_dir", help="the directory to write (must not exist, or be empty)")

    args = parser.parse_args(argv)
    if args.command == "convert":
        return _convert(args.model, Path(args.out_dir))
    if args.command == "serve":
        try:
            cfg = config_mod.load(args)
        except config_mod.ConfigError as e:
            print(f"ringd serve: config error: {e}", file=sys.stderr)
            return 2
        from ringd.listeners import ListenerError, adopt

        try:
            listeners = {key: adopt(fd, f"--{key.replace('_', '-')}") for key, fd in (("ring_fd", args.ring_fd), ("http_fd", args.http_fd)) if fd is not None}
        except ListenerError as e:
            print(f"ringd serve: {e}", file=sys.stderr)
            return 2
        logs.setup(cfg.name, cfg.log_level, cfg.log_format)
        _exit_stopped(_run(_serve(cfg, listeners.get("ring_fd"), listeners.get("http_fd"))))

    from ringd.ring.plan import PlacementError, parse_split
    from ringd.local import run_local

    if args.command == "local":
        try:
            split = parse_split(args.split) if args.split else None
        except PlacementError as e:
            parser.error(f"--split: {e}")
        return run_local(args.nodes, args.model, args.port, split, args.host, args.model_id, args.log_level, args.draft_model, args.tls, args.models_dir, args.replicas)

    return demo_mod.run(cache_dir(), args.port, args.nodes, args.log_level, args.tls)


if __name__ == "__main__":
    sys.exit(main())
