"""``ringd serve | local | demo | convert``: the daemon's command line.

``serve`` runs one daemon until SIGINT/SIGTERM. ``local`` runs a ring of
daemon processes on this machine (``local.py``). ``demo`` is ``local`` with
three nodes and a small real model fetched once into a cache folder (``demo.py``).
``convert`` writes a GGUF file as an mlx-lm checkpoint directory (``gguf/reader.py``).
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

from ringd.node import config as config_mod
from ringd.base import logs
from ringd.base.names import DEFAULT_HTTP_PORT

# How often a `ringd local` node checks that its launcher is still alive.
PARENT_CHECK_S = 1.0
# The config keys `ringd local` takes as flags and hands to every node it starts (run_local's
# keywords): their names, help, defaults and checks are the config table's.
LOCAL_KEYS = ("nodes", "model", "split", "tensor_parallel", "tensor_engine", "model_id", "draft_model", "log_level", "tls", "replicas", "models_dir", "keep_alive")
# Where the launcher's meaning is not the daemon's: `ringd serve --nodes` is the ring size the
# first plan waits for; `ringd local --nodes` also starts that many processes.
LOCAL_HELP = {"nodes": "number of daemon processes, each a node of the ring"}


def config_flag(parser: argparse.ArgumentParser, name: str, help: str | None = None, **overrides) -> None:
    """``--NAME`` for the config key ``name``, with the table's help and default, and its value
    parsed and checked as ``ringd serve`` would (a bad one is argparse's usage error, naming the flag)."""
    key = next(k for k in config_mod.KEYS if k.name == name)

    def checked(raw: str):
        try:
            value = key.kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {'an integer' if key.kind is int else 'a number'}") from None
        try:
            return key.check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    checked.__name__ = name  # argparse names the type in some messages
    flag = "--" + name.replace("_", "-")
    options = {"type": checked, "default": key.default, "help": help or key.help, "metavar": name.upper(), **overrides}
    parser.add_argument(flag, dest=name, **options)


def cache_dir() -> Path:
    return Path(os.environ.get("RINGD_CACHE", Path.home() / ".cache" / "ringd"))


async def _serve(cfg: config_mod.Config, ring_sock: socket.socket | None = None, http_sock: socket.socket | None = None) -> int:
    from ringd.app.daemon import Node, build
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
    from ringd.models.gguf.reader import GgufFile
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
    for key in LOCAL_KEYS:
        # Required for the launcher, which has no config file to fall back on.
        config_flag(local, key, required=key in ("nodes", "model"), help=LOCAL_HELP.get(key))
    # The launcher's own: the API of node0 (every other node's ports are the kernel's choice).
    local.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help=f"the API's port (0: a free one); default {DEFAULT_HTTP_PORT}")
    local.add_argument("--host", default="127.0.0.1", help="the API's address; default 127.0.0.1")

    from ringd.app import demo as demo_mod

    demo = sub.add_parser("demo", help=f"`local` with {demo_mod.NODES} nodes serving {demo_mod.MODEL_ID}, fetched once")
    demo.add_argument("--port", type=int, default=DEFAULT_HTTP_PORT, help=f"the API's port (0: a free one); default {DEFAULT_HTTP_PORT}")
    demo.add_argument("--nodes", type=int, default=demo_mod.NODES, help=f"number of nodes; default {demo_mod.NODES}")
    config_flag(demo, "log_level", default="warning")
    config_flag(demo, "tls")

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
        from ringd.base.listeners import ListenerError, adopt

        try:
            listeners = {key: adopt(fd, f"--{key.replace('_', '-')}") for key, fd in (("ring_fd", args.ring_fd), ("http_fd", args.http_fd)) if fd is not None}
        except ListenerError as e:
            print(f"ringd serve: {e}", file=sys.stderr)
            return 2
        logs.setup(cfg.name, cfg.log_level, cfg.log_format)
        _exit_stopped(_run(_serve(cfg, listeners.get("ring_fd"), listeners.get("http_fd"))))

    if args.command == "local":
        from ringd.app.local import run_local

        return run_local(port=args.port, host=args.host, **{key: getattr(args, key) for key in LOCAL_KEYS})

    return demo_mod.run(cache_dir(), args.port, args.nodes, args.log_level, args.tls)


if __name__ == "__main__":
    sys.exit(main())
