"""What a node tells its peers about itself, once it has proved the cluster secret.

The handshake carries it as a JSON object (``wire/handshake.py`` knows it only as
that); this is where it becomes a value, once, as a link comes up. A field that is
missing or of the wrong type reads as unknown: an older or odd peer is a member
with less said about it, not an error, and no reader checks types again.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ringd.base.device import DeviceProfile


@dataclasses.dataclass(frozen=True)
class MemberInfo:
    addr: str = ""  # where peers dial its ring port, host:port
    http: str = ""  # its API, host:port
    https: bool = False  # whether that API is https: a follower forwards with the scheme its leader serves
    model: str = ""  # the fingerprint of the model it was started with
    budget: int | None = None  # bytes it gives weights and KV caches; None: unknown
    priority: int = 0  # its election rank (config ``priority``)
    api_only: bool = False  # it serves the API and holds no layers
    files: bool = False  # it holds its model whole and serves its files to peers fetching theirs
    profile: DeviceProfile | None = None  # its chip, memory and measured speed

    def to_wire(self) -> dict:
        d = dataclasses.asdict(self)
        d["profile"] = self.profile.to_wire() if self.profile is not None else None
        return d

    @classmethod
    def parse(cls, d: Any) -> MemberInfo:
        d = d if isinstance(d, dict) else {}

        def text(key: str) -> str:
            v = d.get(key)
            return v if isinstance(v, str) else ""

        budget, priority = d.get("budget"), d.get("priority")
        try:
            profile = DeviceProfile.from_wire(d.get("profile"))
        except (TypeError, ValueError):
            profile = None
        return cls(
            addr=text("addr"), http=text("http"), https=d.get("https") is True, model=text("model"),
            budget=budget if _count(budget) else None, priority=priority if _integer(priority) else 0,
            api_only=d.get("api_only") is True, files=d.get("files") is True, profile=profile,
        )  # fmt: skip


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _integer(v) and v >= 0
