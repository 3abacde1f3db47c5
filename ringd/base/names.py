"""Names and addresses, checked by one rule wherever they come from.

A node or cluster name, an IP address, a port, ``host:port``: the config file,
the command line, a peer's handshake, a heartbeat's gossip, an election note
and a Bonjour advert all go through these checks, so a name one part takes is
a name every part takes. Nothing here imports the rest of ringd.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

# The ports a node listens on unless told otherwise: the ring's (every daemon-to-daemon
# frame) and the HTTP API's (8100, where the earliest users pointed their clients).
DEFAULT_RING_PORT = 50051
DEFAULT_HTTP_PORT = 8100

# Node and cluster names: also what election and discovery accept, so one rule everywhere.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def check_name(v: Any) -> str:
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise ValueError("must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return v


def check_port(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 65535:
        raise ValueError("must be a port number from 0 to 65535 (0: pick a free one)")
    return v


def check_host(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError("must be a non-empty string")
    try:
        ipaddress.ip_address(v)
    except ValueError:
        raise ValueError("must be an IP address (names are not resolved: .local lookups fail on many networks)") from None
    return v


def parse_hostport(v: Any) -> tuple[str, int]:
    """``"IP:PORT"`` (an IPv6 address may be bracketed) as (host, port); ValueError says what is wrong."""
    if not isinstance(v, str) or ":" not in v:
        raise ValueError(f"{v!r} must be IP:PORT, like 192.168.1.20:50051")
    host, _, port = v.rpartition(":")
    host = host.strip("[]")
    check_host(host)
    try:
        return host, check_port(int(port))
    except ValueError:
        raise ValueError(f"{v!r}: the port must be a number from 1 to 65535") from None


def natural_key(name: str) -> list:
    """Order node names as people do: node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
