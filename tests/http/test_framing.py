"""ringd.http.framing: the bytes each API's streams are written in.

The clients read these bytes (the official SDKs' SSE and NDJSON readers, a
follower's proxy.py that splits events at blank lines), so they are pinned here.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from ringd.http.framing import NAMED_SSE, NDJSON, OPENAI_SSE, Joined, ndjson, sse, sse_data


def test_openais_chunks_are_data_lines_ended_by_done():
    assert sse_data({"id": "x", "choices": []}) == b'data: {"id":"x","choices":[]}\n\n'
    assert OPENAI_SSE.content_type == "text/event-stream" and OPENAI_SSE.done == b"data: [DONE]\n\n"


def test_named_events_say_their_type_before_their_data():
    event = {"type": "message_start", "message": {"id": "m"}}
    assert sse(event) == b'event: message_start\ndata: {"type":"message_start","message":{"id":"m"}}\n\n'
    assert NAMED_SSE.frame is sse and NAMED_SSE.content_type == "text/event-stream" and NAMED_SSE.done == b""


def test_ndjson_is_one_object_a_line_with_text_as_it_is():
    line = ndjson({"response": "é\n", "done": False})
    assert line == '{"response":"é\\n","done":false}\n'.encode() and line.count(b"\n") == 1
    assert json.loads(line) == {"response": "é\n", "done": False}
    assert NDJSON.content_type == "application/x-ndjson" and NDJSON.done == b""


@given(st.lists(st.tuples(st.binary(max_size=40), st.booleans()), max_size=40), st.integers(1, 100))
def test_a_lagging_streams_events_are_joined_into_fewer_writes_with_the_same_bytes(tokens, limit):
    """Each token's events with whether the next token's are here already: held while they are
    (below the limit), else written with all that was held, so the client reads the same bytes."""
    joined = Joined(limit)
    writes = []
    for data, more in tokens:
        out = joined.add(data, more)
        if out:
            writes.append(out)
        if not more:  # nothing waits behind this token: nothing may stay held
            assert joined.add(b"") == b""
    writes.append(joined.add(b""))  # the stream's end writes what is left
    assert b"".join(writes) == b"".join(data for data, _ in tokens)
    assert all(len(w) < limit + 40 for w in writes)  # a write stops at the first token past the limit
    assert sum(1 for w in writes if w) <= sum(1 for data, _ in tokens if data)
