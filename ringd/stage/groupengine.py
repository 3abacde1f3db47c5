"""Which collective a tensor-parallel group runs its all-reduces on (sans-I/O).

Three engines exist, and the best differs by link:

- ``ringd``: partial sums as REDUCE frames over the cluster's own sealed links, in the
  daemon's process (``tensorgroup.TensorGroup``). Works on every link; what a group runs
  unless it can do better.
- ``jaccl``: MLX's RDMA backend over Thunderbolt 5 (macOS 26.2 and later, RDMA enabled in
  recovery mode), an order of magnitude below any TCP path per call. MLX makes one jaccl
  group per process, for the process's life, so the members run the group's slice in a
  process of the group's own (``groupproc.py``), started when the group forms and killed
  when it breaks or re-forms.
- ``mlx-ring``: MLX's TCP ``ring`` backend, in such a process too. Never chosen by
  ``auto``: measured slower per token than ``ringd`` on the same links
  (docs/benchmarks.md) and its sockets are not authenticated; kept as a setting so the
  process path runs (and is tested) where no Mac has RDMA, and for the comparison.

Each member offers what it has (``Offer``: whether MLX's own availability check says jaccl
runs here, and the RDMA device its config names toward each peer); the offers are
gathered over the ringd engine when the group forms, and every member reads the same
choice from the same offers (``choose``), so no member runs an engine another did not.
"""

from __future__ import annotations

import dataclasses
import json
import re

RINGD, JACCL, MLX_RING = "ringd", "jaccl", "mlx-ring"
# What ``tensor_engine`` may say: auto (jaccl where every member has it, else ringd), or one engine.
ENGINES = ("auto", RINGD, JACCL, MLX_RING)
PROCESS_ENGINES = (JACCL, MLX_RING)  # run in a group process: MLX's backend name for each
MLX_BACKEND = {JACCL: "jaccl", MLX_RING: "ring"}

# An offer travels as a fixed-size all-gather (every member's array must be the same shape):
# a node name, an address and a device name for each of up to 15 peers fit well inside.
OFFER_BYTES = 4096
DEVICE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """This node's part of the choice, from its config: ``tensor_engine`` and ``rdma_devices``."""

    wanted: str = "auto"
    rdma: dict[str, str] = dataclasses.field(default_factory=dict)


class EngineError(Exception):
    """The configured engine cannot run this group (says which member lacks what)."""


@dataclasses.dataclass(frozen=True)
class Offer:
    """What one member brings to a group: ``jaccl`` is ``mx.distributed.is_available("jaccl")``
    on its Mac; ``rdma`` names, per peer, the RDMA device (``ibv_devices``: rdma_en3) on this
    Mac whose Thunderbolt cable reaches that peer; ``addr`` is host:port its group process
    listens on, if the group runs in processes (MLX's ring hostfile, jaccl's coordinator)."""

    node: str
    wanted: str = "auto"  # its tensor_engine: the group's first member's is the group's
    jaccl: bool = False
    rdma: dict[str, str] = dataclasses.field(default_factory=dict)
    addr: str = ""

    def to_bytes(self) -> bytes:
        raw = json.dumps(dataclasses.asdict(self)).encode()
        if len(raw) > OFFER_BYTES:
            raise EngineError(f"{self.node}'s offer to its group is {len(raw)} bytes, over {OFFER_BYTES}: too many rdma_devices")
        return raw.ljust(OFFER_BYTES, b"\0")

    @classmethod
    def from_bytes(cls, raw: bytes, node: str) -> "Offer":
        """``node``'s offer as it came; anything malformed is an error naming the member."""
        try:
            d = json.loads(raw.rstrip(b"\0"))
            offer = cls(d["node"], d["wanted"], d["jaccl"], dict(d["rdma"]), d["addr"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise EngineError(f"{node}'s offer to its group does not parse: {e}") from None
        if offer.node != node or offer.wanted not in ENGINES or not isinstance(offer.jaccl, bool) or not isinstance(offer.addr, str):
            raise EngineError(f"{node}'s offer to its group is not {node}'s: {offer}")
        if not all(isinstance(k, str) and isinstance(v, str) and DEVICE_NAME.fullmatch(v) for k, v in offer.rdma.items()):
            raise EngineError(f"{node}'s offer names RDMA devices that are not device names: {offer.rdma}")
        return offer


@dataclasses.dataclass(frozen=True)
class Choice:
    engine: str
    why: str
    # jaccl's device file: devices[i][j] is the device on member i that reaches member j.
    devices: tuple[tuple[str | None, ...], ...] | None = None
    addrs: tuple[str, ...] = ()  # each member's group process's host:port, rank order

    @property
    def in_process(self) -> bool:
        """Whether the group runs in a process of its own (an MLX backend), not in the daemon."""
        return self.engine in PROCESS_ENGINES


def choose(offers: list[Offer]) -> Choice:
    """The engine of a group whose members (rank order) made ``offers``, for the
    ``tensor_engine`` its first member wants (members whose configs differ still agree).
    ``auto`` takes jaccl only where every member has it and every pair a device; ``jaccl``
    asked for and impossible is an error that says what is missing."""
    wanted, addrs = offers[0].wanted, tuple(o.addr for o in offers)
    if wanted == RINGD:
        return Choice(wanted, f"tensor_engine: {wanted}", addrs=addrs)
    unaddressed = [o.node for o in offers if not o.addr]
    if wanted == MLX_RING:
        if unaddressed:
            raise EngineError(f"tensor_engine is mlx-ring, but {', '.join(unaddressed)} has no address a group process can listen on")
        return Choice(wanted, f"tensor_engine: {wanted}", addrs=addrs)
    missing = _jaccl_missing(offers)
    if missing is None and not offers[0].addr:
        missing = f"{offers[0].node} has no address jaccl's coordinator can listen on"
    if missing is None:
        devices = tuple(tuple(None if a is b else a.rdma[b.node] for b in offers) for a in offers)
        return Choice(JACCL, "RDMA on every member (MLX's jaccl backend)", devices, addrs)
    if wanted == JACCL:
        raise EngineError(f"tensor_engine is jaccl, but {missing}")
    return Choice(RINGD, f"no RDMA: {missing}", addrs=addrs)


def _jaccl_missing(offers: list[Offer]) -> str | None:
    """What keeps jaccl from this group, or None."""
    for a in offers:
        if not a.jaccl:
            return f"{a.node} has no RDMA (MLX says jaccl is not available there: macOS 26.2+, Thunderbolt 5, rdma_ctl enable)"
    for a in offers:
        for b in offers:
            if a is not b and b.node not in a.rdma:
                return f"{a.node} names no RDMA device toward {b.node} (rdma_devices in {a.node}'s config)"
    return None
