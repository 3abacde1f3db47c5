"""How a stream's events become bytes: Server-Sent Events or NDJSON, and how a stream ends.

Each API streams in its own framing, and picks it here; the endpoint driver
(``endpoint.py``) writes every event of every stream through it:

- OpenAI's chat completions and completions: ``data:`` lines of JSON chunks,
  ended by ``data: [DONE]`` (after the last chunk, and after an error reported
  in-band);
- Responses and Anthropic's Messages: named events, an ``event:`` line (the
  event's ``type``) before each ``data:`` line;
- Ollama: one JSON object a line (NDJSON), non-ASCII as it is, as Ollama writes it.

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


@dataclass(frozen=True)
class Framing:
    content_type: str
    frame: Callable[[dict], bytes]
    # Written once the last event is out (the answer's or an in-band error's): the stream's own end mark.
    done: bytes = b""


OPENAI_SSE = Framing("text/event-stream", sse_data, b"data: [DONE]\n\n")
NAMED_SSE = Framing("text/event-stream", sse)
NDJSON = Framing("application/x-ndjson", ndjson)
