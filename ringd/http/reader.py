"""Split what the model writes into answer text, reasoning and tool calls, token by token.

Markers are matched on text with mlx-lm's ``TextStateMachine`` (as its server
does: robust to a marker's bytes being tokenized any which way), and stripped:
``<think>`` ... ``</think>`` is reasoning, a native tool call's text between its
markers goes to mlx-lm's own tool parser once its end marker arrives, and is given
whole. In the generic format (``render.py``) an answer whose first character is ``{``
is the JSON of calls, read as it is written (``callscan.py``): a call's name the moment
it is written, its arguments as they come, so streams send calls as they are generated;
any other answer is text. The generic format is the engine's own: it never reaches a
client as text. A list that max_tokens cut keeps the calls it completed (``cut`` says
whether the one it cut had pieces out). A call that repeats one before it (a model that
would go on repeating it) is dropped, and ``repeated`` says the answer is over: while a
call could still be such a repeat its pieces are held back, so a stream never starts it.

A native call that does not parse (cut off by max_tokens, or a model that broke its
own format) is given back as text, markers and all, rather than lost.

Sans-I/O: text in, ``Output`` fields out; ``serving.py`` feeds it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine

from ringd.http.callscan import Arguments, Called, CallScanner, Named
from ringd.http.render import ReadPlan
from ringd.http.request import CallArguments, CallDone, CallOpened, CallPiece, ToolCall, whole_call

log = logging.getLogger(__name__)


class Reader:
    def __init__(self, plan: ReadPlan):
        self.plan = plan
        transitions: dict[str, list] = {"normal": []}
        if plan.think is not None:
            transitions["normal"].append((plan.think[0], "reasoning"))
            transitions["reasoning"] = [(plan.think[1], "normal")]
        if plan.tools == "native":
            start, end = plan.tool_markers
            transitions["normal"].append((start, "tool"))
            transitions.setdefault("reasoning", []).append((start, "tool"))
            transitions["tool"] = [(end, "normal")] if end else []
        self._sm = TextStateMachine(transitions)
        self._state = self._sm.make_state(plan.initial if plan.initial in transitions else "normal")
        self._tool_text = ""
        self._generic: str | None = None  # generic format: "json" or "text", once the first character shows
        self._scanner = CallScanner()
        self._seen: set[tuple[str, str]] = set()  # the calls read so far: name and arguments
        self._written: dict[str, list[str]] = {}  # by name: the arguments of each call read so far, as written
        self._call: _Call | None = None  # the generic call being read
        self._sent = 0  # calls whose pieces went out: the next one's index
        self.calls = 0  # tool calls read so far
        self.repeated = False  # a call came again: the answer is over (its repeats would be too)
        self.cut = False  # the answer ended inside a call whose pieces went out (max_tokens cut it)

    @property
    def state(self) -> str:
        return self._state[0]

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[CallPiece]]:
        """The answer text, reasoning and call pieces that ``text`` adds; ``final`` on the last piece."""
        self._state, segments = TextStateMachine.split(self._state, text)
        if final:
            self._state, rest, name = TextStateMachine.flush(self._state)
            segments.append((name, rest))
        answer, reasoning, pieces = [], [], []
        previous = None
        for name, piece in segments:
            if previous == "tool" and name != "tool":
                pieces += self._close_native(answer)
            if name == "reasoning":
                reasoning.append(piece)
            elif name == "tool":
                self._tool_text += piece
            else:
                answer.append(piece)
            previous = name
        if final and self.state == "tool" and self._tool_text:
            pieces += self._close_native(answer)  # a format without an end marker ends with the answer
        text_out = "".join(answer)
        if self.plan.tools == "generic":
            text_out, more = self._generic_feed(text_out, final)
            pieces += more
        return text_out, "".join(reasoning), pieces

    def _fresh(self, call: ToolCall) -> bool:
        """Whether ``call`` was not made before; at the first that was, the answer is over."""
        if self.repeated or (call.name, call.arguments) in self._seen:
            self.repeated = True
            return False
        self._seen.add((call.name, call.arguments))
        self.calls += 1
        return True

    def _close_native(self, answer: list[str]) -> list[CallPiece]:
        raw, self._tool_text = self._tool_text, ""
        try:
            parsed = self.plan.tool_parser(raw, self.plan.template_tools)
        except Exception as e:  # each of mlx-lm's parsers raises its own kind
            log.warning("a tool call did not parse (%s: %s); returned as text", type(e).__name__, e)
            start, end = self.plan.tool_markers
            answer.append(start + raw + end)
            return []
        pieces = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            args = c.get("arguments", {})
            call = ToolCall(ToolCall.new_id(), str(c.get("name", "")), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
            if self._fresh(call):
                pieces += whole_call(call, self._sent)
                self._sent += 1
        return pieces

    def _generic_feed(self, text: str, final: bool) -> tuple[str, list[CallPiece]]:
        if self._generic is None and text:
            self._generic = "json" if text[0] == "{" else "text"
        if self._generic != "json":
            return text, []
        pieces: list[CallPiece] = []
        for e in self._scanner.feed(text):
            if self.repeated:
                break
            if isinstance(e, Named):
                self._call = _Call(ToolCall.new_id(), e.name)
                pieces += self._written_more("")
            elif isinstance(e, Arguments) and self._call is not None:
                pieces += self._written_more(e.text)
            elif isinstance(e, Called) and self._call is not None:
                current = self._call
                call = ToolCall(current.id, e.name, e.arguments)
                if self._fresh(call) or current.index is not None:
                    # A repeat whose pieces went out already is sent whole all the same (a stream
                    # cannot take them back), and ends the answer.
                    pieces += self._release() + [CallDone(current.index, call)]
                    self._written.setdefault(e.name, []).append(_squeezed(current.written))
                self._call = None
        if final and self._call is not None:
            self.cut = self._call.index is not None  # held pieces of a call that never ended are dropped unsent
            self._call = None
        if final and not self._scanner.done and not self.repeated:
            log.info("the answer ended inside its list of calls (max_tokens?): its %d complete call(s) kept", self.calls)
        return "", pieces

    def _written_more(self, text: str) -> list[CallPiece]:
        """The pieces of the call being read that can go out, now that ``text`` of its arguments came.

        Held while the call may still repeat one before it (same name, its arguments so far
        the start of that one's): a repeat is dropped unsent, a stream never begins it."""
        c = self._call
        c.written += text
        c.unsent += text
        if c.index is None and any(e.startswith(_squeezed(c.written)) for e in self._written.get(c.name, ())):
            return []
        return self._release()

    def _release(self) -> list[CallPiece]:
        c, pieces = self._call, []
        if c.index is None:
            c.index, self._sent = self._sent, self._sent + 1
            pieces.append(CallOpened(c.index, c.id, c.name))
        if c.unsent:
            pieces.append(CallArguments(c.index, c.unsent))
            c.unsent = ""
        return pieces


@dataclass
class _Call:
    """The generic call being read."""

    id: str
    name: str
    written: str = ""  # its arguments so far
    unsent: str = ""  # what of them has not gone out
    index: int | None = None  # once its pieces go out: its place among the calls sent


def _squeezed(json_text: str) -> str:
    # Whitespace aside, for telling whether a call is writing one before it again: a
    # heuristic that only ever holds pieces a little longer, never drops a new call.
    return "".join(json_text.split())
