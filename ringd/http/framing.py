"""How a stream's events become bytes: Server-Sent Events or NDJSON, and how a stream ends.

Each API streams in its own framing, and picks it here; the endpoint driver
(``endpoint.py``) writes every event of every stream through it:

- OpenAI's chat completions and completions: ``data:`` lines of JSON chunks,
  ended by ``data: [DONE]`` (after the last chunk, and after an error reported
  in-band);
- Responses and Anthropic's Messages: named events, an ``event:`` line (the
  event's ``type``) before each ``data:`` line;
- Ollama: one JSON object a line (NDJSON), non-ASCII as it is, as Ollama writes it.

A client that lags has the ring's next answers waiting when a token's events are
framed: ``Joined`` holds them to go out in one write with the next token's (the
same bytes, fewer writes) instead of one write per token.

Pure: dicts in, bytes out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable


def sse_data(obj: dict) -> bytes:
    """One unnamed Server-Sent Event: a ``data:`` line."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse(event: dict) -> bytes:
    """One named Server-Sent Event: its ``type`` on the ``event:`` line, then the event as data."""
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def ndjson(obj: dict) -> bytes:
    """One line of NDJSON."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


# The most a stream holds back to join with the next token's events: aiohttp's writer drains
# past 64 KiB (http_writer.LIMIT), so a larger write would only wait for the client longer.
MERGED_WRITE_BYTES = 64 * 1024


class Joined:
    """A stream's framed events on their way to the client: held while the next token's events
    follow without waiting (its client lags, so the ring's answers queue up), up to ``limit``
    bytes, and written together; else written at once, as they come."""

    def __init__(self, limit: int = MERGED_WRITE_BYTES):
        self.limit = limit
        self._held: list[bytes] = []
        self._size = 0

    def add(self, data: bytes, more: bool = False) -> bytes:
        """What to write now after ``data`` (b"": nothing yet); ``more``: the next events are here already."""
        if data:
            self._held.append(data)
            self._size += len(data)
        if more and self._size < self.limit or not self._held:
            return b""
        out = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held, self._size = [], 0
        return out


@dataclass(frozen=True)
class Framing:
    content_type: str
    frame: Callable[[dict], bytes]
    # Written once the last event is out (the answer's or an in-band error's): the stream's own end mark.
    done: bytes = b""


OPENAI_SSE = Framing("text/event-stream", sse_data, b"data: [DONE]\n\n")
NAMED_SSE = Framing("text/event-stream", sse)
NDJSON = Framing("application/x-ndjson", ndjson)


class NamedEvents:
    """What Anthropic's Messages and OpenAI's Responses say alike to the endpoint driver: named
    SSE events, streamed when the body says ``"stream": true``, never unloading a model."""

    framing = NAMED_SSE
    resumable = False  # a follower relays these events as they come; a new leader cannot continue them
    keep_alive = False

    def streams(self, body: dict) -> bool:
        return body.get("stream") is True

    def unloaded(self, body: dict) -> None:
        return None
