"""Listening sockets a launcher binds and hands down to the daemons it starts.

``ringd local`` binds every node's ring and HTTP ports itself (port 0: the
kernel picks a free one) and passes the sockets to its ``ringd serve``
processes as inherited file descriptors (``--ring-fd``, ``--http-fd``), as
launchd's and systemd's socket activation do. Nobody can take a port between
choosing it and listening on it, because there is no such moment: checking a
port free and letting the daemon bind it later is a race any other process on
the machine can win ("port in use").
"""

from __future__ import annotations

import socket

# Connections the kernel queues for a listener before it accepts them: a ring node
# takes a handful of peers, its API a burst of clients (aiohttp's own default is 128).
BACKLOG = 1024


class ListenerError(ValueError):
    """A descriptor handed down is not a listening TCP socket; the message names the flag."""


def bind(host: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on host:port (0: a free port the kernel picks), to hand down.

    Inheritable, so ``subprocess.Popen(..., pass_fds=[s.fileno()])`` gives the child the same
    listener; the launcher closes its own copy once the child has it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.set_inheritable(True)
    return sock


def adopt(fd: int, flag: str) -> socket.socket:
    """The listening TCP socket at descriptor ``fd``, handed down by a launcher; ``flag`` names
    where the number came from, for the error a wrong one gets."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ListenerError(f"{flag} {fd}: no socket open at that descriptor ({e.strerror})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()  # not ours to close
        raise ListenerError(f"{flag} {fd}: not a listening TCP socket")
    sock.setblocking(False)
    return sock
