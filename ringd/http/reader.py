"""Split what the model writes into answer text, reasoning and tool calls, token by token.

Markers are matched on text with mlx-lm's ``TextStateMachine`` (as its server
does: robust to a marker's bytes being tokenized any which way), and stripped:
``<think>`` ... ``</think>`` is reasoning, a native tool call's text between its
markers goes to mlx-lm's own tool parser once its end marker arrives. In the
generic format (``render.py``) an answer whose first character is ``{`` is the
JSON of calls, each read the moment its object closes (``callscan.py``); any other
answer is text. The generic format is the engine's own: it never reaches a client as
text. A list that max_tokens cut keeps the calls it completed; a call that repeats one
before it (a model that would go on repeating it) is dropped, and ``repeated`` says the
answer is over.

A native call that does not parse (cut off by max_tokens, or a model that broke its
own format) is given back as text, markers and all, rather than lost.

Sans-I/O: text in, ``Output`` fields out; ``serving.py`` feeds it.
"""

from __future__ import annotations

import json
import logging

from mlx_lm.generate import TextStateMachine

from ringd.http.callscan import Called, CallScanner
from ringd.http.render import ReadPlan
from ringd.http.request import ToolCall

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
        self.calls = 0  # tool calls read so far
        self.repeated = False  # a call came again: the answer is over (its repeats would be too)

    @property
    def state(self) -> str:
        return self._state[0]

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCall]]:
        """The answer text, reasoning and completed calls that ``text`` adds; ``final`` on the last piece."""
        self._state, segments = TextStateMachine.split(self._state, text)
        if final:
            self._state, rest, name = TextStateMachine.flush(self._state)
            segments.append((name, rest))
        answer, reasoning, calls = [], [], []
        previous = None
        for name, piece in segments:
            if previous == "tool" and name != "tool":
                calls += self._close_native(answer)
            if name == "reasoning":
                reasoning.append(piece)
            elif name == "tool":
                self._tool_text += piece
            else:
                answer.append(piece)
            previous = name
        if final and self.state == "tool" and self._tool_text:
            calls += self._close_native(answer)  # a format without an end marker ends with the answer
        text_out = "".join(answer)
        if self.plan.tools == "generic":
            text_out, more = self._generic_feed(text_out, final)
            calls += more
        calls = self._new(calls)
        self.calls += len(calls)
        return text_out, "".join(reasoning), calls

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The calls not made before; at the first that was, the answer is over."""
        fresh = []
        for c in calls:
            if self.repeated or (c.name, c.arguments) in self._seen:
                self.repeated = True
                continue
            self._seen.add((c.name, c.arguments))
            fresh.append(c)
        return fresh

    def _close_native(self, answer: list[str]) -> list[ToolCall]:
        raw, self._tool_text = self._tool_text, ""
        try:
            parsed = self.plan.tool_parser(raw, self.plan.template_tools)
        except Exception as e:  # each of mlx-lm's parsers raises its own kind
            log.warning("a tool call did not parse (%s: %s); returned as text", type(e).__name__, e)
            start, end = self.plan.tool_markers
            answer.append(start + raw + end)
            return []
        calls = []
        for c in parsed if isinstance(parsed, list) else [parsed]:
            args = c.get("arguments", {})
            calls.append(ToolCall(ToolCall.new_id(), str(c.get("name", "")), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
        return calls

    def _generic_feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self._generic is None and text:
            self._generic = "json" if text[0] == "{" else "text"
        if self._generic != "json":
            return text, []
        calls = [ToolCall(ToolCall.new_id(), e.name, e.arguments) for e in self._scanner.feed(text) if isinstance(e, Called)]
        if final and not self._scanner.done and not self.repeated:
            log.info("the answer ended inside its list of calls (max_tokens?): its %d complete call(s) kept", self._scanner.calls)
        return "", calls
