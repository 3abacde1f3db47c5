"""One answer as segments: thinking, answer text and tool calls, in the order the model writes them.

The state machine behind Anthropic's content blocks (``anthropic_api.Blocks``) and
Responses' output items (``responses_api.OutputItems``). Sans-I/O: ``Output``
events in, the API's stream events out; ``segments`` holds what they built. A
whole answer runs the same machine and drops the events, so a streamed answer
and a whole one agree by construction.

What is decided here, once: a kind of text that changes closes the open segment
and opens another; a call opens a segment with its name, streams its arguments
and closes; answer whitespace before any text is held back, so it opens no
segment if only calls follow (a native call's template puts a newline before
it). What each API's subclass says: how a segment opens, grows and closes, as
its own events and its own dicts.
"""

from __future__ import annotations

from ringd.http.request import CallArguments, CallOpened, CallPiece, Output


class Segments:
    # The API's names of its segments' types: answer text, thinking, a tool call.
    TEXT = "text"
    THINKING = "thinking"
    CALL = "call"

    def __init__(self):
        self.segments: list[dict] = []
        self._open: dict | None = None  # the segment being written
        self._blank = ""  # answer whitespace held back

    def feed(self, out: Output) -> list[dict]:
        events = []
        if out.reasoning:
            events += self._write(self.THINKING, out.reasoning)
        if out.text:
            if not self._writing(self.TEXT) and not (self._blank + out.text).strip():
                self._blank += out.text
            else:
                text, self._blank = self._blank + out.text, ""
                events += self._write(self.TEXT, text)
        for piece in out.pieces:
            events += self._call(piece)
        return events

    def _writing(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if not self._writing(kind):
            events += self._close()
            events += self._begin(kind)
        return events + self._grow(kind, text)

    def _call(self, piece: CallPiece) -> list[dict]:
        """A call as it is written: its segment opens with its name, its arguments stream, it ends."""
        if isinstance(piece, CallOpened):
            self._blank = ""  # whitespace before a call is no answer
            return self._close() + self._begin_call(piece)
        if isinstance(piece, CallArguments):
            return self._arguments(piece.text)
        return self._call_done(piece)

    def _cut_call(self, streamed: bool) -> bool:
        """At the end: whether a call max_tokens cut is left open (``streamed``: its start went
        out, so it ends as a cut answer does); a whole answer drops it and keeps the calls it
        completed."""
        if not self._writing(self.CALL):
            return False
        if streamed:
            return True
        self.segments.pop()
        self._open = None
        return False

    def _answered(self) -> bool:
        return any(s["type"] in (self.TEXT, self.CALL) for s in self.segments)

    def _opened(self, segment: dict) -> int:
        """``segment`` is the open one now; its index."""
        self.segments.append(segment)
        self._open = segment
        return len(self.segments) - 1

    # What each API says, as its events.
    def _begin(self, kind: str) -> list[dict]:
        raise NotImplementedError

    def _grow(self, kind: str, text: str) -> list[dict]:
        raise NotImplementedError

    def _close(self, status: str = "completed") -> list[dict]:
        raise NotImplementedError

    def _begin_call(self, piece: CallOpened) -> list[dict]:
        raise NotImplementedError

    def _arguments(self, text: str) -> list[dict]:
        raise NotImplementedError

    def _call_done(self, piece: CallPiece) -> list[dict]:
        return self._close()
