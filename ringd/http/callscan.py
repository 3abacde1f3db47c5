"""The generic tool-call format (``render.py``), read as the model writes it.

``{"tool_calls": [{"name": "...", "arguments": {...}}, ...]}``: a model held to it by
its grammar writes one call after another, and may go on writing calls (the same one,
over and over: SmolLM2 does at temperature 0) until ``max_tokens`` cuts the list. Read
as a whole at the end, such a list does not parse and every complete call in it was
lost. Read here character by character, each call is known the moment its object
closes, its name as soon as the name is written and its arguments as they are written,
so calls can be streamed as they come and a cut list keeps what it completed.

Sans-I/O: text in, events out. It reads any JSON without failing: what is not a call
where the format puts calls is passed over, and a call whose name or arguments are
missing or not JSON is not reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# Depths of the format: the top object, its "tool_calls" array, a call's object.
_TOP, _LIST, _CALL = 1, 2, 3


@dataclass(frozen=True)
class Named:
    """Call ``index`` is named ``name`` (its arguments follow)."""

    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    """More of call ``index``'s arguments, as JSON text: the pieces join to the whole."""

    index: int
    text: str


@dataclass(frozen=True)
class Called:
    """Call ``index`` is complete: its name and arguments (JSON text, as json.dumps writes them)."""

    index: int
    name: str
    arguments: str


class CallScanner:
    def __init__(self):
        self.calls = 0  # calls completed
        self.done = False  # the top-level value is complete
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._keys: list[str | None] = []  # per open container: an object's last key
        self._awaiting: list[bool] = []  # per open container: a value is due (after ":" or in an array)
        self._in_string = False
        self._escape = False
        self._string: list[str] = []
        self._listed = False  # the array open at depth 2 is the top object's "tool_calls"
        # The call being read (at depth 3).
        self._name: str | None = None  # once written: its arguments go out from then on
        self._args: list[str] = []  # all of its arguments' text
        self._args_state = ""  # "", "open" (being written), "done"
        self._args_kind = ""  # "container", "string" or "scalar"
        self._unsent: list[str] = []  # arguments text not yet given out

    def feed(self, text: str) -> list[Named | Arguments | Called]:
        out: list[Named | Arguments | Called] = []
        for ch in text:
            self._char(ch, out)
        self._send_arguments(out)
        return out

    # --- one character ---------------------------------------------------------------

    def _char(self, ch: str, out: list) -> None:
        depth = len(self._stack)
        if self._listed and depth == _CALL and not self._in_string and self._awaiting[-1] and not ch.isspace():
            if self._keys[-1] == "arguments" and self._args_state == "" and ch not in ",}":
                self._args_state = "open"
                self._args_kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
        if self._args_state == "open":
            ends_scalar = self._args_kind == "scalar" and depth == _CALL and not self._in_string and (ch in ",}" or ch.isspace())
            if ends_scalar:
                self._args_state = "done"
            else:
                self._args.append(ch)
                self._unsent.append(ch)

        if self._in_string:
            self._string.append(ch)
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self._string_ended(depth, out)
            return
        if ch == '"':
            self._in_string = True
            self._string = [ch]
        elif ch in "{[":
            if depth >= 1:
                self._awaiting[-1] = False
            if ch == "[" and depth == _TOP and self._stack == ["{"] and self._keys[-1] == "tool_calls":
                self._listed = True
            elif ch == "{" and self._listed and depth == _LIST:
                self._new_call()
            self._stack.append(ch)
            self._keys.append(None)
            self._awaiting.append(ch == "[")
        elif ch in "}]":
            if not self._stack:
                return
            self._stack.pop()
            self._keys.pop()
            self._awaiting.pop()
            depth = len(self._stack)
            self.done = depth == 0
            if self._listed and depth == _CALL and self._args_state == "open" and self._args_kind == "container":
                self._args_state = "done"
            elif self._listed and depth == _LIST and ch == "}":
                self._call_ended(out)
            elif depth == _TOP and ch == "]":
                self._listed = False
        elif ch == ":" and self._stack and self._stack[-1] == "{":
            self._awaiting[-1] = True
        elif ch == "," and self._stack:
            self._awaiting[-1] = self._stack[-1] == "["
        elif not ch.isspace() and self._stack:
            self._awaiting[-1] = False  # a number, true, false or null: a value, under way

    def _string_ended(self, depth: int, out: list) -> None:
        if not self._stack:
            return
        if self._stack[-1] == "{" and not self._awaiting[-1]:
            self._keys[-1] = _decoded(self._string)  # a key
            return
        self._awaiting[-1] = False
        if self._listed and depth == _CALL:
            if self._keys[-1] == "name" and self._name is None:
                name = _decoded(self._string)
                if isinstance(name, str):
                    self._name = name
                    out.append(Named(self.calls, name))
            elif self._args_state == "open" and self._args_kind == "string":
                self._args_state = "done"

    def _new_call(self) -> None:
        self._name = None
        self._args, self._unsent = [], []
        self._args_state = self._args_kind = ""

    def _call_ended(self, out: list) -> None:
        self._send_arguments(out)
        if self._name is None or self._args_state != "done":
            return
        try:
            arguments = json.loads("".join(self._args))
        except ValueError:
            return
        out.append(Called(self.calls, self._name, json.dumps(arguments, ensure_ascii=False)))
        self.calls += 1

    def _send_arguments(self, out: list) -> None:
        # A call's arguments go out once it is named: until then they wait.
        if self._unsent and self._name is not None:
            out.append(Arguments(self.calls, "".join(self._unsent)))
            self._unsent = []


def _decoded(raw: list[str]):
    try:
        return json.loads("".join(raw))
    except ValueError:
        return None
